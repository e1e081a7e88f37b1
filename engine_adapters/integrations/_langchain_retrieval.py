"""LangChain retrieval that feeds a prefix cache: dedup + canonical order of documents.

:class:`PromptspliceRetriever` wraps any ``BaseRetriever``; :class:`PromptspliceCompressor`
does the same work as a ``BaseDocumentCompressor`` (for ``ContextualCompressionRetriever``
pipelines).  Both run :func:`promptsplice.dedup.dedup` (byte-exact: duplicates, contained chunks,
sliding-window overlap, repeated passages) and then let an :class:`promptsplice.assembler.Assembler`
choose the order (``stable`` by default: the same document set in any retrieval order
comes out in one canonical order, so the prompt built from it keeps one prefix and the
engine's prefix cache hits; with ``DedupConfig(order="content")`` on the assembler, with
the same texts too, where documents share paragraphs).

``k`` limits the output *after* dedup: the ``k`` best-ranked kept documents (rank = the
retriever's rank of their earliest member) are chosen first, then ordered canonically,
so a cut never drops a better-ranked document for a cache-friendlier one.  With ``k``
dedup runs in retrieval order, and the documents the cut keeps are deduplicated again
among themselves only: a paragraph is never cut from a kept document for a copy that
only a dropped document holds.

Provenance (nothing is silently lost): each output ``Document`` keeps the id and
metadata of the input whose text it carries (a hit contained in a later, longer document
comes out as that document, whose text holds it, ranked at the hit's rank: a citation of
``metadata["source"]`` names the text's own source), plus
``metadata["promptsplice"]`` (``chunk_id`` names the input whose text was kept; the
hit is among its ``origins``, ``"contained"``):
``{"chunk_id", "relation": "kept", "origins": [{"index", "id", "relation", "span",
"metadata"}...], "removed_passages": [...]}``.  The first output document also carries
``"request": {"inputs", "dropped", "beyond_k"}``: the inputs dropped as empty and the
kept documents cut by ``k`` (each with index, id and metadata).  If no document is left
at all (every input empty), the drop is logged at WARNING level.

Errors: a document that is not a ``Document`` or whose ``page_content`` is not ``str``
raises :class:`~promptsplice.errors.InvalidChunkError` naming its position; bad options
raise :class:`~promptsplice.errors.ConfigError` (pydantic's validation errors are
translated).  Errors raised by the wrapped retriever itself propagate unchanged: they are
the caller's own code's errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
    Callbacks,
)
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, ValidationError

from promptsplice.assembler import Assembler
from promptsplice.dedup import DedupConfig, DedupResult, KeptChunk, Relation, dedup
from promptsplice.errors import ConfigError, InvalidChunkError

__all__ = [
    "PROVENANCE_KEY",
    "PromptspliceCompressor",
    "PromptspliceRetriever",
    "splice_documents",
]

PROVENANCE_KEY = "promptsplice"
"""The metadata key holding each output document's provenance."""

_log = logging.getLogger(__name__)
_DEFAULT_LOCK = threading.Lock()
_DEFAULT_ASSEMBLER: Assembler | None = None


def _default_assembler() -> Assembler:
    """One shared stable-order assembler (default tokenizer, block 16) for the process,
    so popularity and the order memo are learned across retrievers."""
    global _DEFAULT_ASSEMBLER
    with _DEFAULT_LOCK:
        if _DEFAULT_ASSEMBLER is None:
            _DEFAULT_ASSEMBLER = Assembler(None, block_size=16, policy="stable")
        return _DEFAULT_ASSEMBLER


def _check_k(k: Any, what: str) -> int | None:
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{what} must be an int >= 1 or None (no limit), got {k!r}")
    return k


