"""Records and the config of :mod:`dedup`: what goes in, what comes out, and why.

Plain ``slots`` dataclasses (cheap to build: dedup creates one origin per input) and
one enum for the outcome of each input.  Nothing here does any work beyond validating
the config.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, fields

from promptsplice.errors import ConfigError

__all__ = [
    "Relation",
    "DedupConfig",
    "InputChunk",
    "Origin",
    "RemovedPassage",
    "KeptChunk",
    "DroppedChunk",
    "DedupStats",
    "DedupResult",
    "REMOVAL_KINDS",
    "INVALID_UTF8_POLICIES",
    "DEDUP_ORDERS",
]

#: Keys of :attr:`DedupStats.removed` / :attr:`DedupStats.removed_bytes`, always all present.
REMOVAL_KINDS: tuple[str, ...] = ("duplicate", "contained", "overlap", "passage", "empty")

#: Accepted values of ``on_invalid_utf8``.
INVALID_UTF8_POLICIES: tuple[str, ...] = ("error", "replace")

#: Accepted values of ``order`` (besides ``None``).
DEDUP_ORDERS: tuple[str, ...] = ("retrieval", "content")


class Relation(enum.Enum):
    """How an input chunk is represented in the kept chunk that stands for it."""

    KEPT = "kept"
    """It is (the first member of) the kept chunk."""
    DUPLICATE = "duplicate"
    """An exact byte duplicate of the kept chunk's first member."""
    CONTAINED = "contained"
    """Its bytes occur inside the kept chunk (at ``Origin.span``)."""
    MERGED = "merged"
    """Sliding-window overlap: merged into the kept chunk (2nd, 3rd... member)."""
    PASSAGES = "passages"
    """It lay in a chunk that passage removal emptied (every paragraph of that chunk was
    already present earlier) and not inside one removed paragraph: ``Origin.emptied``
    locates it among that chunk's ``removed_passages``."""


