"""The records of a chat render: :class:`Render` and its :class:`MessageSegment` s.

Kept apart from the renderer so that :mod:`promptsplice.assembler._directives` (which
diffs renders) and :mod:`promptsplice.assembler._render` (which makes them) both stand
on them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from promptsplice.assembler._layout import SegmentKind
from promptsplice.assembler._ordering import AlignPolicy
from promptsplice.blocks import BlockHash
from promptsplice.errors import InputError

__all__ = ["MessageSegment", "Render"]

@dataclass(slots=True)
class MessageSegment:
    """One segment of a render: ``tokens[start:end]``, the last ``padding`` of them filler.

    ``message_index`` is the index in the caller's message list for ``MESSAGE``
    segments and ``None`` for the template's preamble (``SYSTEM``), the tools and the
    generation prompt.  Segments follow the tokens, not always the caller's order: where
    vLLM's developer rule merges system messages into one in front, that one carries
    the first one's index and the others keep empty segments where the caller put them.  ``key`` is the content digest of ``text`` (the template's text
    for the segment, without padding): equal keys and equal padding mean equal tokens.
    """

    kind: SegmentKind
    message_index: int | None
    role: str | None
    start: int
    end: int
    padding: int
    key: bytes
    text: str

    @property
    def content_end(self) -> int:
        """End of the segment's own tokens (before padding)."""
        return self.end - self.padding

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)


@dataclass(slots=True)
class Render:
    """A chat render in token space.

    ``token_ids`` go to the engine as ``prompt_token_ids``.  ``segments`` cover them
    without gaps, in order; the last one is the generation prompt when there is one.
    ``message_keys[i]`` is the content digest of message ``i``'s rendered text (what
    the diff compares; a merged-away message's is the digest of ``""``).  ``block_hashes`` are the chain hashes of the full blocks
    (:mod:`promptsplice.blocks`, rooted at ``salt``).
    """

    token_ids: list[int]
    text: str
    segments: list[MessageSegment]
    message_keys: list[bytes]
    block_size: int
    block_hashes: list[BlockHash]
    alignment: AlignPolicy
    salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_messages(self) -> int:
        return len(self.message_keys)

    @property
    def body_end(self) -> int:
        """Where the generation prompt starts (``num_tokens`` without one): the tokens
        before it are the context that the next render builds on."""
        if self.segments and self.segments[-1].kind is SegmentKind.GENERATION:
            return self.segments[-1].start
        return len(self.token_ids)

    @property
    def body_segments(self) -> list[MessageSegment]:
        """Every segment but the generation prompt."""
        if self.segments and self.segments[-1].kind is SegmentKind.GENERATION:
            return self.segments[:-1]
        return self.segments

    @property
    def padding_tokens(self) -> int:
        return sum(s.padding for s in self.segments)

    def message_span(self, index: int) -> tuple[int, int]:
        """Token span (padding included) of message ``index``'s segments."""
        segs = [s for s in self.segments if s.message_index == index]
        if not segs:
            raise InputError(f"message {index} is not in this render ({self.num_messages} messages)")
        return (segs[0].start, segs[-1].end)
