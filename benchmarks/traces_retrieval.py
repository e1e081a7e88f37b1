"""What the non-wiki trace families share: chunkers, retrievers and the request generator.

A family (:mod:`promptsplice.benchmarks.traces_families`) supplies documents and a
:class:`FamilySpec`; :func:`generate_family` turns them into a trace the way a RAG
service would produce one, with no hand-made noise in the ranking:

* **Chunking** -- ``window``: windows of about ``window_bytes`` UTF-8 bytes overlapping
  by about ``overlap_bytes``, cut at word boundaries; ``paragraph``: blank-line
  paragraphs packed up to ``window_bytes``, no overlap; ``whole``: one chunk per document.
  Every chunk carries ``source`` and ``byte_span`` (its bytes in the source document), so
  the reader can check offsets against text.  Sentence chunks (a finer index) provide
  contained passages.
* **Retrieval** -- a real ranking of every chunk for the query text: ``bm25``
  (k1 1.2, b 0.75), ``tfidf`` (cosine), ``dense`` (cosine of hashed character 3-gram
  vectors, a stand-in for an embedding model with the same failure mode: near-synonyms
  match, rare terms do not dominate) or ``hybrid`` (reciprocal-rank fusion of bm25 and
  dense, k = 60).  The same query text always returns the same list.
* **Questions** -- ``topics`` question topics, each with a few phrasings (reformulations:
  the same need in other words, so the retrieved set and its order shift a little);
  topics are Zipf-popular with exponent ``zipf_s``; with probability ``p_reask`` a
  request re-asks the exact text of an earlier request (support desks, FAQ bots).
* **Second index and finer index** -- with probability ``p_duplicate`` (decided per
  query text, so a re-ask repeats it) a second index returns one retrieved chunk again
  under its own id, next to the original; with probability ``p_contained`` a sentence
  chunk inside a retrieved window is returned too.
"""

from __future__ import annotations

import math
import random
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from promptsplice.benchmarks.traces_format import BYTE_SPAN, RagChunk, RagRequest
from promptsplice.errors import ConfigError

__all__ = ["SourceDoc", "FamilySpec", "Retriever", "RETRIEVERS", "generate_family", "slugify"]

RETRIEVERS = ("bm25", "tfidf", "dense", "hybrid")

_TERM = re.compile(r"[a-z0-9_]+")
_WORD = re.compile(r"\S+")
_SENTENCE = re.compile(r"\S.*?(?:[.!?][\"')\]]*(?=\s)|(?=\n\n)|$)", re.DOTALL)
_STOP = frozenset(
    "a an and are as at be been but by can do does for from has have how i if in into is it "
    "its me my not of on or so than that the their then there these this to was we what when "
    "where which who why will with you your should could would about".split()
)


@dataclass(frozen=True, slots=True)
class SourceDoc:
    """One source document: its title (``source`` in chunk metadata), text and URL."""

    title: str
    text: str
    url: str = ""


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """The shape of one trace family (see the module docstring)."""

    name: str
    systems: tuple[str, ...]
    system_weights: tuple[float, ...]
    chunker: str  # window | paragraph | whole
    window_bytes: int
    overlap_bytes: int
    retrieval: str
    top_k: int
    topic_ratio: float
    min_topics: int
    max_topics: int
    zipf_s: float
    p_reask: float
    p_duplicate: float
    p_contained: float
    templates: tuple[str, ...] = ()
    phrasings: int = 3
    id_prefix: str = ""
    index2: str = "mirror"


@dataclass(frozen=True, slots=True)
class _Chunk:
    id: str
    text: str
    doc: int
    span: tuple[int, int]  # UTF-8 byte offsets in the document
    kind: str  # window | paragraph | whole | sentence

    def to_rag(self, doc: SourceDoc, index: str | None = None) -> RagChunk:
        meta: dict = {"source": doc.title, BYTE_SPAN: [self.span[0], self.span[1]], "chunker": self.kind}
        if doc.url:
            meta["url"] = doc.url
        if index:
            meta["index"] = index
            return RagChunk(f"{index}:{self.id}", self.text, meta)
        return RagChunk(self.id, self.text, meta)


