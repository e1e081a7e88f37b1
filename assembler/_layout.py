"""Block layout: concatenating segments in token space and padding where it pays.

A segment (system prompt, tool schemas, one chunk, the query) is tokenized on its own,
so its boundaries are exact.  Padding a segment's end with a whitespace filler up to the
next multiple of ``block_size`` makes the block that holds the boundary independent of
what follows, at the cost of up to ``block_size - 1`` extra prompt tokens.

Alignment policies:

``none``  never pad.
``all``   pad every segment that is followed by another one.
``auto``  pad only where the mirror says it pays.  Walking the prompt while every full
          block so far is cached, at each segment boundary that is not block aligned:
          keep the unpadded layout if its next block is cached; else pad if the padded
          block is cached; else this is the request's first miss, at a branch point of
          the cached prefix: pad speculatively if earlier requests already diverged
          at this very boundary (:class:`BranchMemory`), so the next request that
          branches here hits the padded block.  After the first miss nothing hits
          anyway and no padding is added.  So ``auto`` never loses a hit that ``none``
          would get, pays at most one partial block of padding per request, and pays
          it only at boundaries that proved to be branch points.

Tried and dropped: padding speculatively at *every* first miss that follows a cached
block.  Most first misses are one-off branch points (a retriever's stray chunk), so the
padding never paid back: on the repeat-heavy trace at block 32 it left 0.5% more to
prefill than ``none``.

Measured on a repeat-heavy trace (the foundation issue): padding every chunk cost 1.5%
(block 16) to 7% (block 32) more prompt tokens and lost more prefill than it won; that
is why ``all`` is not the default.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from promptsplice.assembler._mirror import PrefixCacheMirror
from promptsplice.assembler._ordering import AlignPolicy
from promptsplice.blocks import (
    BlockHash,
    content_digest,
    hash_while_cached,
    iter_block_hashes,
    next_blocks_cached,
    root_hash,
    token_bytes,
)

__all__ = ["SegmentKind", "Segment", "LayoutBuilder", "BranchMemory"]


class SegmentKind(enum.Enum):
    SYSTEM = "system"
    TOOLS = "tools"
    CHUNK = "chunk"
    QUERY = "query"
    MESSAGE = "message"
    """One chat message of an agent render (:mod:`promptsplice.assembler._render`)."""
    GENERATION = "generation"
    """The chat template's generation prompt (e.g. ``<|im_start|>assistant\\n``)."""


class BranchMemory:
    """Bounded count of the requests whose cache hit ended at each segment boundary.

    A boundary becomes a *proven* branch point once ``min_divergences`` earlier
    requests diverged there; ``auto`` pads only proven branch points.  Two was the
    best threshold on the generated traces (seeds 0-3, both profiles, blocks 16 and
    32): one paid padding at too many one-off branch points, three and four waited
    too long for the gain.
    """

    def __init__(self, min_divergences: int = 2, max_entries: int = 200_000) -> None:
        self.min_divergences = min_divergences
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    def peek(self, key: bytes) -> bool:
        """What :meth:`check_and_record` would answer, without counting."""
        with self._lock:
            return self._seen.get(key, 0) >= self.min_divergences

    def check_and_record(self, key: bytes) -> bool:
        """True if this boundary is a proven branch point; counts this divergence."""
        with self._lock:
            count = self._seen.pop(key, 0)
            self._seen[key] = count + 1
            if len(self._seen) > self._max:
                self._seen.popitem(last=False)
            return count >= self.min_divergences


@dataclass(slots=True)
class Segment:
    """One segment of an assembled prompt: ``tokens[start:end]``, padding at the end."""

    kind: SegmentKind
    chunk_ids: tuple[str, ...]
    start: int
    end: int
    padding: int = 0

    @property
    def content_end(self) -> int:
        """End of the segment's own tokens (before padding)."""
        return self.end - self.padding