@dataclass(frozen=True, slots=True)
class DedupConfig:
    """Which kinds of redundancy :func:`promptsplice.dedup.dedup` removes, and their thresholds.

    Every kind is on by default.  ``min_overlap`` / ``min_passage`` are byte lengths:
    shorter matches are left alone because a short repeat (a heading, a boilerplate
    line) is usually not redundancy worth rewriting a chunk for.
    """

    exact: bool = True
    """Drop byte-identical chunks.  Off, the same text can be kept twice, and two kept
    chunks can then carry the same id (:meth:`DedupResult.find` returns the first; a
    :class:`RemovedPassage`'s ``found_in`` may name either): keep it on when ids must
    name one chunk."""
    containment: bool = True
    overlap: bool = True
    passages: bool = True
    min_overlap: int = 64
    """Bytes; the tail of A must equal the head of B over at least this many bytes."""
    min_passage: int = 128
    """Bytes; a paragraph at least this long that is already present earlier is removed."""
    source_key: str = "source"
    """Metadata key naming the source document; overlap merges need the same source
    (a missing or ``None`` value never merges)."""
    start_key: str | None = "start_index"
    """Metadata key of a chunk's offset in its source document, in characters (a
    non-negative int, as LangChain's text splitters set it with ``add_start_index=True``);
    ``None``: positions are not read.  Two windows of one source that both carry one are
    merged exactly where their offsets overlap, if their texts agree there (by at least
    ``min_overlap`` bytes), and not at all otherwise.  Without them the overlap is the
    longest match of one window's tail with the other's head, and a seam where the text
    repeats (log lines, table rows), with a shorter match of ``min_overlap`` bytes too,
    is left unmerged: the true overlap could be either (so are windows whose matches
    disagree on their order).  In the output a chunk's value says where its text starts:
    moved to the merged text's start for a merged chunk, ``None`` where no offset is
    known any more (passages were cut from it, so it is no longer one slice of its
    source, or it merged with such a chunk, or with one whose offset disagrees); the
    origins keep their inputs' values."""
    on_invalid_utf8: str = "error"
    """``"error"``: raise InvalidUTF8Error; ``"replace"``: decode with U+FFFD and count it."""
    order: str | None = None
    """The order the passes see the chunks in, which decides which copy of a repeat keeps
    its bytes.  ``"retrieval"``: the first retrieved chunk keeps a repeated paragraph.
    ``"content"``: longest first, then by content digest (each round of the passage pass
    in the order of the chunks as they are then, so the output is a fixpoint in this
    order too), so the same chunk set in any order keeps the same bytes and a stable
    layout sends the same prompt (and hits the same cache) whatever order the retriever
    returned; of equal bytes the copy kept is the first that names a source
    (``source_key``), then the one of the smallest id.  Opt-in: early in a trace it cost
    prefill (the README's "Dedup order"), since a popular chunk retrieved first keeps
    its text in retrieval order but is cut wherever a longer chunk shares a paragraph.
    ``None`` (default): ``"retrieval"``.  Either way a merged
    chunk carries the id and metadata of its earliest retrieved merged member that keeps bytes
    (unless that id names a record already), kept chunks are listed in the retrieval
    order of the inputs that name them, and every origin keeps its input's index."""

    def __post_init__(self) -> None:
        for name in ("exact", "containment", "overlap", "passages"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"DedupConfig.{name} must be True or False, got {value!r}")
        for name in ("min_overlap", "min_passage"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= sys.maxsize:
                # above sys.maxsize the C core cannot take it (a raw OverflowError)
                raise ConfigError(
                    f"DedupConfig.{name} must be an int in [1, sys.maxsize] (a length in bytes), got {value!r}"
                )
        if not isinstance(self.source_key, str) or not self.source_key:
            raise ConfigError(
                f"DedupConfig.source_key must be a non-empty str (a metadata key such as "
                f"'source'), got {self.source_key!r}"
            )
        if self.start_key is not None and (not isinstance(self.start_key, str) or not self.start_key):
            raise ConfigError(
                f"DedupConfig.start_key must be a non-empty str or None (a metadata key such as "
                f"'start_index'), got {self.start_key!r}"
            )
        if self.on_invalid_utf8 not in INVALID_UTF8_POLICIES:
            raise ConfigError(
                f"DedupConfig.on_invalid_utf8 must be 'error' or 'replace', "
                f"got {self.on_invalid_utf8!r}"
            )
        if self.order is not None and self.order not in DEDUP_ORDERS:
            raise ConfigError(
                f"DedupConfig.order must be 'retrieval', 'content' or None (the caller's default), "
                f"got {self.order!r}"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The option names (valid ``**overrides`` of :func:`promptsplice.dedup.dedup`)."""
        return tuple(f.name for f in fields(cls))


@dataclass(slots=True)
class InputChunk:
    """One normalized input: its position, id, text, UTF-8 bytes, xxh3-128 digest, metadata.

    ``metadata`` is a copy of the caller's dict, so dedup never mutates caller data.
    """

    index: int
    id: str
    text: str
    data: bytes
    digest: bytes
    metadata: dict


@dataclass(slots=True)
class Origin:
    """One input that a kept chunk stands for.

    ``span`` is the byte range of this input's content inside the kept chunk's ``data``
    (``None`` for :attr:`Relation.PASSAGES`).  If the kept chunk lost repeated passages,
    the span covers what remains of this input's bytes (empty if nothing remains); an
    input that lay inside one removed paragraph is moved, as CONTAINED, to the chunk
    where that paragraph was found (also when passage removal emptied its chunk).

    ``emptied`` is set for :attr:`Relation.PASSAGES` only: ``(chunk_id, start, end)``,
    this input's byte range in the bytes of the emptied chunk ``chunk_id`` as they were
    before passage removal, the coordinates of that chunk's :class:`RemovedPassage`
    records (``RemovedPassage.chunk_id == chunk_id``, filed in the ``removed_passages`` of
    the kept chunk holding this origin).  To rebuild the input: place each record's
    ``found_in``/``found_at`` bytes at its ``offset`` and fill every other byte with
    ``b"\n"`` (the separators and empty paragraphs between them), then slice
    ``[start:end]``.  Not recorded: whitespace-only paragraphs other than empty ones that
    the emptied chunk had (their bytes come back as newlines), and, for an input that
    lost bytes to a cut in another chunk before it came here, where it began or ended
    inside a removed paragraph (the range then covers what remained of it).
    """

    index: int
    id: str
    metadata: dict
    relation: Relation
    span: tuple[int, int] | None
    emptied: tuple[str, int, int] | None = None


@dataclass(slots=True)
class RemovedPassage:
    """A repeated paragraph removed from chunk ``chunk_id`` because it is already present.

    ``offset``/``length`` locate the paragraph in that chunk's bytes before passage
    removal (the input's original bytes, or the merged bytes for an overlap merge; a
    chunk cut in two rounds keeps both rounds' records in these coordinates);
    ``found_in``/``found_at`` locate the same bytes in a kept chunk.  The separator that
    was removed with it is not counted in ``length``.
    """

    chunk_id: str
    offset: int
    length: int
    found_in: str
    found_at: int


@dataclass(slots=True)
class KeptChunk:
    """A chunk of the output.  ``id``/``metadata`` are those of its first (KEPT) input
    (except the value of :attr:`DedupConfig.start_key`, which says where this chunk's
    text starts in its source, or ``None``).

    ``origins`` lists every input it stands for, the KEPT one first, then by input index.
    ``removed_passages`` lists passages removed from it, and from chunks that were
    emptied by passage removal and attached here (their ``chunk_id`` tells them apart;
    the PASSAGES origins of such a chunk name it in ``Origin.emptied``).
    """

    id: str
    text: str
    data: bytes
    digest: bytes
    metadata: dict
    origins: list[Origin]
    removed_passages: list[RemovedPassage]


@dataclass(slots=True)
class DroppedChunk:
    """An input that is not represented in any kept chunk: ``reason`` is ``"empty"``."""

    index: int
    id: str
    metadata: dict
    reason: str


@dataclass(slots=True)
class DedupStats:
    """Counts and byte totals of one :func:`promptsplice.dedup.dedup` call.

    ``bytes_in - bytes_out == removed_bytes_total`` always holds.  ``removed`` counts
    events per kind: inputs that became duplicates, chunks absorbed by containment
    (a merged chunk counts once), overlap joins (a chain of 3 counts 2), passages
    removed, inputs dropped as empty.  ``removed_bytes`` is what each kind saved.
    """

    chunks_in: int
    chunks_out: int
    bytes_in: int
    bytes_out: int
    removed: dict[str, int]
    removed_bytes: dict[str, int]
    replaced_invalid_utf8: int
    hash_collisions: int

    @property
    def removed_bytes_total(self) -> int:
        """Bytes saved by all kinds together."""
        return sum(self.removed_bytes.values())


@dataclass(slots=True)
class DedupResult:
    """The kept chunks in retrieval order, the dropped inputs, and the stats."""

    chunks: list[KeptChunk]
    dropped: list[DroppedChunk]
    stats: DedupStats

    def input_ids(self) -> set[str]:
        """Every input id reachable from the output (kept origins and dropped chunks)."""
        ids = {o.id for k in self.chunks for o in k.origins}
        ids.update(d.id for d in self.dropped)
        return ids

    def find(self, chunk_id: str) -> KeptChunk | None:
        """The kept chunk that stands for input ``chunk_id`` (``None`` if dropped/unknown)."""
        for kept in self.chunks:
            for origin in kept.origins:
                if origin.id == chunk_id:
                    return kept
        return None