def _check_documents(documents: Any) -> list[Document]:
    if isinstance(documents, (str, bytes, Document)) or not isinstance(documents, Sequence):
        raise InvalidChunkError(
            f"expected a list of Documents, got {type(documents).__name__}"
        )
    for i, doc in enumerate(documents):
        if not isinstance(doc, Document):
            raise InvalidChunkError(
                f"document {i} is a {type(doc).__name__}, not a langchain Document"
            )
        if not isinstance(doc.page_content, str):
            raise InvalidChunkError(
                f"document {i} (id {doc.id!r}): page_content must be a str, got "
                f"{type(doc.page_content).__name__}"
            )
        if doc.metadata is not None and not isinstance(doc.metadata, dict):
            raise InvalidChunkError(
                f"document {i} (id {doc.id!r}): metadata must be a dict, got "
                f"{type(doc.metadata).__name__}"
            )
    return list(documents)


def _origin_record(origin: Any) -> dict[str, Any]:
    return {
        "index": origin.index,
        "id": origin.id,
        "relation": origin.relation.value,
        "span": None if origin.span is None else list(origin.span),
        "metadata": origin.metadata,
    }


def _lead(kept: KeptChunk) -> Any:
    """A kept chunk's best-ranked member (its earliest input): its index is the chunk's
    retrieval rank."""
    return min(kept.origins, key=lambda o: o.index)


def _rank(kept: KeptChunk) -> int:
    return _lead(kept).index


def _owner(kept: KeptChunk) -> Any:
    """The input whose text the kept chunk is (its ``kept`` origin): the output document
    carries its id and metadata (the best-ranked member's described another text)."""
    return next((o for o in kept.origins if o.relation is Relation.KEPT), _lead(kept))


def _output_document(kept: KeptChunk, source: Document) -> Document:
    meta = dict(source.metadata or {})
    meta[PROVENANCE_KEY] = {
        "chunk_id": kept.id,
        "relation": "kept",
        "origins": [_origin_record(o) for o in kept.origins],
        "removed_passages": [
            {
                "chunk_id": p.chunk_id,
                "offset": p.offset,
                "length": p.length,
                "found_in": p.found_in,
                "found_at": p.found_at,
            }
            for p in kept.removed_passages
        ],
    }
    return Document(page_content=kept.text, metadata=meta, id=source.id)


def _dedup_inputs(docs: Sequence[Document]) -> list[Any]:
    """``docs`` as dedup reads them (``doc.id``, else ``metadata["id"]``), except that a
    ``metadata["id"]`` naming another text than the id's own gets ``#<index>`` (its
    position in ``docs``): text splitters copy a loader's ``metadata["id"]`` onto every
    chunk of one source, which dedup refuses as one id naming two texts, and the
    retriever's caller cannot change the ids it retrieves.  An id's own text is that of
    the document whose ``Document.id`` it is, wherever that document lies in ``docs``
    (the retriever's own id wins in any retrieval order: after a ``metadata["id"]`` of
    another text, it was refused as a conflict), else that of the first document
    naming it in ``metadata["id"]``.  A made id is never an id any of ``docs`` carries
    (as ``Document.id`` or ``metadata["id"]``) nor one made before (``#<index>.<n>``
    then, the smallest ``n`` free): it was, when a later document carried it.  Two
    texts under one ``Document.id`` stay a
    :class:`~promptsplice.errors.ConflictingChunkIdError`.  The output documents keep
    their own ``id`` and metadata."""
    carried: set[str] = set()  # every id a document carries, as dedup reads it
    own_text: dict[str, str] = {}  # an id -> its own text
    by_doc_id: set[str] = set()  # the ids some Document.id names
    keys: list[str | None] = []
    for d in docs:
        meta_id = (d.metadata or {}).get("id")
        for v in (d.id, meta_id):
            k = _id_key(v)
            if k is not None:
                carried.add(k)
        key = _id_key(d.id or meta_id)
        keys.append(key)
        if key is None:
            continue
        if d.id:
            if key not in by_doc_id:
                by_doc_id.add(key)
                own_text[key] = d.page_content  # a Document.id's text comes first
        else:
            own_text.setdefault(key, d.page_content)
    made: set[str] = set()
    out: list[Any] = []
    for i, (d, key) in enumerate(zip(docs, keys, strict=True)):
        if key is None:
            meta_id = (d.metadata or {}).get("id")
            if not d.id and meta_id is not None and meta_id != "":
                # LangChain does not reserve metadata["id"] (a vector store's UUID, a
                # float): the id comes from the content, the metadata stays (until
                # 2026-12-08 dedup refused the whole retrieval)
                out.append({"text": d.page_content, "metadata": d.metadata})
            else:
                out.append(d)  # no id: dedup names it by its content
            continue
        if not d.id and d.page_content != own_text[key]:
            n, new = 0, f"{key}#{i}"
            while new in carried or new in made:
                n += 1
                new = f"{key}#{i}.{n}"
            made.add(new)
            key = new
        out.append({"id": key, "text": d.page_content, "metadata": d.metadata})
    return out