class LayoutBuilder:
    """Appends segments, decides padding, and tracks the mirror's hits as it goes."""

    def __init__(
        self,
        block_size: int,
        filler_token_id: int,
        align: AlignPolicy,
        mirror: PrefixCacheMirror | None,
        salt: str | bytes | None = None,
        branches: BranchMemory | None = None,
    ) -> None:
        self.block_size = block_size
        self.filler = filler_token_id
        self.align = align
        self.mirror = mirror
        self.branches = branches if branches is not None else BranchMemory()
        self.tokens: list[int] = []
        # The same tokens as token_bytes (each segment converted once, not once per probe).
        self._bytes = bytearray()
        self._filler_block = token_bytes([filler_token_id] * block_size)
        self.hashes: list[BlockHash] = []
        self.segments: list[Segment] = []
        self._root = root_hash(salt)
        # What the walk can count on: the cache, and on an engine with a block store the
        # store's blocks too (its connector loads them back: vLLM counts them cached).
        self._cached = mirror.reusable_hashes() if mirror is not None else None
        # While True, every full block so far is reusable.
        self.hitting = mirror is not None
        self._paddable_prev = False

    # -- probing -------------------------------------------------------------------
    def pad_choices(self) -> tuple[bool, ...]:
        """Which padding choices the policy allows for the previous segment's end."""
        if not self._paddable_prev or len(self.tokens) % self.block_size == 0:
            return (False,)
        if self.align is AlignPolicy.NONE:
            return (False,)
        if self.align is AlignPolicy.ALL:
            return (True,)
        return (False, True)

    def probe(self, seg_tokens: Sequence[int], pad_prev: bool, limit: int | None = None) -> int:
        """Cached blocks that appending ``seg_tokens`` (after optional padding) would add.

        Only meaningful while :attr:`hitting`: counts the leading cached new full
        blocks, stopping at the first miss or after ``limit`` blocks.
        """
        if self._cached is None or not self.hitting:
            return 0
        bs = self.block_size
        tail = bytes(self._bytes[len(self.hashes) * 4 * bs :])
        n_tail = len(tail) // 4
        if pad_prev and n_tail % bs:
            tail += self._filler_block[: 4 * (bs - n_tail % bs)]
            n_tail = len(tail) // 4
        n_blocks = (n_tail + len(seg_tokens)) // bs
        if limit is not None:
            n_blocks = min(n_blocks, limit)
        if n_blocks == 0:
            return 0
        data = tail + token_bytes(seg_tokens[: n_blocks * bs - n_tail])
        parent = self.hashes[-1] if self.hashes else self._root
        return hash_while_cached(parent, data, bs, self._cached, [])

    def first_block_hits(self, heads: Sequence[bytes], pad_prev: bool) -> list[bool]:
        """``probe(seg, pad_prev, limit=1) > 0`` for many segments at once, each given
        by ``heads``: the :func:`token_bytes` of (at least) its first ``block_size``
        tokens.  One digest per segment, for walks that try every chunk at every step."""
        if self._cached is None or not self.hitting:
            return [False] * len(heads)
        step = 4 * self.block_size
        tail = bytes(self._bytes[len(self.hashes) * step :])
        if pad_prev and len(tail) % step:
            tail += self._filler_block[: step - len(tail) % step]
        if len(tail) >= step:  # padding completes a block: probe() decides that one
            return [self.probe((), pad_prev, limit=1) > 0] * len(heads)
        parent = self.hashes[-1] if self.hashes else self._root
        return next_blocks_cached(parent, tail, heads, self.block_size, self._cached)

    def _decide_pad(self, seg_tokens: Sequence[int], following: Iterable[Sequence[int]] | None = None) -> bool:
        choices = self.pad_choices()
        if len(choices) == 1:
            return choices[0]
        # AUTO
        if not self.hitting:
            return False
        need = self.block_size - (len(self.tokens) - len(self.hashes) * self.block_size)
        if len(seg_tokens) < need:
            # The segment does not complete the next block: what follows decides whether
            # the unpadded layout hits, so probe it with the following segments
            # (unpadded).  Not knowing them, this is no miss (only a padded block the
            # mirror holds decides): counting it as one made a boundary of an exact
            # repeat a "branch point", padded from the third repeat on, which lost every
            # cached block after it.  When the prompt ends before the block is full,
            # that block is never cached either way: the usual rule.
            if following is None:  # a padded block the mirror holds still pays
                return self.probe(seg_tokens, True, limit=1) > 0
            ahead = list(seg_tokens)
            for seg in following:
                if len(ahead) >= need:
                    break
                ahead.extend(seg[: need - len(ahead)])
            seg_tokens = ahead
        if self.probe(seg_tokens, False, limit=1) > 0:
            return False
        if self.probe(seg_tokens, True, limit=1) > 0:
            return True
        parent = self.hashes[-1] if self.hashes else self._root
        tail = self._bytes[len(self.hashes) * 4 * self.block_size :]
        return self.branches.check_and_record(content_digest(parent + tail))

    # -- building ------------------------------------------------------------------
    def append(
        self,
        kind: SegmentKind,
        chunk_ids: tuple[str, ...],
        seg_tokens: Sequence[int],
        *,
        paddable: bool,
        pad_prev: bool | None = None,
        following: Iterable[Sequence[int]] | None = None,
    ) -> Segment:
        """Append one segment; ``pad_prev`` overrides the policy's decision.
        ``following``: every segment that will come after it (``()``: none), or ``None``
        when unknown; ``auto`` looks at them when this one is too short to complete a
        block."""
        if self.segments:
            pad = self._decide_pad(seg_tokens, following) if pad_prev is None else pad_prev
            if pad and pad not in self.pad_choices():
                raise ValueError("padding the previous segment is not allowed here")
            if pad:
                self._pad_last()
        start = len(self.tokens)
        self.tokens.extend(seg_tokens)
        self._bytes += token_bytes(seg_tokens)
        seg = Segment(kind, chunk_ids, start, len(self.tokens))
        self.segments.append(seg)
        self._paddable_prev = paddable
        self._advance()
        return seg

    def _pad_last(self) -> None:
        bs = self.block_size
        p = (-len(self.tokens)) % bs
        if p:
            self.tokens.extend([self.filler] * p)
            self._bytes += self._filler_block[: 4 * p]
            seg = self.segments[-1]
            seg.end += p
            seg.padding += p
            self._advance()

    def _advance(self) -> None:
        """Hash newly completed blocks while the prefix is still cached."""
        if not self.hitting:
            return
        step = 4 * self.block_size
        done = len(self.hashes)
        if len(self._bytes) // step <= done:
            return
        parent = self.hashes[-1] if self.hashes else self._root
        data = bytes(self._bytes[done * step : (len(self._bytes) // step) * step])
        hits = hash_while_cached(parent, data, self.block_size, self._cached, self.hashes)  # type: ignore[arg-type]
        if hits < len(data) // step:
            self.hitting = False

    @property
    def hit_blocks(self) -> int:
        """Leading cached blocks found so far (exact while hitting)."""
        return len(self.hashes) - (0 if self.hitting else 1)

    def finish(self) -> list[BlockHash]:
        """Hash the remaining full blocks; returns all full-block hashes."""
        done = len(self.hashes)
        parent = self.hashes[-1] if self.hashes else self._root
        data = memoryview(bytes(self._bytes[done * 4 * self.block_size :]))
        self.hashes.extend(iter_block_hashes(parent, data, self.block_size))
        self.hitting = False
        return self.hashes