def slugify(title: str) -> str:
    ascii_ = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[^a-z0-9]+", "-", ascii_.lower()).strip("-") or "doc"


def terms(text: str) -> list[str]:
    return [t for t in _TERM.findall(text.lower()) if t not in _STOP and len(t) > 1]


# --------------------------------------------------------------------------- chunking


def _byte_offsets(text: str) -> list[int]:
    """UTF-8 byte offset of every character index (and of the end)."""
    out = [0]
    for ch in text:
        out.append(out[-1] + len(ch.encode("utf-8")))
    return out


def _chunk_doc(doc: SourceDoc, d: int, slug: str, spec: FamilySpec) -> tuple[list[_Chunk], list[_Chunk]]:
    """(primary chunks, sentence chunks) of one document."""
    text = doc.text
    off = _byte_offsets(text)
    spans: list[tuple[int, int]] = []  # character spans
    if spec.chunker == "whole":
        spans = [(0, len(text))]
    elif spec.chunker == "paragraph":
        start = end = None
        for m in re.finditer(r"\S(?:.*?\S)?(?=\n\s*\n|\s*$)", text, re.DOTALL):
            if start is not None and off[m.end()] - off[start] > spec.window_bytes:
                spans.append((start, end))
                start = None
            if start is None:
                start = m.start()
            end = m.end()
        if start is not None:
            spans.append((start, end))
    elif spec.chunker == "window":
        words = [m.span() for m in _WORD.finditer(text)]
        i = 0
        while i < len(words):
            j = i
            while j + 1 < len(words) and off[words[j + 1][1]] - off[words[i][0]] <= spec.window_bytes:
                j += 1
            spans.append((words[i][0], words[j][1]))
            if j == len(words) - 1:
                break
            # next window starts about overlap_bytes before this one's end
            k = j
            while k > i + 1 and off[words[j][1]] - off[words[k][0]] < spec.overlap_bytes:
                k -= 1
            i = max(i + 1, k if spec.overlap_bytes else j + 1)
    else:
        raise ConfigError(f"unknown chunker {spec.chunker!r}; use window, paragraph or whole")
    prim = [_Chunk(f"{spec.id_prefix}{slug}@{off[a]}-{off[b]}", text[a:b], d, (off[a], off[b]), spec.chunker)
            for a, b in spans if b > a]
    sents = []
    for m in _SENTENCE.finditer(text):
        s = m.group().rstrip()
        if len(_WORD.findall(s)) >= 6:
            a = m.start()
            b = a + len(s)
            sents.append(_Chunk(f"{spec.id_prefix}{slug}@s{off[a]}-{off[b]}", s, d, (off[a], off[b]), "sentence"))
    return prim, sents


# --------------------------------------------------------------------------- retrieval