def _id_key(cid: Any) -> str | None:
    """An id as dedup reads it (a str subclass by its characters, an int as its digits);
    ``None`` for none, an empty str, or a type dedup refuses with its own message."""
    if cid == "" or not isinstance(cid, str | int) or isinstance(cid, bool):
        return None
    if isinstance(cid, str):
        return str.__str__(cid)
    try:
        return int.__repr__(cid)
    except ValueError:  # over Python's int-to-str digit limit: dedup says so
        return None


def _members(chunks: Sequence[KeptChunk]) -> set[int]:
    """The input indices the chunks stand for."""
    return {o.index for c in chunks for o in c.origins}


def _dedup_some(inputs: list[Any], picked: set[int], cfg: DedupConfig) -> DedupResult:
    """:func:`dedup` of ``inputs[i]`` for ``i`` in ``picked`` (in their order), its
    records' indices mapped back to positions in ``inputs`` (ids are unchanged:
    :func:`_dedup_inputs` made them over all the inputs, and an id-less text's id comes
    from its content)."""
    at = sorted(picked)
    report = dedup([inputs[i] for i in at], cfg)
    for c in report.chunks:
        for o in c.origins:
            o.index = at[o.index]
    for d in report.dropped:
        d.index = at[d.index]
    return report


def _cut_first(
    inputs: list[Any], cfg: DedupConfig, ranked: list[KeptChunk], k: int
) -> tuple[list[KeptChunk], list[KeptChunk]]:
    """The chunks of the documents a cut at ``k`` keeps, deduplicated among themselves
    only, and those of the documents it drops (each in rank order).

    ``ranked``: the chunks of a dedup of all the inputs, best rank first (more than
    ``k``).  Their cut removed text from a chunk it kept wherever the copy it was
    removed for lay in a chunk beyond the cut (a passage, or the bytes that made a
    shortened document contained in another), so the output lost it.  Here the members
    of the first ``k`` chunks are deduplicated again on their own: every byte of theirs
    is then in that dedup's chunks (dedup's own guarantee), and all of those are the
    output.  Without the others a document can keep a paragraph and come out on its own
    (one whose every paragraph was found elsewhere had been attached to a kept chunk as
    ``passages``), or two kept ones can merge: past ``k`` chunks, the members of the
    ``k`` best-ranked are deduplicated again; short of ``k``, the next-ranked chunk's
    members join.  Each step drops inputs or takes the next chunk, so it ends; typically
    the first dedup gives ``k`` chunks.
    """
    n = k
    picked = _members(ranked[:n])
    report = _dedup_some(inputs, picked, cfg)
    while True:
        if len(report.chunks) > k:
            picked = _members(sorted(report.chunks, key=_rank)[:k])  # strictly fewer
        elif len(report.chunks) < k and n < len(ranked):
            more = _members(ranked[n : n + 1]) - picked
            n += 1
            if not more:
                continue
            picked |= more
        else:
            break
        report = _dedup_some(inputs, picked, cfg)
    rest = _members(ranked) - picked  # (no chunk stands for an empty input)
    beyond = _dedup_some(inputs, rest, cfg).chunks if rest else []
    return sorted(report.chunks, key=_rank), sorted(beyond, key=_rank)


