"""PromptspliceRetriever / PromptspliceCompressor on real text and the real LangChain suite.

The underlying retriever is a real keyword retriever over Wikipedia lead paragraphs
(``promptsplice.benchmarks.traces.load_wiki_leads``), indexed twice the way RAG stacks do it: as
overlapping sliding windows per article (``metadata["source"]``) and, from a second
index, whole leads.  So its results carry real duplicates, contained chunks and
window overlaps.  The standard ``RetrieversIntegrationTests`` run on the wrapper.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.retrievers import BaseRetriever
from langchain_tests.integration_tests import RetrieversIntegrationTests

from promptsplice.engine_adapters.integrations._langchain_retrieval import (
    PROVENANCE_KEY,
    PromptspliceCompressor,
    PromptspliceRetriever,
    splice_documents,
)
from promptsplice.errors import ConfigError, ConflictingChunkIdError, InvalidChunkError, PromptspliceError

N_ARTICLES = 40
WINDOW = 240
STRIDE = 160  # 80 characters of overlap between neighbouring windows


def _corpus() -> list[Document]:
    from promptsplice.benchmarks.traces import load_wiki_leads

    docs: list[Document] = []
    for n, (title, lead) in enumerate(load_wiki_leads()[:N_ARTICLES]):
        starts = range(0, max(1, len(lead) - WINDOW + STRIDE), STRIDE)
        for w, s in enumerate(starts):
            docs.append(Document(
                page_content=lead[s : s + WINDOW], id=f"win:{n}:{w}",
                metadata={"source": title, "window": w, "index": "windows"},
            ))
        docs.append(Document(page_content=lead, id=f"lead:{n}", metadata={"source": title, "index": "leads"}))
    return docs


CORPUS = _corpus()


class KeywordRetriever(BaseRetriever):
    """Real retrieval: documents ranked by how many query words they contain."""

    docs: list[Document]
    top: int = 8
    async_calls: int = 0

    def _rank(self, query: str) -> list[Document]:
        words = {w.lower().strip(".,?") for w in query.split() if len(w) > 2}
        scored = [
            (sum(w in d.page_content.lower() for w in words), -i, d)
            for i, d in enumerate(self.docs)
        ]
        scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [d for s, _, d in scored[: self.top] if s > 0]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return self._rank(query)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        self.async_calls += 1
        await asyncio.sleep(0)
        return self._rank(query)


class FixedRetriever(BaseRetriever):
    """Returns the given documents as they are (to control order and content)."""

    docs: list[Any]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Any]:
        return list(self.docs)


QUERY = "music century style modernism"


# The suite's async test needs a loop (this repo has no asyncio_mode=auto); the class
# mark also reaches its sync tests, which pytest-asyncio only warns about.
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:The test <Function .* is marked with '@pytest.mark.asyncio'")
class TestPromptspliceRetrieverStandard(RetrieversIntegrationTests):
    """LangChain's own retriever suite, on the wrapper over the keyword retriever."""

    @property
    def retriever_constructor(self) -> type[PromptspliceRetriever]:
        return PromptspliceRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"retriever": KeywordRetriever(docs=CORPUS, top=40), "k": 4}

    @property
    def retriever_query_example(self) -> str:
        return QUERY


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def asm(default_tok):
    from promptsplice.assembler import Assembler

    return Assembler(default_tok, block_size=16, policy="stable")


def _prov(doc: Document) -> dict:
    return doc.metadata[PROVENANCE_KEY]


def _reachable_ids(out: list[Document]) -> set[str]:
    ids = {o["id"] for d in out for o in _prov(d)["origins"]}
    if out:
        req = _prov(out[0])["request"]
        ids |= {d["id"] for d in req["dropped"]}
        ids |= {o["id"] for c in req["beyond_k"] for o in c["origins"]}
    return ids


def _check_spans(out: list[Document], inputs: list[Document]) -> None:
    """Every origin's span slices the kept bytes back to that input's bytes."""
    for d in out:
        data = d.page_content.encode("utf-8")
        for o in _prov(d)["origins"]:
            if o["span"] is not None and not _prov(d)["removed_passages"]:
                s, e = o["span"]
                assert data[s:e] == inputs[o["index"]].page_content.encode("utf-8")


# --------------------------------------------------------------------------- behaviour