class Retriever:
    """Ranks a fixed list of texts for a query (see the module docstring for methods)."""

    def __init__(self, method: str, texts: Sequence[str], *, dim: int = 4096) -> None:
        if method not in RETRIEVERS:
            raise ConfigError(f"unknown retrieval method {method!r}; use one of {', '.join(RETRIEVERS)}")
        self.method = method
        self.n = len(texts)
        toks = [terms(t) for t in texts]
        df: Counter[str] = Counter()
        for ts in toks:
            df.update(set(ts))
        self._idf = {t: math.log(1 + (self.n - c + 0.5) / (c + 0.5)) for t, c in df.items()}
        lens = np.array([len(ts) for ts in toks], dtype=np.float64)
        avg = float(lens.mean()) if self.n else 1.0
        k1, b = 1.2, 0.75
        post_bm25: dict[str, list[tuple[int, float]]] = {}
        post_tfidf: dict[str, list[tuple[int, float]]] = {}
        norms = np.zeros(self.n)
        for i, ts in enumerate(toks):
            for t, tf in Counter(ts).items():
                idf = self._idf[t]
                post_bm25.setdefault(t, []).append((i, idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lens[i] / avg))))
                w = (1 + math.log(tf)) * idf
                post_tfidf.setdefault(t, []).append((i, w))
                norms[i] += w * w
        norms = np.sqrt(np.maximum(norms, 1e-12))
        self._bm25 = {t: (np.array([i for i, _ in p]), np.array([w for _, w in p])) for t, p in post_bm25.items()}
        self._tfidf = {
            t: (np.array([i for i, _ in p]), np.array([w for _, w in p]) / norms[[i for i, _ in p]])
            for t, p in post_tfidf.items()
        }
        self._dim = dim
        self._dense = np.stack([self._embed(t) for t in texts]) if method in ("dense", "hybrid") and texts else None

    def _embed(self, text: str) -> np.ndarray:
        """Hashed character 3-grams of the lower-cased terms, L2-normalized."""
        s = (" " + " ".join(_TERM.findall(text.lower())) + " ").encode("utf-8")
        b = np.frombuffer(s, dtype=np.uint8).astype(np.uint64)
        v = np.zeros(self._dim, dtype=np.float32)
        if len(b) >= 3:
            code = (b[:-2] << np.uint64(16)) | (b[1:-1] << np.uint64(8)) | b[2:]
            slot = ((code * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)) % np.uint64(self._dim)
            np.add.at(v, slot.astype(np.int64), 1.0)
        n = float(np.linalg.norm(v))
        return v / n if n else v

    def _sparse(self, post: dict, query: str, idf_weight: bool) -> np.ndarray:
        scores = np.zeros(self.n)
        for t, qtf in Counter(terms(query)).items():
            if t in post:
                idx, w = post[t]
                scores[idx] += w * (self._idf[t] if idf_weight else 1.0) * qtf
        return scores

    def scores(self, query: str, method: str | None = None) -> np.ndarray:
        m = method or self.method
        if m == "bm25":
            return self._sparse(self._bm25, query, False)
        if m == "tfidf":
            return self._sparse(self._tfidf, query, True)
        if m == "dense":
            return self._dense @ self._embed(query)  # type: ignore[operator]
        fused = np.zeros(self.n)
        for sub in ("bm25", "dense"):
            order = np.argsort(-self.scores(query, sub), kind="stable")
            fused[order] += 1.0 / (60 + np.arange(1, self.n + 1))
        return fused

    def search(self, query: str, k: int) -> list[int]:
        """Indices of the ``k`` best texts, best first (ties: lower index first)."""
        s = self.scores(query)
        order = np.argsort(-s, kind="stable")
        return [int(i) for i in order[:k]]


# --------------------------------------------------------------------------- questions


def salient_terms(text: str, idf: dict[str, float], n: int) -> list[str]:
    """The ``n`` terms of ``text`` with the highest tf-idf, in order of first use."""
    ts = terms(text)
    tf = Counter(ts)
    best = sorted(tf, key=lambda t: (-tf[t] * idf.get(t, 0.0), t))[:n]
    return sorted(best, key=ts.index)


def _zipf(n: int, s: float) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -s
    return p / p.sum()