_AS_THEY_ARE = DedupConfig(exact=False, containment=False, overlap=False, passages=False)
"""What the assembler does to documents deduplicated already: keep them (nothing but
empty chunks is dropped, and kept ones are never empty)."""


def _unique_ids(chunks: Sequence[KeptChunk]) -> list[str]:
    """The chunks' ids, each once: the second and later chunks of one id (dedup's exact
    pass off: equal texts) get ``#<index>``, the index of the input whose text they are
    (``#<index>.<n>`` where another chunk's id is that).  Only the assembler sees them:
    the output documents and their provenance name the inputs' own ids."""
    taken = {c.id for c in chunks}
    seen: set[str] = set()
    out: list[str] = []
    for c in chunks:
        cid = c.id
        if cid in seen:
            n, cid = 0, f"{c.id}#{_owner(c).index}"
            while cid in taken:
                n += 1
                cid = f"{c.id}#{_owner(c).index}.{n}"
            taken.add(cid)
        seen.add(c.id)
        out.append(cid)
    return out


def splice_documents(
    documents: Sequence[Document],
    query: str,
    *,
    assembler: Assembler | None = None,
    k: int | None = None,
    learn: bool = True,
) -> list[Document]:
    """Dedup ``documents`` byte-exactly and return them in the assembler's order.

    ``k``: keep the ``k`` best-ranked documents after dedup.  The cut is decided on a
    dedup of all the documents (which ranks a document containing an earlier hit at the
    hit's rank), and the text comes from a second dedup of only the documents whose
    content is kept (:func:`_cut_first`): a dedup of all of them could cut a paragraph
    from a kept document because a copy sat in one beyond the cut, and the output then
    lacked it.  At most ``k`` documents come out (fewer only where the kept ones,
    deduplicated without the others, merge into fewer chunks and no next-ranked chunk is
    left to add); ``request.beyond_k`` lists the rest, deduplicated among themselves.
    ``learn``: assemble as a prompt to send (the assembler learns popularity and
    remembers the order of this document set; a standalone assembler also admits it
    into its own mirror, an engine's assembler only reads the engine's); ``False``: a
    preview, no state change.
    """
    docs = _check_documents(documents)
    k = _check_k(k, "k")
    if not isinstance(query, str):
        raise ConfigError(f"query must be a str, got {type(query).__name__}")
    if not docs:
        return []
    asm = assembler if assembler is not None else _default_assembler()
    # With a cut at k, retrieval order (also when the config asks for content order):
    # the first retrieved copy of a repeated paragraph keeps it, usually a better-ranked
    # document the cut keeps, where content order keeps it in the longest copy.
    cfg = asm.dedup_config if k is None else dataclasses.replace(asm.dedup_config, order="retrieval")
    inputs = _dedup_inputs(docs)
    report: DedupResult = dedup(inputs, cfg)
    # rank = the retriever's rank of a chunk's earliest member: dedup lists a chunk that
    # contains an earlier hit at its own (later) position, so a cut there dropped the hit
    kept = sorted(report.chunks, key=_rank)
    chosen, beyond = (kept, []) if k is None else (kept[:k], kept[k:])
    if beyond:  # the kept documents' text, deduplicated without the ones cut
        chosen, beyond = _cut_first(inputs, cfg, kept, len(chosen))
    if not chosen:
        _log.warning(
            "promptsplice: all %d documents were empty and dropped (ids: %s)",
            len(docs), [d.id for d in report.dropped],
        )
        return []
    # The assembler lays out the kept texts as they are, deduplicated no further: a
    # second dedup is no fixpoint in every case (the documented exceptions, and the
    # chunks come in rank order here), and a change there raised below.  Its chunk
    # order is the canonical (or cache-aware) order of this set.
    # by ids unique among the kept chunks: without dedup's exact pass (DedupConfig(exact=
    # False)) two kept chunks can carry one id, and a map by id kept one of them
    by_id = dict(zip(_unique_ids(chosen), chosen, strict=True))
    prompt = asm._assemble(
        [{"id": cid, "text": c.text, "metadata": c.metadata} for cid, c in by_id.items()],
        query=query, commit=learn, dedup_config=_AS_THEY_ARE,
    )
    order = prompt.chunk_order
    if sorted(order) != sorted(by_id):
        raise InvalidChunkError(  # pragma: no cover - the assembler deduplicates nothing here
            f"the assembler re-deduplicated the kept documents ({sorted(by_id)} -> "
            f"{sorted(order)}); report this with the documents"
        )
    out = [_output_document(by_id[cid], docs[_owner(by_id[cid]).index]) for cid in order]
    out[0].metadata[PROVENANCE_KEY]["request"] = {
        "inputs": len(docs),
        "dropped": [
            {"index": d.index, "id": d.id, "reason": d.reason, "metadata": d.metadata}
            for d in report.dropped
        ],
        "beyond_k": [
            {"index": _lead(c).index, "id": _lead(c).id, "metadata": _lead(c).metadata,
             "origins": [_origin_record(o) for o in c.origins]}
            for c in beyond
        ],
    }
    return out


