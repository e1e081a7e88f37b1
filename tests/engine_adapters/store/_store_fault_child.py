"""Child process and shared workload of ``test_store_faults.py`` (not a test module).

The workload is deterministic, so the parent recomputes everything the child may have
written from the round number alone: block ``i`` of round ``r`` has fixed tokens, salt,
layout and payload bytes (``shake_128`` of its key).

Run as ``python -m tests.engine_adapters._store_fault_child MODE ...`` from the
repository root:

``writer FOLDER ROUND WRITE_BEHIND``
    Opens a store on FOLDER (disk tier on, fsync on as in production, 4-8 blocks of
    DRAM so nearly every block goes to disk), prints ``READY``, then puts the round's
    blocks in order forever, printing ``P <put index> <disk_writes>`` after each put.
    The parent SIGKILLs it.
``fsize FOLDER WRITE_BEHIND``
    The full-disk stand-in: writes records, then lowers ``RLIMIT_FSIZE`` below a
    record's size (SIGXFSZ ignored) so the kernel fails every record write with
    ``EFBIG`` after a short write, checks what the store serves, raises the limit again,
    lowers it again, prints one JSON line of what it saw and SIGKILLs itself (a crash
    while writes were failing; the parent then reopens the folder).
``exit FOLDER PUTS``
    Puts PUTS blocks through ``shared_store`` with a deep write-behind queue, prints
    ``{"puts", "dram_blocks", "disk_writes"}`` and exits normally without closing.
``filler FOLDER WRITE_BEHIND``
    The same run with a real ``ENOSPC``: a filler file takes the rest of the folder's
    filesystem.  Needs a small filesystem, so it is not in the suite (a tmpfs mount needs
    root or an unprivileged user namespace, which CI runners may refuse); by hand
    (``mkdir /tmp/full`` first)::

        unshare -Urm sh -c 'mount -t tmpfs -o size=256k tmpfs /tmp/full &&
            .venv/bin/python -m tests.engine_adapters._store_fault_child filler /tmp/full 0'
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import itertools
import json
import logging
import math
import os
import random
import resource
import signal
import sys
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from promptsplice.engine_adapters.store._store import BlockRef, BlockStore, StoreConfig, chain_refs

BS = 16
BLOCKS_PER_SEQ = 6
FINGERPRINT = "store-faults/v1"
LAYOUTS = (((2, 2, BS, 8), "bfloat16"), ((4, 2, BS, 4), "float32"), ((2, 2, BS, 16), "float16"))
"""Payloads of 1024, 2048 and 2048 bytes, one layout per sequence (cycling)."""
WRITER_DRAM = 8 * 1024
DISK_BYTES = 256 * 1024 * 1024  # never evicts in these runs: every record written stays


class Block(NamedTuple):
    """One block of the workload: what ``put`` got, and the exact payload it carried."""

    index: int
    """Position in the round's put order."""
    ref: BlockRef
    salt: str | None
    shape: tuple[int, ...]
    dtype: str
    seq: int

    def payload(self) -> torch.Tensor:
        return payload_for(self.ref.key, self.shape, self.dtype)


def payload_for(key: bytes, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """The block's payload: bytes derived from its key only (any bit pattern, NaNs too)."""
    nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
    raw = bytearray(hashlib.shake_128(b"payload/" + key).digest(nbytes))
    return torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def salt_of(seq: int) -> str | None:
    return None if seq % 4 == 3 else f"tenant-{seq % 3}"


def sequence(round_: int, seq: int) -> list[Block]:
    """The blocks of one prompt (``BLOCKS_PER_SEQ`` full blocks, one chain)."""
    rng = random.Random(f"store-faults/{round_}/{seq}")
    tokens = [rng.randrange(0, 2**32) for _ in range(BLOCKS_PER_SEQ * BS)]
    shape, dtype = LAYOUTS[seq % len(LAYOUTS)]
    salt = salt_of(seq)
    refs = chain_refs(tokens, BS, salt=salt)
    first = seq * BLOCKS_PER_SEQ
    return [Block(first + i, ref, salt, shape, dtype, seq) for i, ref in enumerate(refs)]


def blocks(round_: int) -> Iterator[Block]:
    """The round's puts, in order (endless)."""
    for seq in itertools.count():
        yield from sequence(round_, seq)


def writer_config(folder: str, write_behind: int) -> StoreConfig:
    return StoreConfig(
        dram_bytes=WRITER_DRAM,
        disk_bytes=DISK_BYTES,
        disk_dir=folder,
        fingerprint=FINGERPRINT,
        fsync=True,
        write_behind_bytes=write_behind,
    )


def run_writer(folder: str, round_: int, write_behind: int) -> None:
    store = BlockStore(writer_config(folder, write_behind))
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    for block in blocks(round_):
        store.put(block.ref, block.payload(), salt=block.salt, copy=False)
        out.write(f"P {block.index} {store.stats().disk_writes}\n")
        out.flush()


# ----------------------------------------------------------------------------- fsize

FSIZE_LAYOUT = LAYOUTS[1]  # every block 2048 payload bytes: exact DRAM accounting
FSIZE_DRAM_BLOCKS = 4
FSIZE_LIMIT = 1000
"""Bytes a file may have while the 'disk is full': less than any record (2.3 KB)."""
FSIZE_RETRY_S = 0.25


def fsize_blocks() -> list[Block]:
    """Uniform-layout blocks for the fsize run (sequences with layout 1 only), indexed
    by their position in the run's put order."""
    out: list[Block] = []
    for seq in itertools.count(1, len(LAYOUTS)):
        base = len(out)
        out.extend(b._replace(index=base + i) for i, b in enumerate(sequence(99, seq)))
        if len(out) >= 40:
            return out
    raise AssertionError  # pragma: no cover


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _files(folder: str) -> list[str]:
    return sorted(os.listdir(folder))


class _FileSizeLimit:
    """The disk is 'full' while RLIMIT_FSIZE is below a record's size (SIGXFSZ ignored):
    the kernel completes a short write up to the limit, then fails with EFBIG."""

    def __init__(self, folder: str) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        self.folder = folder
        self.soft, self.hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def fill(self) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, self.hard))

    def free(self) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.soft, self.hard))


