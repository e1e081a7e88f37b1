"""Turn whatever a retriever returns into :class:`InputChunk` records.

Accepted per chunk: ``str``; ``bytes``/``bytearray`` (UTF-8); a ``dict`` with ``"text"``
(str or bytes) and optional ``"id"`` and ``"metadata"`` (its other keys, a retriever's
``"score"`` say, join the metadata, where ``"metadata"``'s own keys win); any object with
``.page_content`` and ``.metadata`` (LangChain ``Document``, duck-typed so this package
never imports LangChain; the id is ``doc.id`` if truthy, else ``metadata["id"]``).

Ids: a str, or an int (turned into its str).  A chunk without one gets
``"c:" + content_digest(data).hex()[:16]``, the same for the same text in every
request.  One id may name one text only.  Metadata (a dict, or None for none) is
copied, so callers' dicts are never mutated.  Everything is checked here, once, so the
passes in :mod:`promptsplice.dedup._core` can assume valid UTF-8 bytes, str ids and dict metadata.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from promptsplice.blocks import content_digest
from promptsplice.errors import (
    ConfigError,
    ConflictingChunkIdError,
    InvalidChunkError,
    InvalidUTF8Error,
)

_DICT_KEYS = frozenset({"text", "id", "metadata"})

_NOT_BLANK = re.compile("[^\\s]|[\x1c-\x1f]")


def is_blank(text: str) -> bool:
    """Whether ``text`` is only whitespace.  Not ``str.isspace``: it counts the ASCII
    separators U+001C-U+001F as space, which are content (record separators of exported
    tables), and a chunk of them was dropped as empty, their bytes in no record."""
    return _NOT_BLANK.search(text) is None

from ._types import INVALID_UTF8_POLICIES, InputChunk

__all__ = ["normalize_chunks"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_FIX_UTF8 = (
    "pass valid UTF-8, or decode it with U+FFFD: dedup(..., on_invalid_utf8='replace'), "
    "Assembler(dedup_config=DedupConfig(on_invalid_utf8='replace'))"
)


def normalize_chunks(chunks: Iterable, *, on_invalid_utf8: str = "error") -> list[InputChunk]:
    """Validate and normalize ``chunks`` (see the module docstring for accepted forms).

    A chunk without an id gets ``"c:" + content_digest(data).hex()[:16]``, stable across
    requests.  Raises :class:`InvalidChunkError`, :class:`InvalidUTF8Error` or
    :class:`ConflictingChunkIdError` naming the offending chunk's index.
    """
    return [InputChunk(*t) for t in _normalize(chunks, on_invalid_utf8)[0]]


def _bad_utf8_bytes(index: int, exc: UnicodeDecodeError) -> InvalidUTF8Error:
    return InvalidUTF8Error(
        f"chunk {index}: bytes are not valid UTF-8 ({exc.reason}) at byte offset "
        f"{exc.start}; {_FIX_UTF8}",
        index=index,
        offset=exc.start,
    )


def _normalize(chunks: Iterable, policy: str) -> tuple[list[tuple], int]:
    """:func:`normalize_chunks` as plain tuples ``(index, id, text, data, digest,
    metadata)`` (the InputChunk fields; cheaper to build), plus the number of inputs
    decoded with U+FFFD."""
    if policy not in INVALID_UTF8_POLICIES:
        raise ConfigError(f"on_invalid_utf8 must be 'error' or 'replace', got {policy!r}")
    if isinstance(chunks, (str, bytes, bytearray, dict)) or hasattr(chunks, "page_content"):
        raise InvalidChunkError(
            f"expected an iterable of chunks, got a single {type(chunks).__name__} chunk; "
            f"wrap it in a list"
        )
    try:
        iterator = iter(chunks)
    except TypeError:
        raise InvalidChunkError(
            f"expected an iterable of chunks (list of str, bytes, dicts or Documents), "
            f"got {type(chunks).__name__}"
        ) from None

    replace = policy == "replace"
    digest_of = content_digest  # looked up per call so tests can substitute it
    out: list[tuple] = []
    append = out.append
    by_id: dict[str, tuple] = {}
    replaced = 0

    for index, chunk in enumerate(iterator):
        if type(chunk) is dict:  # the common form, checked in fewer steps
            text = chunk.get("text")
            cid = chunk.get("id")
            metadata = chunk.get("metadata")
            if (
                type(text) is str
                and type(cid) is str
                and cid
                and (metadata is None or type(metadata) is dict)
                and len(chunk) == (2 if metadata is None else 3)  # other keys: the path below
            ):
                try:
                    data = text.encode("utf-8")
                except UnicodeEncodeError:
                    pass  # the general path below raises or replaces
                else:
                    item = (index, cid, text, data, digest_of(data), dict(metadata or ()))
                    previous = by_id.setdefault(cid, item)
                    if previous is not item and previous[3] != data:
                        raise _conflict(previous, index, cid, data)
                    append(item)
                    continue
        cid = None
        metadata = None
        raw = chunk
        if type(chunk) is dict or isinstance(chunk, dict):
            if "text" not in chunk:
                raise InvalidChunkError(
                    f"chunk {index}: dict has no 'text' key (keys: {sorted(map(str, chunk))}); "
                    f"pass {{'text': ..., 'id': ..., 'metadata': {{...}}}}"
                )
            raw = chunk["text"]
            cid = chunk.get("id")
            metadata = chunk.get("metadata")
            extra = {k: v for k, v in chunk.items() if k not in _DICT_KEYS}
            if extra:  # a retriever's score or source: kept in the metadata, never dropped
                if metadata is not None and not isinstance(metadata, dict):
                    raise InvalidChunkError(
                        f"chunk {index}: metadata must be a dict, got {type(metadata).__name__}"
                    )
                metadata = {**extra, **(metadata or {})}
            if not isinstance(raw, (str, bytes, bytearray)):
                raise InvalidChunkError(
                    f"chunk {index}: dict 'text' must be str or bytes, got {type(raw).__name__}"
                )
        elif not isinstance(chunk, (str, bytes, bytearray)):
            try:
                raw = chunk.page_content
            except AttributeError:
                raise InvalidChunkError(
                    f"chunk {index}: unsupported chunk type {type(chunk).__name__}; pass str, "
                    f"UTF-8 bytes, a dict with 'text', or a Document with .page_content"
                ) from None
            if not isinstance(raw, str):
                raise InvalidChunkError(
                    f"chunk {index}: {type(chunk).__name__}.page_content must be str, "
                    f"got {type(raw).__name__}"
                )
            metadata = getattr(chunk, "metadata", None)
            cid = getattr(chunk, "id", None)
            try:
                cid = cid or None  # a falsy id means none (LangChain's default is None)
            except Exception:  # noqa: BLE001 - no truth value (an array): refused below, by type
                pass
            if cid is None and isinstance(metadata, dict):
                cid = metadata.get("id")

        # text and its UTF-8 bytes (raw is str or bytes-like here)
        if isinstance(raw, str):
            text = raw if type(raw) is str else str.__str__(raw)  # a subclass's own characters, not its __str__
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError as exc:
                if not replace:
                    raise InvalidUTF8Error.lone_surrogate(
                        f"chunk {index}: str", text, exc, index=index, fix=_FIX_UTF8
                    ) from None
                text = _SURROGATE.sub("\ufffd", text)
                data = text.encode("utf-8")
                replaced += 1
        else:
            # its own bytes: bytes() of a subclass calls its __bytes__ (as str() its __str__)
            data = raw if type(raw) is bytes else bytes(memoryview(raw))
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                if not replace:
                    raise _bad_utf8_bytes(index, exc) from None
                text = data.decode("utf-8", "replace")
                data = text.encode("utf-8")
                replaced += 1

        if metadata is None:
            metadata = {}
        elif isinstance(metadata, dict):
            metadata = dict(metadata)
        else:
            raise InvalidChunkError(
                f"chunk {index}: metadata must be a dict, got {type(metadata).__name__}"
            )

        digest = digest_of(data)
        if cid is None:
            cid = "c:" + digest.hex()[:16]
        elif type(cid) is not str:
            if isinstance(cid, str):
                cid = str.__str__(cid)  # a subclass's own characters, not its __str__ (as for text)
            elif isinstance(cid, int) and not isinstance(cid, bool):
                try:
                    cid = int.__repr__(cid)
                except ValueError:  # over Python's int-to-str digit limit
                    raise InvalidChunkError(
                        f"chunk {index}: an int id of {cid.bit_length()} bits is over Python's int-to-str "
                        "limit; pass a str id"
                    ) from None
            else:
                raise InvalidChunkError(
                    f"chunk {index}: id must be a str (or int), got {type(cid).__name__} "
                    f"{cid!r}; omit it to get a content-derived id"
                )
        if not cid:
            raise InvalidChunkError(
                f"chunk {index}: id is an empty string; omit it to get a content-derived id"
            )

        item = (index, cid, text, data, digest, metadata)
        previous = by_id.setdefault(cid, item)
        if previous is not item and previous[3] != data:
            raise _conflict(previous, index, cid, data)
        append(item)
    return out, replaced


def _conflict(previous: tuple, index: int, cid: str, data: bytes) -> ConflictingChunkIdError:
    return ConflictingChunkIdError(
        f"id {cid!r} names two different texts: chunk {previous[0]} "
        f"({len(previous[3])} bytes) and chunk {index} ({len(data)} bytes); "
        f"give each distinct text its own id (or omit ids to derive them from content)"
    )