class _SpliceOptions:
    """Construction shared by the retriever and the compressor: pydantic errors become
    :class:`ConfigError`, and ``k`` is checked."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)  # type: ignore[call-arg]
        except ValidationError as exc:
            raise ConfigError(f"{type(self).__name__}: invalid options: {exc}") from exc
        _check_k(self.k, "k")  # type: ignore[attr-defined]
        if self.assembler is not None and not isinstance(self.assembler, Assembler):  # type: ignore[attr-defined]
            raise ConfigError(
                f"assembler must be an assembler.Assembler, got {type(self.assembler).__name__}"  # type: ignore[attr-defined]
            )

    def _splice(self, documents: Sequence[Document], query: str, k: int | None) -> list[Document]:
        return splice_documents(
            documents,
            query,
            assembler=self.assembler,  # type: ignore[attr-defined]
            k=self.k if k is None else k,  # type: ignore[attr-defined]
            learn=self.learn,  # type: ignore[attr-defined]
        )


class PromptspliceRetriever(_SpliceOptions, BaseRetriever):
    """Wrap ``retriever``: its documents, deduplicated and in a cache-friendly order.

    ``k`` (constructor or ``invoke(query, k=...)``) limits the output after dedup;
    ``assembler`` chooses the order (default: a shared ``stable`` assembler on the
    default tokenizer); ``learn=False`` keeps the assembler's popularity untouched.
    Other ``invoke`` keyword arguments go to the wrapped retriever.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    k: int | None = Field(default=None, strict=True)
    assembler: Any = None
    learn: bool = True

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        k = _check_k(k, "k")
        docs = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        return self._splice(docs, query, k)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        k = _check_k(k, "k")
        docs = await self.retriever.ainvoke(
            query, config={"callbacks": run_manager.get_child()}, **kwargs
        )
        # dedup, tokenizing and ordering are CPU work (0.1-0.3 s for 20-40 documents):
        # in a worker thread, so the event loop's other tasks run meanwhile
        return await asyncio.to_thread(self._splice, docs, query, k)


class PromptspliceCompressor(_SpliceOptions, BaseDocumentCompressor):
    """The same dedup + ordering as a document compressor (for
    ``ContextualCompressionRetriever(base_compressor=..., base_retriever=...)``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    k: int | None = Field(default=None, strict=True)
    assembler: Any = None
    learn: bool = True

    def compress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        """Dedup and order ``documents`` for ``query`` (``callbacks`` unused: no LLM runs)."""
        return self._splice(documents, query, None)

    async def acompress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        """Async twin of :meth:`compress_documents` (its CPU work in a worker thread,
        off the event loop)."""
        return await asyncio.to_thread(self._splice, documents, query, None)
