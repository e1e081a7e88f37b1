"""The block store's on-disk record: one file per KV block, self-describing and checked.

A record is everything needed to serve the block again after a restart, and to refuse
it when anything about it is wrong::

    fixed header   magic "PSKVBLK\\0", format version, namespace, dtype code, ndim,
                   salt length, token count, payload bytes, key, parent, fingerprint
    shape          ndim little-endian uint64
    salt           the tenant salt in the store's encoding (see :func:`salt_bytes`)
    token ids      little-endian uint32 (``promptsplice.blocks.token_bytes``)
    header digest  xxh3-128 of everything above: lets the store check a header when it
                   opens a folder without reading the payload
    padding        zeros up to a multiple of 64 bytes, so the payload is aligned
    payload        the tensor's raw bytes (native byte order: little-endian machines)
    record digest  xxh3-128 of everything above (header + payload), checked on every load

File name ``{namespace:02x}-{key hex}.kvb``; a record is first written to
``{name}.{random}.tmp`` in the same folder, fsynced, then renamed over the final name
(``os.replace`` is atomic), so a crash leaves either the whole old state, the whole new
record, or a ``.tmp`` file that the next open deletes.  Both digests use
``promptsplice.blocks.content_digest``: this module hashes no tokens itself.

This module holds no state and does not import torch at import time; only the disk tier
(``_disk``) uses it.  The block identity it writes (:class:`BlockMeta`, the salt
encoding, the dtypes) is owned by ``_tier`` and re-exported here.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from promptsplice.blocks import HASH_BYTES, content_digest, round_up
from promptsplice.engine_adapters.store._tier import BlockMeta, dtype_name, salt_bytes, supported_dtypes

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAGIC",
    "VERSION",
    "ALIGN",
    "BlockMeta",
    "Header",
    "salt_bytes",
    "dtype_name",
    "supported_dtypes",
    "record_name",
    "parse_record_name",
    "is_temp_name",
    "temp_name",
    "header_size",
    "record_size",
    "encode_record",
    "parse_header",
    "decode_record",
]

MAGIC = b"PSKVBLK\x00"
VERSION = 1
ALIGN = 64
"""The payload starts at a multiple of this many bytes (any dtype view is aligned)."""

_FIXED = struct.Struct("<8sHBBBxHIQ16s16s16s")
# magic, version, namespace, dtype code, ndim, (pad), salt length, token count,
# payload bytes, key, parent, fingerprint digest
MAX_SALT_BYTES = 0xFFFF
"""The longest salt a record holds (its stored form, tag byte included): the header
keeps its length in 16 bits."""
_DIM = struct.Struct("<Q")

# Stable codes: never renumber (they are in files on disk).
_DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "int8": 5,
    "uint8": 6,
    "int16": 7,
    "int32": 8,
    "int64": 9,
    "float8_e4m3fn": 10,
    "float8_e5m2": 11,
}
_DTYPE_BY_CODE = {code: name for name, code in _DTYPE_CODES.items()}
assert set(_DTYPE_CODES) == set(supported_dtypes()), "every dtype a store holds needs a code"
_RECORD_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})\.kvb$")
_TEMP_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}\.kvb\.[0-9a-z_-]+\.tmp$")


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed record header: the block's metadata and where its payload lies."""

    meta: BlockMeta
    fingerprint: bytes
    payload_offset: int
    total_size: int


def record_name(namespace: int, key: bytes) -> str:
    """File name of the record of ``key`` in ``namespace``."""
    return f"{namespace:02x}-{key.hex()}.kvb"


def parse_record_name(name: str) -> tuple[int, bytes] | None:
    """``(namespace, key)`` of a record file name; ``None`` for any other name."""
    m = _RECORD_RE.match(name)
    if m is None:
        return None
    return int(m.group(1), 16), bytes.fromhex(m.group(2))


def temp_name(final_name: str, unique: str) -> str:
    """Name of the temporary file a record is written to before its rename."""
    return f"{final_name}.{unique}.tmp"


def is_temp_name(name: str) -> bool:
    """True for a temporary record file (a write that never completed its rename)."""
    return _TEMP_RE.match(name) is not None


def header_size(meta: BlockMeta) -> int:
    """Bytes before the payload: header, header digest and padding."""
    raw = _FIXED.size + _DIM.size * len(meta.shape) + len(meta.salt) + len(meta.tokens) + HASH_BYTES
    return round_up(raw, ALIGN)


def record_size(meta: BlockMeta) -> int:
    """Size of the record file of ``meta``: what the block costs in the disk budget."""
    return header_size(meta) + meta.nbytes + HASH_BYTES