class _Filler:
    """The disk is really full: a filler file takes every free byte of the folder's
    filesystem (ENOSPC).  Only for a small filesystem (a tmpfs of a few hundred KiB)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, "filler")

    def fill(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        chunk = bytes(4096)
        try:
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        return
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)

    def free(self) -> None:
        os.unlink(self.path)


def _probe(path: str) -> list[object]:
    """What the kernel does with a record-sized write while 'full': bytes written
    before the error, and the error."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    first: object = 0
    second: object = "no error"
    try:
        try:
            first = os.write(fd, bytes(FSIZE_LIMIT + 100))
            os.write(fd, bytes(FSIZE_LIMIT + 100))
        except OSError as exc:
            second = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    finally:
        os.close(fd)
        os.unlink(path)
    return [first, second]


def run_full_disk(folder: str, write_behind: int, how: str) -> None:
    """Writes with room, with a full disk, retries, recovers, and crashes while full."""
    disk = _FileSizeLimit(folder) if how == "fsize" else _Filler(folder)
    warned = _Warnings()
    logging.getLogger("promptsplice.engine_adapters.store").addHandler(warned)
    shape, dtype = FSIZE_LAYOUT
    p = math.prod(shape) * getattr(torch, dtype).itemsize
    config = writer_config(folder, write_behind)
    store = BlockStore(dataclasses.replace(config, dram_bytes=FSIZE_DRAM_BLOCKS * p, disk_retry_s=FSIZE_RETRY_S))
    by_index = {b.index: b for b in fsize_blocks()}
    todo = iter(by_index.values())
    report: dict[str, object] = {"put": {}, "phases": {}}

    def put(n: int, phase: str) -> None:
        for _ in range(n):
            b = next(todo)
            report["put"][b.index] = phase  # type: ignore[index]
            assert store.put(b.ref, b.payload(), salt=b.salt).value == "stored"

    def snapshot(phase: str, **extra: object) -> None:
        store.drain()
        report["phases"][phase] = {  # type: ignore[index]
            "stats": store.stats()._asdict(),
            "files": _files(folder),
            "warnings": list(warned.messages),
            **extra,
        }

    def statuses(indices: list[int]) -> list[str]:
        out = []
        for i in indices:
            b = by_index[i]
            got = store.get(b.ref, salt=b.salt)
            exact = got.status.hit and raw_bytes(got.payload) == raw_bytes(b.payload())
            out.append(got.status.value + ("" if not got.status.hit else "+exact" if exact else "+WRONG"))
        return out

    # 1. Room on disk: 10 puts, the 6 oldest go down to disk.
    put(10, "room")
    snapshot("room")
    # 2. The disk is full: every record write fails (after a short write, for fsize).
    disk.fill()
    report["probe"] = _probe(os.path.join(folder, "probe"))
    put(8, "full")  # evicts the 4 last 'room' blocks and 4 'full' ones: none can be written
    dram = statuses([14, 15, 16, 17])  # the 4 newest: DRAM
    disk_hits = statuses([0, 1])  # on disk since phase 1: promoted, evicting 14 and 15
    snapshot("full", dram=dram, disk=disk_hits)
    # 3. Past the retry interval the store tries again, fails again, does not warn again.
    time.sleep(FSIZE_RETRY_S * 1.5)
    put(2, "retry")
    snapshot("retry")
    # 4. Space comes back: after the retry interval the writes resume.
    disk.free()
    time.sleep(FSIZE_RETRY_S * 1.5)
    put(6, "resumed")
    snapshot("resumed")
    # 5. Full again, then a crash: the parent reopens the folder.
    disk.fill()
    time.sleep(FSIZE_RETRY_S * 1.5)
    put(3, "crash")
    snapshot("crash")
    disk.free()  # stdout may be a file; and the folder is left as a crash leaves it
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def run_exit(folder: str, puts: int) -> None:
    """Put ``puts`` blocks through the process's shared store with a deep write-behind
    queue, print what is still pending, and leave by a normal interpreter exit, without
    closing the store."""
    from promptsplice.engine_adapters.store._store import shared_store

    store = shared_store(writer_config(folder, 4 * 1024 * 1024))
    for block, _ in zip(blocks(0), range(puts)):
        store.put(block.ref, block.payload(), salt=block.salt, copy=False)
    st = store.stats()
    sys.stdout.write(json.dumps({"puts": puts, "dram_blocks": st.dram_blocks, "disk_writes": st.disk_writes}) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    mode, folder, *rest = argv
    if mode == "writer":
        run_writer(folder, int(rest[0]), int(rest[1]))
    elif mode == "exit":
        run_exit(folder, int(rest[0]))
    elif mode in ("fsize", "filler"):
        run_full_disk(folder, int(rest[0]), mode)
    else:  # pragma: no cover
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