def test_real_retrieval_results_are_deduplicated_with_provenance(asm):
    base = KeywordRetriever(docs=CORPUS, top=12)
    raw = base.invoke(QUERY)
    out = PromptspliceRetriever(retriever=base, assembler=asm).invoke(QUERY)
    assert len(out) < len(raw)  # the two indexes really overlap
    assert _reachable_ids(out) == {d.id for d in raw}
    assert sum(len(_prov(d)["origins"]) for d in out) == len(raw)
    relations = {o["relation"] for d in out for o in _prov(d)["origins"]}
    assert "contained" in relations or "merged" in relations
    _check_spans(out, raw)
    texts = [d.page_content for d in out]
    assert not any(a != b and a in b for a, b in itertools.permutations(texts, 2))


def test_duplicates_and_overlapping_windows_merge_with_provenance(asm):
    from promptsplice.benchmarks.traces import load_wiki_leads

    title, lead = load_wiki_leads()[3]
    w0, w1 = lead[:200], lead[120:330]  # 80 characters of overlap
    other_title, other = load_wiki_leads()[7]
    docs = [
        Document(page_content=w0, id="w0", metadata={"source": title, "rank": 0}),
        Document(page_content=other, id="o", metadata={"source": other_title, "rank": 1}),
        Document(page_content=w1, id="w1", metadata={"source": title, "rank": 2}),
        Document(page_content=w0, id="w0-copy", metadata={"source": "mirror", "rank": 3}),
    ]
    out = PromptspliceRetriever(retriever=FixedRetriever(docs=docs), assembler=asm).invoke("q")
    assert len(out) == 2
    merged = next(d for d in out if d.id == "w0")
    assert merged.page_content == lead[:330]
    assert merged.metadata["source"] == title and merged.metadata["rank"] == 0
    origins = {o["id"]: o for o in _prov(merged)["origins"]}
    assert origins["w0"]["relation"] == "kept"
    assert origins["w1"]["relation"] == "merged"
    assert origins["w0-copy"]["relation"] == "duplicate"
    assert origins["w0-copy"]["metadata"] == {"source": "mirror", "rank": 3}
    data = merged.page_content.encode()
    s, e = origins["w1"]["span"]
    assert data[s:e] == w1.encode()
    assert next(d for d in out if d.id == "o").page_content == other
    _check_spans(out, docs)


def test_order_is_canonical_across_permutations(default_tok):
    from promptsplice.assembler import Assembler

    docs = [Document(page_content=t, id=f"d{i}", metadata={"i": i})
            for i, (_, t) in enumerate(__import__("promptsplice.benchmarks.traces", fromlist=["x"]).load_wiki_leads()[10:16])]
    rng = random.Random(0)
    for learn in (False, True):
        asm = Assembler(default_tok, block_size=16, policy="stable")
        orders = set()
        for _ in range(6):
            perm = docs[:]
            rng.shuffle(perm)
            out = PromptspliceRetriever(retriever=FixedRetriever(docs=perm), assembler=asm, learn=learn).invoke("q")
            assert sorted(d.id for d in out) == sorted(d.id for d in docs)
            orders.add(tuple(d.id for d in out))
        assert len(orders) == 1, (learn, orders)
    # the order the assembler would send is the order returned
    prompt = asm.preview([{"id": d.id, "text": d.page_content} for d in docs], query="q")
    assert tuple(prompt.chunk_order) == orders.pop()


SHARED = (
    "The Treaty of Westphalia (1648) ended the Thirty Years' War and set out the principle "
    "that each state is sovereign over its own territory and domestic affairs."
)


def _sharing_docs():
    return [Document(page_content=f"{n} opens here.\n\n{SHARED}\n\n{n} closes.", id=n) for n in ("A", "B", "C")]


def test_a_shared_paragraph_stays_in_one_document_whatever_the_retrieval_order(default_tok):
    """With an assembler deduplicating in content order (and no ``k``), every order of
    the same documents returns the same texts (the prompt, and its cache hit, follow)."""
    from promptsplice.assembler import Assembler
    from promptsplice.dedup import DedupConfig

    asm = Assembler(default_tok, block_size=16, policy="stable", dedup_config=DedupConfig(order="content"))
    outs = set()
    for perm in itertools.permutations(_sharing_docs()):
        out = PromptspliceRetriever(retriever=FixedRetriever(docs=list(perm)), assembler=asm, learn=False).invoke("q")
        outs.add(tuple((d.id, d.page_content) for d in out))
        assert sum(SHARED in d.page_content for d in out) == 1
    assert len(outs) == 1