def _header_bytes(meta: BlockMeta, fingerprint: bytes) -> bytes:
    head = b"".join(
        [
            _FIXED.pack(
                MAGIC,
                VERSION,
                meta.namespace,
                _DTYPE_CODES[meta.dtype],
                len(meta.shape),
                len(meta.salt),
                len(meta.tokens) // 4,
                meta.nbytes,
                meta.key,
                meta.parent,
                fingerprint,
            ),
            *(_DIM.pack(d) for d in meta.shape),
            meta.salt,
            meta.tokens,
        ]
    )
    head += content_digest(head)
    return head + bytes(header_size(meta) - len(head))


def encode_record(meta: BlockMeta, payload: memoryview, fingerprint: bytes) -> bytearray:
    """The whole record file of one block (``payload``: its raw bytes, C order)."""
    if payload.nbytes != meta.nbytes:
        raise ValueError(f"payload has {payload.nbytes} bytes, the shape needs {meta.nbytes}")
    head = _header_bytes(meta, fingerprint)
    buf = bytearray(len(head) + meta.nbytes + HASH_BYTES)
    buf[: len(head)] = head
    end = len(head) + meta.nbytes
    buf[len(head) : end] = payload.cast("B")
    buf[end:] = content_digest(memoryview(buf)[:end])
    return buf


def parse_header(data: bytes | bytearray | memoryview) -> Header | int:
    """Parse and check a record header from the start of a file.

    Returns the :class:`Header`, or the number of bytes needed when ``data`` is too
    short to hold the whole header.  Raises ``ValueError`` (with the reason) when the
    header is not a valid record header: wrong magic or version, an unknown namespace
    or dtype, inconsistent sizes, or a header digest that does not match.
    """
    view = memoryview(data)
    if len(view) < _FIXED.size:
        return _FIXED.size
    fields = _FIXED.unpack_from(view)
    (magic, version, namespace, code, ndim, salt_len, n_tokens, nbytes, key, parent, fp) = fields
    if magic != MAGIC:
        raise ValueError("bad magic")
    if version != VERSION:
        raise ValueError(f"unsupported record version {version}")
    dtype = _DTYPE_BY_CODE.get(code)
    if dtype is None:
        raise ValueError(f"unknown dtype code {code}")
    raw = _FIXED.size + _DIM.size * ndim + salt_len + 4 * n_tokens
    if len(view) < raw + HASH_BYTES:
        return raw + HASH_BYTES
    if content_digest(view[:raw]) != bytes(view[raw : raw + HASH_BYTES]):
        raise ValueError("header digest mismatch")
    pos = _FIXED.size
    shape = tuple(_DIM.unpack_from(view, pos + i * _DIM.size)[0] for i in range(ndim))
    pos += _DIM.size * ndim
    salt = bytes(view[pos : pos + salt_len])
    pos += salt_len
    tokens = bytes(view[pos : pos + 4 * n_tokens])
    meta = BlockMeta(namespace, bytes(key), salt, bytes(parent), tokens, shape, dtype)
    if meta.nbytes != nbytes:
        raise ValueError(f"payload size {nbytes} does not match shape {shape} of {dtype}")
    offset = header_size(meta)
    return Header(meta, bytes(fp), offset, offset + nbytes + HASH_BYTES)


def decode_record(buf: bytearray) -> tuple[Header, torch.Tensor]:
    """Check a whole record file (size, header, record digest) and view its payload.

    The returned tensor shares memory with ``buf`` (no copy).  Raises ``ValueError``
    with the reason when the record is damaged in any way.
    """
    import torch

    header = parse_header(buf)
    if isinstance(header, int):
        raise ValueError(f"truncated header ({len(buf)} bytes)")
    if len(buf) != header.total_size:
        raise ValueError(f"record has {len(buf)} bytes, its header says {header.total_size}")
    end = header.total_size - HASH_BYTES
    view = memoryview(buf)
    if content_digest(view[:end]) != bytes(view[end:]):
        raise ValueError("record digest mismatch")
    meta = header.meta
    dtype = getattr(torch, meta.dtype)
    if meta.nbytes == 0:
        try:
            return header, torch.empty(meta.shape, dtype=dtype)
        except (RuntimeError, TypeError) as exc:  # zero bytes, but dimensions past int64
            raise ValueError(f"shape {meta.shape} is not a tensor torch can hold: {exc}") from None
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=meta.nbytes, offset=header.payload_offset)
    return header, flat.view(dtype).reshape(meta.shape)