def generate_family(
    spec: FamilySpec,
    docs: Sequence[SourceDoc],
    *,
    requests: int,
    seed: int,
    topics: Callable[[random.Random, list[SourceDoc], int, Retriever], list[list[str]]] | None = None,
) -> list[RagRequest]:
    """Generate ``requests`` requests over ``docs`` (see the module docstring).

    ``topics(rng, docs, n, retriever)`` may supply the question phrasings of ``n`` topics
    (each a list, the dominant phrasing first); by default they are templated from each
    topic document's title and salient terms.
    """
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigError(f"requests must be an integer >= 1, got {requests!r}")
    if not docs:
        raise ConfigError(f"trace family {spec.name!r}: its source has no documents")
    rng = random.Random(f"promptsplice-rag:{spec.name}:{seed}")
    nrng = np.random.default_rng(rng.getrandbits(128))
    docs = _unique_titles(docs)
    prim: list[_Chunk] = []
    sents: dict[int, list[_Chunk]] = {}
    slugs: set[str] = set()
    for d, doc in enumerate(docs):
        slug = base = slugify(doc.title)
        n = 2
        while slug in slugs:
            slug, n = f"{base}-{n}", n + 1
        slugs.add(slug)
        p, s = _chunk_doc(doc, d, slug, spec)
        prim.extend(p)
        sents[d] = s
    retriever = Retriever(spec.retrieval, [c.text for c in prim])

    n_topics = min(spec.max_topics, max(spec.min_topics, round(requests * spec.topic_ratio)))
    if topics is not None:
        phr = topics(rng, docs, n_topics, retriever)
    else:
        phr = _template_topics(rng, spec, docs, n_topics, retriever)
    if not phr:
        raise ConfigError(f"trace family {spec.name!r}: no question topics")
    popularity = _zipf(len(phr), spec.zipf_s)
    weights = [np.array([0.5 ** i for i in range(len(p))]) / sum(0.5 ** i for i in range(len(p))) for p in phr]
    topic_of = nrng.choice(len(phr), size=requests, p=popularity)
    sys_p = np.array(spec.system_weights) / sum(spec.system_weights)
    system_of = nrng.choice(len(sys_p), size=requests, p=sys_p)

    results: dict[str, list[RagChunk]] = {}
    asked: list[str] = []
    out: list[RagRequest] = []
    for n in range(requests):
        if asked and rng.random() < spec.p_reask:
            query = asked[rng.randrange(len(asked))]
        else:
            t = int(topic_of[n])
            query = phr[t][int(nrng.choice(len(phr[t]), p=weights[t]))]
        asked.append(query)
        if query not in results:
            results[query] = _retrieve(spec, seed, query, retriever, prim, sents, docs)
        out.append(RagRequest(id=f"r{n:05d}", system=spec.systems[int(system_of[n])],
                              chunks=[RagChunk(c.id, c.text, dict(c.metadata)) for c in results[query]],
                              query=query))
    return out


def _unique_titles(docs: Sequence[SourceDoc]) -> list[SourceDoc]:
    """A title names one text (it is the chunks' ``source``): later namesakes get `` (n)``."""
    seen: dict[str, int] = {}
    out = []
    for doc in docs:
        n = seen.get(doc.title, 0) + 1
        seen[doc.title] = n
        out.append(doc if n == 1 else SourceDoc(f"{doc.title} ({n})", doc.text, doc.url))
    return out


def _template_topics(rng: random.Random, spec: FamilySpec, docs: list[SourceDoc], n: int,
                     retriever: Retriever) -> list[list[str]]:
    picks = rng.sample(range(len(docs)), min(n, len(docs)))
    out = []
    for d in picks:
        doc = docs[d]
        key = salient_terms(doc.text, retriever._idf, 4)
        fill = {"title": doc.title, "t1": key[0] if key else doc.title,
                "t2": key[1] if len(key) > 1 else doc.title, "t3": key[2] if len(key) > 2 else doc.title}
        tps = rng.sample(spec.templates, min(spec.phrasings, len(spec.templates)))
        out.append([tp.format(**fill) for tp in tps])
    return out


def _retrieve(spec: FamilySpec, seed: int, query: str, retriever: Retriever, prim: list[_Chunk],
              sents: dict[int, list[_Chunk]], docs: list[SourceDoc]) -> list[RagChunk]:
    """The retrieved list for one query text (deterministic: a re-ask repeats it)."""
    qrng = random.Random(f"{spec.name}:{seed}:{query}")
    ranked = [prim[i] for i in retriever.search(query, spec.top_k)]
    chunks: list[RagChunk] = [c.to_rag(docs[c.doc]) for c in ranked]
    if ranked and qrng.random() < spec.p_contained:
        cands = list(range(len(ranked)))
        qrng.shuffle(cands)
        for i in cands:
            w = ranked[i]
            inside = [s for s in sents[w.doc] if w.span[0] <= s.span[0] and s.span[1] <= w.span[1]
                      and s.text != w.text]
            if inside:
                s = qrng.choice(inside)
                chunks.insert(qrng.randint(0, len(chunks)), s.to_rag(docs[s.doc]))
                break
    if ranked and qrng.random() < spec.p_duplicate:
        i = qrng.randrange(len(ranked))
        pos = next(j for j, c in enumerate(chunks) if c.id == ranked[i].id)
        chunks.insert(pos + qrng.choice((0, 1)), ranked[i].to_rag(docs[ranked[i].doc], spec.index2))
    return chunks