def test_with_k_a_shared_paragraph_stays_in_the_better_ranked_document(asm):
    """With ``k`` dedup runs in retrieval order, so the paragraph is never left in a
    document the cut drops (content order would keep it in whichever digest sorts first)."""
    for perm in itertools.permutations(_sharing_docs()):
        out = PromptspliceRetriever(retriever=FixedRetriever(docs=list(perm)), assembler=asm, learn=False).invoke("q", k=1)
        assert [(d.id, SHARED in d.page_content) for d in out] == [(perm[0].id, True)]


def test_k_keeps_best_ranked_then_orders_and_names_the_rest(asm):
    from promptsplice.benchmarks.traces import load_wiki_leads

    leads = load_wiki_leads()[20:26]
    docs = [Document(page_content=t, id=f"r{i}") for i, (_, t) in enumerate(leads)]
    docs.insert(1, Document(page_content=leads[0][1], id="r0-dup"))
    out = PromptspliceRetriever(retriever=FixedRetriever(docs=docs), assembler=asm).invoke("q", k=3)
    assert sorted(d.id for d in out) == ["r0", "r1", "r2"]  # best-ranked after dedup
    beyond = [c["id"] for c in _prov(out[0])["request"]["beyond_k"]]
    assert beyond == ["r3", "r4", "r5"]
    assert _reachable_ids(out) == {d.id for d in docs}
    with pytest.raises(ConfigError):
        PromptspliceRetriever(retriever=FixedRetriever(docs=docs), k=0)
    with pytest.raises(ConfigError):
        PromptspliceRetriever(retriever=FixedRetriever(docs=docs)).invoke("q", k=-1)
    with pytest.raises(ConfigError):
        PromptspliceRetriever(retriever="not a retriever")


def test_async_path_delegates_to_the_wrapped_async_path(asm):
    base = KeywordRetriever(docs=CORPUS, top=12)
    wrapper = PromptspliceRetriever(retriever=base, assembler=asm, learn=False)
    sync_out = wrapper.invoke(QUERY)
    async_out = asyncio.run(wrapper.ainvoke(QUERY, k=2))
    assert base.async_calls == 1
    assert len(async_out) == 2
    full = asyncio.run(wrapper.ainvoke(QUERY))
    assert [(d.id, d.page_content) for d in full] == [(d.id, d.page_content) for d in sync_out]


class CompressionRetriever(BaseRetriever):
    """What ``ContextualCompressionRetriever`` does (``langchain_classic`` is not
    installed here): retrieve, then ``compress_documents(docs, query)``."""

    base_retriever: BaseRetriever
    base_compressor: BaseDocumentCompressor

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        docs = self.base_retriever.invoke(query, config={"callbacks": run_manager.get_child()})
        return list(self.base_compressor.compress_documents(docs, query, callbacks=run_manager.get_child()))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        docs = await self.base_retriever.ainvoke(query, config={"callbacks": run_manager.get_child()})
        return list(await self.base_compressor.acompress_documents(docs, query, callbacks=run_manager.get_child()))


def test_compressor_in_a_compression_pipeline(asm):
    base = KeywordRetriever(docs=CORPUS, top=12)
    compressor = PromptspliceCompressor(assembler=asm, learn=False)
    pipeline = CompressionRetriever(base_retriever=base, base_compressor=compressor)
    out = pipeline.invoke(QUERY)
    direct = PromptspliceRetriever(retriever=base, assembler=asm, learn=False).invoke(QUERY)
    assert [d.page_content for d in out] == [d.page_content for d in direct]
    assert _reachable_ids(out) == {d.id for d in base.invoke(QUERY)}
    aout = asyncio.run(pipeline.ainvoke(QUERY))
    assert [d.page_content for d in aout] == [d.page_content for d in out]
    assert len(PromptspliceCompressor(assembler=asm, k=2).compress_documents(base.invoke(QUERY), QUERY)) == 2
    with pytest.raises(ConfigError):
        PromptspliceCompressor(k="3")


def test_empty_input_and_all_empty_documents(asm, caplog):
    assert PromptspliceRetriever(retriever=FixedRetriever(docs=[]), assembler=asm).invoke("q") == []
    assert PromptspliceCompressor(assembler=asm).compress_documents([], "q") == []
    blanks = [Document(page_content="   ", id="b1"), Document(page_content="\n", id="b2")]
    with caplog.at_level(logging.WARNING, logger="promptsplice.engine_adapters.integrations._langchain_retrieval"):
        out = PromptspliceRetriever(retriever=FixedRetriever(docs=blanks), assembler=asm).invoke("q")
    assert out == []
    assert "b1" in caplog.text and "b2" in caplog.text  # not silent
    mixed = [Document(page_content=" ", id="blank"), Document(page_content="Some text here.", id="t")]
    out = splice_documents(mixed, "q", assembler=asm)
    assert [d.id for d in out] == ["t"]
    assert _prov(out[0])["request"]["dropped"] == [
        {"index": 0, "id": "blank", "reason": "empty", "metadata": {}}
    ]


