"""Byte-exact dedup of retrieved chunks, run before prompt assembly.

Retrievers return redundant text: the same chunk from two indexes, a short chunk that
sits inside a longer one, neighbouring windows of a sliding-window chunker, and
boilerplate paragraphs repeated across documents.  Each repeat costs prefill tokens
and changes the prompt bytes, so the engine's prefix cache misses.  :func:`dedup`
removes them and keeps a full record of where every input went.

Kinds, in the order they run (all on by default; switch each off in
:class:`DedupConfig` or with ``dedup(chunks, overlap=False)``):

* **empty**: a chunk with no bytes or only whitespace is dropped
  (:class:`DroppedChunk`, ``reason="empty"``).
* **exact**: byte-identical chunks (xxh3-128 digest, confirmed by comparing bytes)
  become :attr:`Relation.DUPLICATE` origins of the first copy.
* **overlap**: chunks of the same source document (``metadata["source"]``, see
  ``source_key``) whose tail equals the next one's head over >= ``min_overlap`` (64)
  bytes are merged into one chunk (:attr:`Relation.MERGED`), chains allowed.  The
  merged chunk stands where its earliest-retrieved member stood, under that member's
  id and metadata (its KEPT origin).  Only certain overlaps merge: two chunks that both
  carry their offset in the source (``metadata["start_index"]``, see ``start_key``)
  overlap where the offsets say, if their bytes agree there; others at their longest
  match, unless the seam's text repeats (a shorter match of >= ``min_overlap`` bytes
  fits too: log lines, table rows) or the matches among a source's chunks disagree on
  where a chunk sits (A before B and B before A): those stay apart, nothing lost.  A
  kept chunk's ``start_key`` value says where its text starts (a merged chunk's is
  moved there; ``None`` once passages were cut from it).
* **containment**: a chunk whose bytes occur inside another kept chunk (at least as
  long, so an identical one too) becomes a :attr:`Relation.CONTAINED` origin of it,
  with the byte span where it was found.
* **passages**: a paragraph (split on ``b"\\n\\n"`` only: CRLF text, ``\\r\\n\\r\\n``, has
  no paragraphs for this pass; normalize line endings first) of >= ``min_passage`` (128) bytes
  that already occurs in an earlier kept chunk (retrieval order, or content order with
  ``DedupConfig(order="content")``: the same set in any order then keeps the same
  bytes) is cut out of the later one, with one
  separator (:class:`RemovedPassage`); a chunk left empty is attached to the chunk
  holding its first removed passage (:attr:`Relation.PASSAGES`).  A shortened chunk
  can now sit inside another one or, its head changed, overlap a same-source
  neighbour: containment and overlap run again over the shortened chunks, then
  passages, until nothing changes, so the output is a fixpoint: deduplicating the
  output texts (with their metadata) again, in the same ``order``, changes nothing.  Two
  exceptions keep the :class:`RemovedPassage` records true, and a second call may merge
  or cut there: a chain whose keeper (its first-retrieved chunk; in content order the
  first in that order) lost passages of its own is not merged after the
  passage pass (its records locate paragraphs in its bytes as they were), and a chunk
  holding a recorded passage is not cut in a later round when that passage would lose
  its bytes (one that ends in one newline of a separator the cut takes).  And past a
  call's search budget (chunks made of the same few sentences, megabytes of them:
  ``dedup/_finder.py``) a needle not found cheaply counts as not found, so a second
  call may find more to remove; so may one after a content-order call that hit its
  round limit (a chunk sinking one place per cut, ``dedup/_core.py``).

Nothing is lost: every input appears exactly once, as an :class:`Origin` of a
:class:`KeptChunk` or as a :class:`DroppedChunk`, and ``Origin.span`` slices the kept
bytes back to that input's bytes where its chunk lost no passages.  A chunk that did
is rebuilt, bytes before the cut, from its :class:`RemovedPassage` records; the span
then covers what remains of the input, and two things are not recorded: where an input
began or ended inside a removed paragraph (sliding windows over a boilerplate
paragraph), and the whitespace-only paragraphs (other than empty ones) of a chunk
emptied by passage removal.  The inputs of an emptied chunk that lay inside one removed
paragraph move, CONTAINED, to where it was found; the others are its PASSAGES origins,
whose ``Origin.emptied`` gives their byte range in its bytes before removal, the
coordinates of its :class:`RemovedPassage` records: placing each found passage at its
``offset`` (newlines between them) rebuilds them.  Containment
runs before overlap merges too, so a window already inside another chunk is CONTAINED
there, and a merged chunk whose first member lost all its text to passage removal is
owned by the earliest member that kept bytes: no chunk carries the id and metadata of
an input none of whose text it holds.  Kept chunks stay in retrieval order; a chunk with
no redundancy comes back with the same id and bytes.  Inputs are str, UTF-8 bytes,
dicts ``{"text", "id", "metadata"}`` or LangChain-style documents (duck-typed); bad
input raises an error from :mod:`promptsplice.errors`.  Invalid UTF-8 raises by
default (``on_invalid_utf8="replace"`` decodes it with U+FFFD and counts it).

Cost: near-linear in the number of chunks and their bytes for typical requests; worst
cases are stated in :mod:`promptsplice.dedup._core`.  One cliff: the overlap search's
index needs ``min_overlap`` >= 31 bytes; below it every same-source pair is compared,
quadratic in the size of a source's group of chunks.  The searches run in an optional C
core (``dedup/_speedups.c``, built by ``setup.py`` where a C compiler is;
:data:`ACCELERATED` says whether it was): containment and passages for requests of up
to 64 chunks and 256 KiB, overlap edges for same-source groups of up to 16 chunks.
Without it the same results come from the pure-Python passes, about half as fast.
"""

from __future__ import annotations

from ._core import dedup
from ._normalize import normalize_chunks
from ._native import core as _core
from ._types import (
    DedupConfig,
    DedupResult,
    DedupStats,
    DroppedChunk,
    InputChunk,
    KeptChunk,
    Origin,
    Relation,
    RemovedPassage,
)

#: Whether the optional C core of the searches was built (results are the same either way).
ACCELERATED: bool = _core is not None

__all__ = [
    "ACCELERATED",
    "DedupConfig",
    "DedupResult",
    "DedupStats",
    "DroppedChunk",
    "InputChunk",
    "KeptChunk",
    "Origin",
    "Relation",
    "RemovedPassage",
    "dedup",
    "normalize_chunks",
]