def test_non_str_page_content_is_rejected(asm):
    bad = Document.model_construct(page_content=b"bytes, not str", metadata={}, id="x")
    good = Document(page_content="fine", id="g")
    with pytest.raises(InvalidChunkError, match="document 1.*page_content must be a str") as info:
        PromptspliceRetriever(retriever=FixedRetriever(docs=[good, bad]), assembler=asm).invoke("q")
    assert isinstance(info.value, PromptspliceError)
    with pytest.raises(InvalidChunkError, match="not a langchain Document"):
        PromptspliceCompressor(assembler=asm).compress_documents([good, "plain str"], "q")


def test_k_ranks_a_hit_contained_in_a_later_document_by_the_hit(asm):
    """Dedup lists a chunk that contains an earlier hit at the container's own position:
    ``k=1`` kept the second-ranked document and cut the best hit (inside the third)."""
    small = "The quick brown fox jumps over the lazy dog. " * 6
    big = small + "Extra tail sentence that makes this one longer."
    docs = [
        Document(page_content=small, id="best", metadata={"rank": 0}),
        Document(page_content="Cats nap in the sun all afternoon long.", id="second", metadata={"rank": 1}),
        Document(page_content=big, id="third", metadata={"rank": 2}),
    ]
    out = PromptspliceRetriever(retriever=FixedRetriever(docs=docs), assembler=asm, k=1).invoke("fox")
    # ranked at the hit's rank, under the id and metadata of the text it carries (the
    # hit's own metadata described another text: a citation of it named the wrong source)
    assert [(d.id, d.page_content, d.metadata["rank"]) for d in out] == [("third", big, 2)]
    prov = _prov(out[0])
    assert prov["chunk_id"] == "third"  # the container's text was kept
    assert [(o["id"], o["relation"], o["metadata"]) for o in prov["origins"]] == [
        ("third", "kept", {"rank": 2}), ("best", "contained", {"rank": 0})]
    assert [(c["index"], c["id"], c["metadata"]) for c in prov["request"]["beyond_k"]] == [(1, "second", {"rank": 1})]
    # the compressor cuts the same way; with no k both come out
    assert [d.id for d in PromptspliceCompressor(assembler=asm, k=1).compress_documents(docs, "fox")] == ["third"]
    assert sorted(d.id for d in splice_documents(docs, "fox", assembler=asm)) == ["second", "third"]


def test_chunks_of_one_source_sharing_its_metadata_id_are_spliced_not_refused(asm):
    """Text splitters copy a loader's ``metadata["id"]`` onto every chunk of a source:
    dedup refused them as one id naming two texts, and the caller cannot change the ids
    its retriever returns."""
    docs = [Document(page_content="First part of the manual, on setup.", metadata={"id": "m1", "page": 1}),
            Document(page_content="Second part of the manual, on repair.", metadata={"id": "m1", "page": 2}),
            Document(page_content="First part of the manual, on setup.", metadata={"id": "m1", "page": 1})]
    out = splice_documents(docs, "how to repair", assembler=asm)
    assert sorted((d.page_content, d.metadata["page"]) for d in out) == [
        ("First part of the manual, on setup.", 1), ("Second part of the manual, on repair.", 2)]
    ids = {o["id"] for d in out for o in _prov(d)["origins"]}
    assert ids == {"m1", "m1#1"}  # the second text's id made unique by its position
    dup = next(d for d in out if d.metadata["page"] == 1)
    assert [o["relation"] for o in _prov(dup)["origins"]] == ["kept", "duplicate"]
    # a Document.id is the retriever's own: two texts under one stay an error
    with pytest.raises(ConflictingChunkIdError, match="'x'"):
        splice_documents([Document(page_content="one text", id="x"), Document(page_content="another", id="x")],
                         "q", assembler=asm)


def test_a_document_id_names_its_own_text_in_any_retrieval_order(asm):
    """A ``metadata["id"]`` of another text was renamed only when it came after the
    ``Document.id`` naming the same id: the other order raised ConflictingChunkIdError,
    telling the caller to fix ids that were unique.  And a made ``doc1#1`` clashed with
    a later document's own ``Document.id="doc1#1"``."""
    loader = Document(page_content="A chunk the loader named.", metadata={"id": "x"})
    own = Document(page_content="The retriever's own document.", id="x")
    for docs in ([loader, own], [own, loader]):
        out = splice_documents(docs, "q", assembler=asm, learn=False)
        names = {o["id"]: docs[o["index"]] for d in out for o in _prov(d)["origins"]}
        assert names == {"x": own, f"x#{docs.index(loader)}": loader}
        assert sorted((d.page_content, d.id or "") for d in out) == sorted((d.page_content, d.id or "") for d in docs)
    docs = [Document(page_content="A", id="doc1"), Document(page_content="B", metadata={"id": "doc1"}),
            Document(page_content="C", id="doc1#1"), Document(page_content="D", metadata={"id": "doc1#1.1"})]
    out = splice_documents(docs, "q", assembler=asm, learn=False)
    assert {o["id"]: docs[o["index"]].page_content for d in out for o in _prov(d)["origins"]} == {
        "doc1": "A", "doc1#1.2": "B", "doc1#1": "C", "doc1#1.1": "D"}


_IDS = ["x", "x#0", "x#1", "x#1.1", "7", 7]
_TEXTS = ["Alpha text.", "Beta text.", "Gamma text."]


@st.composite
def _id_cases(draw):
    """Documents whose ids (``Document.id``, ``metadata["id"]``, both or neither) name
    few texts, some of them what a renaming would make, and a retrieval order of them."""
    docs = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["own", "meta", "both", "none"]))
        own = draw(st.sampled_from([i for i in _IDS if isinstance(i, str)])) if kind in ("own", "both") else None
        meta = {"id": draw(st.sampled_from(_IDS))} if kind in ("meta", "both") else {}
        docs.append(Document(page_content=draw(st.sampled_from(_TEXTS)), id=own, metadata=meta))
    return docs, draw(st.permutations(docs))


@settings(max_examples=200, deadline=None)
@given(_id_cases())
def test_property_ids_of_repeated_metadata_ids_are_made_whatever_the_order(default_tok, case):
    """Only two texts under one ``Document.id`` are refused, in every retrieval order;
    otherwise each input is in the provenance once, each id names one text, a
    ``Document.id`` is kept, and a made id is no id any document carries."""
    from promptsplice.assembler import Assembler

    asm = Assembler(default_tok, block_size=16, policy="stable")
    given_docs, shuffled = case
    texts: dict[str, set[str]] = {}
    for d in given_docs:
        if d.id:
            texts.setdefault(d.id, set()).add(d.page_content)
    conflict = any(len(t) > 1 for t in texts.values())
    carried = {str(v) for d in given_docs for v in (d.id, d.metadata.get("id")) if v}
    for docs in (given_docs, shuffled):
        if conflict:
            with pytest.raises(ConflictingChunkIdError):
                splice_documents(docs, "q", assembler=asm, learn=False)
            continue
        out = splice_documents(docs, "q", assembler=asm, learn=False)
        origins = [o for d in out for o in _prov(d)["origins"]]
        assert sorted(o["index"] for o in origins) == list(range(len(docs)))
        named: dict[str, set[str]] = {}
        for o in origins:
            doc = docs[o["index"]]
            named.setdefault(o["id"], set()).add(doc.page_content)
            mine = doc.id or doc.metadata.get("id")
            if doc.id:
                assert o["id"] == doc.id
            elif mine is not None and o["id"] != str(mine):  # made: unique, never another's id
                assert o["id"].startswith(f"{mine}#{o['index']}") and o["id"] not in carried
        assert all(len(t) == 1 for t in named.values()), named


@pytest.mark.parametrize("k", [None, 3])
def test_kept_equal_texts_without_exact_dedup_each_come_out_under_their_own_ids(default_tok, k):
    """``DedupConfig(exact=False)`` keeps equal texts, under one id when their inputs
    share one (or have none: the id comes from the content); the map from id to kept
    chunk kept one of them and ``splice_documents`` raised its "report this"
    InvalidChunkError."""
    from promptsplice.assembler import Assembler
    from promptsplice.dedup import DedupConfig

    asm = Assembler(default_tok, block_size=16, dedup_config=DedupConfig(exact=False, containment=False))
    for docs in ([Document(page_content="Same text."), Document(page_content="Same text.")],
                 [Document(page_content="Same text.", id="a"), Document(page_content="Other text.", id="a#1"),
                  Document(page_content="Same text.", id="a")]):  # fmt: skip
        out = PromptspliceCompressor(assembler=asm, k=k, learn=False).compress_documents(docs, "q")
        assert sorted(d.page_content for d in out) == sorted(d.page_content for d in docs)
        origins = [o for d in out for o in _prov(d)["origins"]]
        assert sorted(o["index"] for o in origins) == list(range(len(docs)))
        for d in out:  # each output names the input whose text it is, by the input's own id
            (o,) = _prov(d)["origins"]
            own = docs[o["index"]].id
            assert d.id == own and _prov(d)["chunk_id"] == o["id"] == (own or o["id"])
            assert own is not None or o["id"].startswith("c:")


@pytest.mark.parametrize("k", [None, 2])
def test_the_assembler_lays_out_the_kept_documents_as_the_retriever_deduplicated_them(default_tok, k):
    """With ``k`` the retriever dedups in retrieval order and a content-order assembler
    in content order: re-deduplicated so, ``b`` absorbed ``a`` and ``splice_documents``
    raised ``InvalidChunkError`` (found by review).  The assembler now lays them out as
    they are."""
    from promptsplice.assembler import Assembler
    from promptsplice.dedup import DedupConfig

    asm = Assembler(default_tok, block_size=16, policy="stable", dedup_config=DedupConfig(order="content"))
    q, r = ("Quantum alpha " * 12).strip(), ("Rivers beta " * 14).strip()
    docs = [Document(page_content=f"{q}\n\n{r}", id="a"),
            Document(page_content=f"{q} extra words here\n\n{r} more extra words", id="b")]  # fmt: skip
    out = splice_documents(docs, "q", assembler=asm, k=k, learn=False)
    # retrieval order (k): b loses both paragraphs a holds, and stays; content order: a,
    # the shorter, lost them, and is contained in nothing, so it is attached to b
    expected = {None: {"b"}, 2: {"a", "b"}}[k]
    assert {d.id for d in out} == expected and _reachable_ids(out) == {"a", "b"}


@pytest.mark.parametrize("policy", ["stable", "cache_aware", "retrieval"])
@pytest.mark.parametrize("k", [None, 3])
def test_kept_documents_are_laid_out_as_they_are_even_where_a_second_dedup_would_merge(default_tok, policy, k):
    """A disclaimer P cut from window w2 (kept in the longer z) leaves w2's head
    overlapping w1's tail; w2 kept the chain and lost a passage of its own, so dedup
    leaves the two unmerged (a documented exception to its fixpoint).  The assembler
    deduplicated the kept documents again, merged them and ``splice_documents`` raised
    ``InvalidChunkError`` (found by review); it now lays them out as they are."""
    from promptsplice.assembler import Assembler
    from promptsplice.dedup import DedupConfig

    p = ("This boilerplate disclaimer paragraph is repeated on every page of the site and says nothing "
         "about the question asked by the user at all.")  # fmt: skip
    y = ("The overlapping region of the sliding window chunker covers these exact words, at least "
         "sixty-four bytes long. ")  # fmt: skip
    w1 = "Page one begins with its own introduction about rivers and bridges. " + y
    w2 = f"{p}\n\n{y}Then page two continues with details about the harbour, the tolls and the merchants."
    z = f"{p}\n\nAn unrelated article that carries the disclaimer too, the longest chunk here. " + "Filler. " * 30
    src = {"source": "site/page"}
    docs = [Document(page_content=w1, id="w1", metadata=src), Document(page_content=w2, id="w2", metadata=src),
            Document(page_content=z, id="z")]  # fmt: skip
    asm = Assembler(default_tok, block_size=16, policy=policy, dedup_config=DedupConfig(order="content"))
    out = splice_documents(docs, "q", assembler=asm, k=k, learn=False)
    assert sorted(d.id for d in out) == ["w1", "w2", "z"] and _reachable_ids(out) == {"w1", "w2", "z"}
    assert sum(p in d.page_content for d in out) == 1


# ------------------------------------------------------- a cut at k loses no kept text

HARBOUR = ("The harbour toll was raised twice in the same decade, and the merchants who paid it "
           "moved their warehouses upriver to the free port of the neighbouring town.")  # fmt: skip
MILL = "The quick brown fox jumps over the lazy dog near the old mill."


def test_k_keeps_a_paragraph_whose_other_copy_the_cut_drops(asm):
    """The best hit lies inside the third document, whose chunk ranks first; the third
    shares a paragraph with the second.  Dedup over all three cut the paragraph from
    the third (the second was retrieved first), then ``k=1`` dropped the second: the
    output lacked a paragraph of the document it returned (found by review)."""
    docs = [Document(page_content=MILL, id="hit"),
            Document(page_content="Rivers and bridges of the valley.\n\n" + HARBOUR, id="second"),
            Document(page_content=f"{MILL}\n\n{HARBOUR}", id="third")]  # fmt: skip
    out = splice_documents(docs, "q", assembler=asm, k=1, learn=False)
    assert [(d.id, d.page_content) for d in out] == [("third", f"{MILL}\n\n{HARBOUR}")]
    prov = _prov(out[0])
    assert [(o["id"], o["relation"]) for o in prov["origins"]] == [("third", "kept"), ("hit", "contained")]
    assert prov["removed_passages"] == []
    assert [c["id"] for c in prov["request"]["beyond_k"]] == ["second"]
    _check_spans(out, docs)
    # with room for both, the second loses the paragraph to nothing: dedup as before
    both = splice_documents(docs, "q", assembler=asm, k=2, learn=False)
    assert sum(HARBOUR in d.page_content for d in both) == 1 and _reachable_ids(both) == {"hit", "second", "third"}


def test_k_keeps_the_paragraphs_of_a_document_emptied_for_one_the_cut_drops(asm):
    """``c``'s paragraphs were all found earlier (one in ``a``, one in ``b``), so dedup
    attached ``c`` to ``a``'s chunk as ``passages``; ``k=1`` kept that chunk and dropped
    ``b``: ``c``'s second paragraph was in no output document."""
    first = ("Westphalia set out the principle that each state is sovereign over its own "
             "territory and its domestic affairs, a rule that later treaties kept.")  # fmt: skip
    docs = [Document(page_content=f"{first}\n\nA short closing line of a.", id="a"),
            Document(page_content=f"Rivers of b.\n\n{HARBOUR}", id="b"),
            Document(page_content=f"{first}\n\n{HARBOUR}", id="c")]  # fmt: skip
    full = splice_documents(docs, "q", assembler=asm, learn=False)
    a = next(d for d in full if d.id == "a")
    assert ("c", "passages") in [(o["id"], o["relation"]) for o in _prov(a)["origins"]]  # the setting
    out = splice_documents(docs, "q", assembler=asm, k=1, learn=False)
    assert [d.id for d in out] == ["a"] and HARBOUR not in out[0].page_content
    # c is no longer one of a's origins: cut by k with b, not passed off as kept
    assert [o["id"] for o in _prov(out[0])["origins"]] == ["a"]
    beyond = _prov(out[0])["request"]["beyond_k"]
    assert sorted(o["id"] for c in beyond for o in c["origins"]) == ["b", "c"]


_POOL = [
    (f"Paragraph {n} of the shared pool: " + " ".join(f"{w}{n}" for w in (
        "treaty", "harbour", "merchant", "river", "bridge", "toll", "valley", "state",
        "mill", "port", "decade", "warehouse", "town", "rule", "page")) + ".").ljust(150, "~")
    for n in range(8)
]  # fmt: skip


@st.composite
def _retrievals(draw):
    """Documents made of pool paragraphs (so they share passages), some a single one
    or a window of another (contained), some with a unique short line, some blank."""
    docs: list[Document] = []
    for i in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["paras", "paras", "paras", "paras", "inside", "copy", "blank"]))
        texts = [d.page_content for d in docs if d.page_content.strip()]
        if kind == "inside" and texts:
            src = draw(st.sampled_from(texts))
            a = draw(st.integers(0, len(src) - 1))
            text = src[a : draw(st.integers(a + 1, len(src)))]
        elif kind == "copy" and texts:
            text = draw(st.sampled_from(texts))
        elif kind == "blank":
            text = draw(st.sampled_from(["", " ", "\n\n"]))
        else:
            paras = draw(st.lists(st.sampled_from(_POOL), min_size=1, max_size=4))
            if draw(st.booleans()):
                paras.insert(draw(st.integers(0, len(paras))), f"Own line of document {i}.")
            text = "\n\n".join(paras)
        meta = {"source": "pool"} if draw(st.booleans()) else {}
        docs.append(Document(page_content=text, id=f"d{i}", metadata=meta))
    return docs, draw(st.integers(1, max(1, len(docs) // 2)) | st.integers(1, len(docs)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_retrievals())
def test_property_a_cut_at_k_loses_no_text_of_the_documents_it_keeps(default_tok, case):
    from promptsplice.assembler import Assembler

    docs, k = case
    asm = Assembler(default_tok, block_size=16, policy="stable")
    out = splice_documents(docs, "q", assembler=asm, k=k, learn=False)
    assert len(out) <= k
    if not out:
        assert all(not d.page_content.strip() for d in docs)
        return
    req = _prov(out[0])["request"]
    origins = [o for d in out for o in _prov(d)["origins"]]
    origins += [o for c in req["beyond_k"] for o in c["origins"]]
    where = [o["index"] for o in origins] + [d["index"] for d in req["dropped"]]
    assert sorted(where) == list(range(len(docs)))  # every input once, by its own index
    assert all(o["id"] == docs[o["index"]].id for o in origins)
    texts = [d.page_content for d in out]
    for d in out:
        for o in _prov(d)["origins"]:
            for para in docs[o["index"]].page_content.split("\n\n"):
                if len(para.encode()) >= 128:
                    assert any(para in t for t in texts), (o["id"], para[:40], texts)
    # the same documents without k lose nothing either, and k past the chunks changes nothing
    full = splice_documents(docs, "q", assembler=asm, learn=False)
    if len(full) <= k:
        assert [(d.id, d.page_content, d.metadata) for d in out] == [
            (d.id, d.page_content, d.metadata) for d in full]


def test_cut_first_adds_the_next_ranked_chunk_when_the_kept_ones_merge():
    """White box: the kept documents, deduplicated without the others, can make fewer
    than ``k`` chunks; the next-ranked chunk's documents then join.  (Ranked here by a
    dedup without exact matching, so that two of the first ``k`` chunks are one text.)"""
    from promptsplice.dedup import DedupConfig, dedup
    from promptsplice.engine_adapters.integrations import _langchain_retrieval as lr

    docs = [Document(page_content=t, id=i) for i, t in
            [("a", "Alpha text."), ("a2", "Alpha text."), ("b", "Beta text."), ("c", "Gamma text.")]]  # fmt: skip
    inputs = lr._dedup_inputs(docs)
    ranked = sorted(dedup(inputs, exact=False, containment=False).chunks, key=lr._rank)
    assert [c.id for c in ranked] == ["a", "a2", "b", "c"]
    chosen, beyond = lr._cut_first(inputs, DedupConfig(order="retrieval"), ranked, 2)
    assert [(c.id, [(o.index, o.relation.value) for o in c.origins]) for c in chosen] == [
        ("a", [(0, "kept"), (1, "duplicate")]), ("b", [(2, "kept")])]
    assert [(c.id, [o.index for o in c.origins]) for c in beyond] == [("c", [3])]


def test_a_metadata_id_of_any_type_keeps_the_retrieval(asm):
    """LangChain does not reserve ``metadata["id"]`` (a vector store's UUID): a UUID or a
    float there made dedup refuse the whole retrieval.  Such documents are named by their
    content, and their metadata comes back as it was."""
    import uuid

    docs = [Document("alpha text", metadata={"id": uuid.UUID(int=1), "source": "a"}),
            Document("beta text", metadata={"id": 2.5, "source": "b"}),
            Document("alpha text", metadata={"id": uuid.UUID(int=3), "source": "c"})]  # a duplicate
    out = PromptspliceRetriever(retriever=FixedRetriever(docs=docs), assembler=asm, learn=False).invoke("q")
    assert sorted(d.page_content for d in out) == ["alpha text", "beta text"]
    alpha = next(d for d in out if d.page_content == "alpha text")
    assert sorted(o["index"] for o in _prov(alpha)["origins"]) == [0, 2]
    assert {o["metadata"]["source"] for o in _prov(alpha)["origins"]} == {"a", "c"}


def test_the_async_retriever_and_compressor_leave_the_event_loop_free(asm, monkeypatch):
    """``ainvoke`` and ``acompress_documents`` ran dedup, tokenizing and ordering on the
    event loop (0.3 s stalls for 20 documents); now in a worker thread."""
    import threading

    loop_threads: list[bool] = []
    real = PromptspliceRetriever._splice

    def recording(self, *args, **kwargs):
        loop_threads.append(threading.current_thread() is threading.main_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PromptspliceRetriever, "_splice", recording)
    monkeypatch.setattr(PromptspliceCompressor, "_splice", recording)
    docs = _corpus()[:6]
    retriever = PromptspliceRetriever(retriever=FixedRetriever(docs=docs), assembler=asm, learn=False)
    compressor = PromptspliceCompressor(assembler=asm, learn=False)
    async def both():
        return await retriever.ainvoke(QUERY), await compressor.acompress_documents(docs, QUERY)
    got, compressed = asyncio.run(both())
    assert loop_threads == [False, False]  # neither ran on the loop's (main) thread
    assert [d.page_content for d in got] == [d.page_content for d in retriever.invoke(QUERY)]
    assert [d.page_content for d in compressed] == [d.page_content for d in compressor.compress_documents(docs, QUERY)]
