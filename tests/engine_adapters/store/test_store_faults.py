"""Disk-tier faults of the KV block store (issue #8), beyond those of ``test_store.py``.

``test_store.py`` already flips a payload byte, truncates a record, writes a wrong
magic or version, damages a header, leaves ``.tmp`` files and mocks ``ENOSPC``.  Here:

* a writer process SIGKILLed for real at seeded moments, inline and with the
  background writer, then the folder reopened by this process;
* a record torn at every length and flipped at every byte, under its final name and
  under a temporary name, with the address space capped, plus a hypothesis property of
  the record format on arbitrary bytes;
* a real kernel write error (``RLIMIT_FSIZE`` -> ``EFBIG``) standing in for a full disk,
  in a child process: a real ``ENOSPC`` needs a small filesystem (a tmpfs mount: root,
  or an unprivileged user namespace, which CI runners may refuse), so it is run by hand
  only (see ``_store_fault_child``; same counts as below, checked on this machine);
* records changed behind an open (and a closed) store by someone else.

The workload (tokens, salts, layouts, payload bytes of every block) is a function of
the round number (``_store_fault_child``), so the parent knows the exact bytes of any
block a child could have written.  The longer tests print what they measured (``-s``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from promptsplice.engine_adapters.store import _disk
from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._store import BlockStore, LookupStatus, StoreConfig
from promptsplice.blocks import content_digest, round_up

from ._store_fault_child import (
    BLOCKS_PER_SEQ,
    FINGERPRINT,
    FSIZE_LIMIT,
    Block,
    fsize_blocks,
    payload_for,
    raw_bytes,
    sequence,
    writer_config,
)

REPO = Path(__file__).resolve().parents[3]
CHILD = "tests.engine_adapters.store._store_fault_child"
FP = content_digest(FINGERPRINT.encode("utf-8"))
STORE_LOGGER = "promptsplice.engine_adapters.store"  # the policy's and every tier's logs
HIT_DISK = LookupStatus.HIT_DISK
MISS, MISMATCH, CORRUPT = LookupStatus.MISS, LookupStatus.MISMATCH, LookupStatus.CORRUPT


def _spawn(*args: object) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", CHILD, *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stderr(proc: subprocess.Popen) -> str:
    """What the child wrote to stderr (once it has ended)."""
    if proc.poll() is None or proc.stderr is None or proc.stderr.closed:
        return ""
    with proc.stderr:
        return proc.stderr.read()


def _files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n != _disk.LOCK_NAME)


def _served(store: BlockStore, block: Block) -> bool:
    """Load ``block``; True when served, and then byte-exact (else the test fails)."""
    got = store.get(block.ref, salt=block.salt)
    if not got.status.hit:
        assert got.status is MISS, (block.index, got.status)
        return False
    want = block.payload()
    assert tuple(got.payload.shape) == block.shape and got.payload.dtype == want.dtype, block.index
    assert raw_bytes(got.payload) == raw_bytes(want), f"block {block.index}: WRONG payload served"
    return True


# ------------------------------------------------------------- 1. killed mid-write


def _run_and_kill(folder, round_: int, write_behind: int, delay: float) -> tuple[int, int]:
    """Start a writer, SIGKILL it ``delay`` s after it opened the store.

    Returns (last put index it reported, disk_writes at that moment); -1 when none.
    """
    proc = _spawn("writer", folder, round_, write_behind)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line == "READY\n":
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120  # a torch import on a loaded machine
        while not ready.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the writer never opened its store (rc {proc.poll()}):\n{_stderr(proc)}")
        time.sleep(delay)
        still_running = proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join()
    err = _stderr(proc)
    assert still_running and proc.returncode == -signal.SIGKILL, (
        f"the writer was not running when killed (rc {proc.returncode}):\n{err}"
    )
    last = (-1, 0)
    for line in lines:  # only whole lines: the kill may cut the last one
        if line.startswith("P ") and line.endswith("\n"):
            i, n = line.split()[1:]
            last = (int(i), int(n))
    return last


def _round_blocks(round_: int, upto: int) -> list[Block]:
    """The round's blocks with index <= ``upto``, whole sequences."""
    out: list[Block] = []
    for seq in range(upto // BLOCKS_PER_SEQ + 1):
        out.extend(sequence(round_, seq))
    return out


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("write_behind", "kills"), [(0, 8), (16 * 1024, 4)], ids=["inline-writes", "background-writer"]
)
def test_writer_killed_mid_write_never_leaves_a_partial_block_served(tmp_path, write_behind, kills):
    """Kill a writing process (fsync on, 4-8 blocks of DRAM) at seeded moments, each
    round in the same folder; after each kill this process opens the folder (the
    kill released the child's flock) and loads every block the child could have
    written: each is served byte-exact or not at all, and the served blocks are exactly
    the oldest ones in put order (write-downs are FIFO), at least as many as the child
    had seen written."""
    folder = str(tmp_path / "kv")
    rng = random.Random(8 + write_behind)
    delays = [0.0] + [rng.uniform(0.005, 0.2) for _ in range(kills - 1)]
    survived: dict[int, int] = {}  # round -> blocks served after its kill (a prefix)
    upper: dict[int, int] = {}
    totals = Counter()
    for round_, delay in enumerate(delays):
        last_put, last_written = _run_and_kill(folder, round_, write_behind, delay)
        upper[round_] = last_put + 2  # the put in progress may have finished
        totals["puts"] += last_put + 1
        totals["written_seen"] += last_written

        # The folder as the kill left it: whole records and temporary files only.
        known = {b.ref.key: b for r in survived | {round_: 0} for b in _round_blocks(r, upper[r])}
        names = _files(folder)
        temps = [n for n in names if fmt.is_temp_name(n)]
        records = [n for n in names if fmt.parse_record_name(n)]
        assert len(temps) + len(records) == len(names), names
        for name in records:
            ns, key = fmt.parse_record_name(name)
            assert ns == 0 and key in known, f"{name}: a record the child never put"
            header, payload = fmt.decode_record(bytearray((Path(folder) / name).read_bytes()))
            assert raw_bytes(payload) == raw_bytes(known[key].payload())
        for name in temps:
            try:
                fmt.decode_record(bytearray((Path(folder) / name).read_bytes()))
                totals["whole_temp_files"] += 1
            except ValueError:
                totals["partial_temp_files"] += 1  # the kill landed inside a record write

        with BlockStore(writer_config(folder, 0)) as store:  # ConfigError if still locked
            s0 = store.stats()
            assert (s0.corrupt, s0.foreign, s0.disk_blocks) == (len(temps), 0, len(records))
            unit = _disk.allocation_unit(folder)  # each file charged in whole allocation units
            assert s0.disk_bytes == sum(-(-os.path.getsize(Path(folder) / n) // unit) * unit for n in records)
            assert not any(fmt.is_temp_name(n) for n in _files(folder))
            served_total = 0
            for r in sorted(survived | {round_: 0}):
                blocks = _round_blocks(r, upper[r])
                served = []
                for seq in range(len(blocks) // BLOCKS_PER_SEQ):
                    chain = blocks[seq * BLOCKS_PER_SEQ : (seq + 1) * BLOCKS_PER_SEQ]
                    counted = store.match_prefix([b.ref for b in chain], salt=chain[0].salt)
                    got = [_served(store, b) for b in chain]
                    assert got == [True] * counted + [False] * (len(chain) - counted), (r, seq)
                    served.extend(got)
                n = sum(served)
                assert served == [True] * n + [False] * (len(served) - n), f"round {r}: not a prefix"
                if r in survived:
                    assert n == survived[r], f"round {r}: {survived[r]} blocks before, {n} now"
                else:
                    assert last_written <= n <= upper[r], (last_written, n, upper[r])
                    survived[r] = n
                served_total += n
            s1 = store.stats()
            assert (s1.disk_hits, s1.corrupt, s1.mismatches) == (served_total, s0.corrupt, 0)
            assert (s1.write_errors, s1.dropped, s1.disk_writes) == (0, 0, 0)
        totals["temp_files"] += len(temps)
    totals["served_after_restart"] = sum(survived.values())
    totals["kills"] = len(delays)
    print(f"\n{write_behind=}: {dict(totals)}; served per round {[survived[r] for r in sorted(survived)]}")
    assert totals["served_after_restart"] > 0, "no block survived any kill: the check would be vacuous"
    assert sum(1 for n in survived.values() if n) >= 2


# ------------------------------------------------------------- 2. torn records


@contextmanager
def _address_space(headroom: int = 2 << 30):
    """Cap this process's address space at its current size + ``headroom``: a damaged
    header that makes the store allocate what the header claims fails here as it would
    on a machine without that memory."""
    status = Path("/proc/self/status").read_text()
    vm = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + headroom if hard == resource.RLIM_INFINITY else min(vm + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.reliability
def test_torn_records_at_every_length_and_every_flipped_byte_are_never_served(tmp_path, caplog):
    """A record as a crash (or the disk) may leave it: cut at every length, each byte
    flipped (bit 0, bit 7, all bits), and longer than it should be; under the record's
    name and under a temporary name.  Each case opens the store on the folder and loads
    the block: it is never served (MISS or CORRUPT), the intact neighbour always is,
    and no temporary file survives the open."""
    caplog.set_level(logging.ERROR, logger=STORE_LOGGER)  # thousands of "deleted damaged"
    folder = tmp_path / "kv"
    victim, neighbour, last = sequence(7, 0)[:3]
    cfg = StoreConfig(
        dram_bytes=1024, disk_bytes=1 << 20, disk_dir=str(folder), fingerprint=FINGERPRINT, write_behind_bytes=0
    )
    with BlockStore(cfg) as store:
        for b in (victim, neighbour, last):  # victim and neighbour go down to disk
            store.put(b.ref, b.payload(), salt=b.salt)
    final = folder / fmt.record_name(0, victim.ref.key)
    whole = final.read_bytes()
    spare = (folder / fmt.record_name(0, neighbour.ref.key)).read_bytes()
    temp = folder / fmt.temp_name(final.name, "k1ll3d")
    header = fmt.parse_header(whole)
    assert isinstance(header, fmt.Header) and header.total_size == len(whole)

    cases: list[tuple[str, str, bytes]] = []
    for n in range(len(whole)):
        cases += [("cut", "final", whole[:n]), ("cut", "temp", whole[:n])]
    for i in range(len(whole)):
        for mask in (0x01, 0x80, 0xFF):
            data = bytearray(whole)
            data[i] ^= mask
            cases.append(("flip", "final", bytes(data)))
        cases.append(("flip", "temp", bytes(data)))
    for extra in (b"\0", b"\0" * 64, whole):
        cases.append(("longer", "final", whole + extra))
    cases.append(("whole", "temp", whole))  # complete but never renamed: not committed

    outcomes: Counter = Counter()
    with _address_space():
        for kind, where, data in cases:
            for name in _files(folder):
                os.unlink(folder / name)
            (folder / fmt.record_name(0, neighbour.ref.key)).write_bytes(spare)
            (final if where == "final" else temp).write_bytes(data)
            with BlockStore(cfg) as store:
                at_open = store.stats().corrupt
                assert not temp.exists()
                got = store.get(victim.ref, salt=victim.salt)
                assert not got.status.hit, f"{kind} {where} {len(data)} bytes: served"
                assert _served(store, neighbour)
                outcomes[(kind, where, "removed at open" if at_open else got.status.value)] += 1
                assert store.stats().corrupt == at_open + (got.status is CORRUPT)
    # the control: the untouched record is served
    for name in _files(folder):
        os.unlink(folder / name)
    final.write_bytes(whole)
    with BlockStore(cfg) as store:
        assert _served(store, victim)
    print(f"\n{len(cases)} damaged records ({len(whole)} bytes each): {dict(outcomes)}")
    assert sum(outcomes.values()) == len(cases)


_ITEMSIZE = {1: 4, 2: 2, 3: 2, 4: 8, 5: 1, 6: 1, 7: 2, 8: 4, 9: 8, 10: 1, 11: 1}


def _craft(
    *,
    magic=fmt.MAGIC,
    version=fmt.VERSION,
    namespace=0,
    code=1,
    shape=(2, 3),
    ndim=None,
    salt=b"sx",
    tokens=b"\1\0\0\0\2\0\0\0",
    nbytes=None,
    key=b"k" * 16,
    parent=b"p" * 16,
    fp=b"f" * 16,
    header_digest=None,
    padding=None,
    payload=None,
    record_digest=None,
) -> bytes:
    """A record built field by field (not by ``encode_record``): any field may lie."""
    natural = math.prod(shape) * _ITEMSIZE.get(code, 1)
    nbytes = natural if nbytes is None else nbytes
    head = fmt._FIXED.pack(
        magic, version, namespace, code, len(shape) if ndim is None else ndim,
        len(salt), len(tokens) // 4, nbytes, key, parent, fp,
    )  # fmt: skip
    head += b"".join(int(d).to_bytes(8, "little") for d in shape) + salt + tokens[: len(tokens) // 4 * 4]
    head += content_digest(head) if header_digest is None else header_digest
    pad = round_up(len(head), fmt.ALIGN) - len(head)
    head += bytes(pad) if padding is None else (padding * pad)[:pad]
    body = head + (bytes(range(256)) * (1 + nbytes // 256))[:nbytes] if payload is None else head + payload
    return body + (content_digest(body) if record_digest is None else record_digest)


@st.composite
def _records(draw) -> bytes:
    dims = st.one_of(st.integers(0, 6), st.integers(0, 2**64 - 1), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]))
    shape = tuple(draw(st.lists(dims, max_size=4)))
    code = draw(st.integers(0, 13))
    natural = math.prod(shape) * _ITEMSIZE.get(code, 1)
    lie = st.one_of(st.none(), st.binary(min_size=16, max_size=16))
    kw = dict(
        magic=draw(st.sampled_from([fmt.MAGIC] * 4 + [b"PSKVBLK\x01"])),
        version=draw(st.sampled_from([fmt.VERSION] * 4 + [0, 2, 65535])),
        namespace=draw(st.integers(0, 255)),
        code=code,
        shape=shape,
        ndim=draw(st.one_of(st.none(), st.none(), st.integers(0, 255))),
        salt=draw(st.binary(max_size=9)),
        tokens=draw(st.binary(max_size=24)),
        nbytes=draw(st.one_of(st.none(), st.none(), st.integers(0, 2**64 - 1))) if natural < 2**64 else 0,
        key=draw(st.binary(min_size=16, max_size=16)),
        fp=draw(st.binary(min_size=16, max_size=16)),
        header_digest=draw(st.one_of(st.none(), st.none(), lie)),
        padding=draw(st.one_of(st.none(), st.none(), st.binary(min_size=1, max_size=3))),
        record_digest=draw(st.one_of(st.none(), st.none(), lie)),
    )
    nbytes = natural if kw["nbytes"] is None else kw["nbytes"]
    if nbytes > 4096:  # too large to materialize: a payload of some other length
        kw["payload"] = draw(st.binary(max_size=64))
    data = _craft(**kw)
    cut = draw(st.one_of(st.none(), st.none(), st.integers(0, len(data))))
    return data[:cut] + draw(st.one_of(st.just(b""), st.just(b""), st.binary(max_size=8)))


def _unpadded(meta: fmt.BlockMeta) -> int:
    return fmt._FIXED.size + 8 * len(meta.shape) + len(meta.salt) + len(meta.tokens) + 16


def _check_record_bytes(data: bytes, seen: Counter) -> None:
    try:
        header = fmt.parse_header(data)
    except ValueError:
        seen["header: ValueError"] += 1
        header = None
    if isinstance(header, int):
        assert header > len(data)
        seen["header: needs more bytes"] += 1
    elif header is not None:
        meta = header.meta
        head = fmt._header_bytes(meta, header.fingerprint)
        n = _unpadded(meta)
        assert head[:n] == data[:n]
        assert header.payload_offset == len(head) == fmt.header_size(meta)
        assert header.total_size == header.payload_offset + meta.nbytes + 16 == fmt.record_size(meta)
        seen["header: parsed"] += 1
    try:
        header, payload = fmt.decode_record(bytearray(data))
    except ValueError:
        seen["record: ValueError"] += 1
        return
    meta = header.meta
    assert tuple(payload.shape) == meta.shape and payload.dtype == getattr(torch, meta.dtype)
    raw = raw_bytes(payload)
    assert raw == data[header.payload_offset : header.payload_offset + meta.nbytes]
    again = bytes(fmt.encode_record(meta, memoryview(raw), header.fingerprint))
    n = _unpadded(meta)
    if data[n : header.payload_offset] == bytes(header.payload_offset - n):
        assert again == data
        seen["record: decoded"] += 1
    else:  # only the padding differs (and so the record digest over it)
        assert again[:n] == data[:n] and again[header.payload_offset : -16] == data[header.payload_offset : -16]
        seen["record: decoded, nonzero padding"] += 1


@pytest.mark.reliability
def test_record_format_on_arbitrary_bytes_raises_value_error_or_round_trips():
    """``parse_header``/``decode_record`` on any bytes (random, after a valid magic, or
    records built field by field with any field lying): ``ValueError`` (documented),
    "need more bytes" (``parse_header`` only), or a header/payload that encodes back to
    the input; never another exception.  The padding between the header digest and the
    payload is read by nothing: only the record digest covers it."""
    seen: Counter = Counter()

    @settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        data=st.one_of(
            st.binary(max_size=400),
            st.binary(max_size=400).map(lambda b: fmt.MAGIC + fmt.VERSION.to_bytes(2, "little") + b),
            _records(),
        )
    )
    @example(data=_craft())
    @example(data=_craft(shape=(0, 2**63)))  # zero bytes, but a dimension torch cannot hold
    @example(data=_craft(shape=(0, 2**64 - 1), code=6))
    @example(data=_craft(shape=(0, 2**62, 4)))  # each dimension fits, the strides do not
    @example(data=_craft(padding=b"\x01"))
    def prop(data: bytes) -> None:
        _check_record_bytes(data, seen)

    prop()
    print(f"\nformat property outcomes: {dict(seen)}")
    assert all(seen[k] for k in ("header: ValueError", "header: needs more bytes", "header: parsed"))
    assert seen["record: decoded"] and seen["record: ValueError"]


@pytest.mark.reliability
@pytest.mark.parametrize(
    "shape", [(0, 2**63), (0, 2**62, 4), (2**62, 4, 0)], ids=["dim-past-int64", "strides-overflow", "storage-overflow"]
)
def test_a_zero_size_record_whose_shape_torch_cannot_hold_is_corrupt_not_an_exception(tmp_path, caplog, shape):
    """A self-consistent record (both digests valid) of zero payload bytes whose
    dimensions overflow torch's int64 sizes or strides: the load answers CORRUPT and
    deletes it (it used to raise torch's TypeError/RuntimeError out of ``get``)."""
    caplog.set_level(logging.ERROR, logger=STORE_LOGGER)
    folder = tmp_path / "kv"
    block = sequence(12, 0)[0]
    cfg = writer_config(str(folder), 0)
    BlockStore(cfg).close()  # creates the folder
    path = folder / fmt.record_name(0, block.ref.key)
    path.write_bytes(_record(block, shape=shape, payload=torch.empty(0, dtype=torch.uint8)))
    with BlockStore(cfg) as store:
        assert store.stats().disk_blocks == 1  # the header is fine: indexed at open
        assert store.contains(block.ref, salt=block.salt)
        assert store.get(block.ref, salt=block.salt) == (CORRUPT, None)
        assert (store.stats().corrupt, path.exists()) == (1, False)


# ------------------------------------------------------------- 3. a full disk (EFBIG)


@pytest.mark.reliability
@pytest.mark.parametrize("write_behind", [0, 64 * 1024], ids=["inline-writes", "background-writer"])
def test_kernel_write_errors_drop_blocks_keep_dram_and_leave_no_partial_record(tmp_path, write_behind):
    """A child lowers RLIMIT_FSIZE below a record's size (SIGXFSZ ignored): the kernel
    cuts each record write short and then fails it with EFBIG, as a full disk fails it
    with ENOSPC.  The store warns once per outage, drops the blocks it cannot write,
    keeps serving DRAM and its records, retries after ``disk_retry_s``, resumes when
    writes succeed again, and after a crash while writes fail the folder holds only
    whole records, all served byte-exact."""
    folder = tmp_path / "kv"
    proc = _spawn("fsize", folder, write_behind)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the child did not reach its crash (rc {proc.returncode}):\n{err}"
    report = json.loads(out)
    phases = report["phases"]
    assert report["probe"] == [FSIZE_LIMIT, "EFBIG"]  # a short write, then the kernel's error
    stats = {k: v["stats"] for k, v in phases.items()}
    warnings = {k: v["warnings"] for k, v in phases.items()}
    records = {k: sorted(n for n in v["files"] if fmt.parse_record_name(n)) for k, v in phases.items()}

    # Only write_errors depends on timing (a stall past disk_retry_s adds one failed
    # attempt); which blocks are dropped or written, and the warnings, do not.
    errors = [stats[k]["write_errors"] for k in ("room", "full", "retry", "resumed", "crash")]
    assert errors[0] == 0 and 1 <= errors[1] < errors[2] == errors[3] < errors[4], errors
    assert (stats["room"]["disk_writes"], warnings["room"]) == (6, [])
    # full: 8 puts evict 8 blocks, none written; 2 disk hits promoted, evicting 2 more
    full = stats["full"]
    assert (full["dropped"], full["disk_writes"], full["disk_blocks"], full["disk_writable"]) == (10, 6, 6, False)
    assert phases["full"]["dram"] == ["hit_dram+exact"] * 4
    assert phases["full"]["disk"] == ["hit_disk+exact"] * 2
    assert len(warnings["full"]) == 1 and "[Errno 27] File too large" in warnings["full"][0]
    assert records["full"] == records["room"]
    # retry: past disk_retry_s the store tries again and fails again, without a new warning
    assert (stats["retry"]["dropped"], stats["retry"]["disk_writes"], len(warnings["retry"])) == (12, 6, 1)
    # resumed: 2 evicted blocks had records already (promoted), 4 written, no error
    resumed = stats["resumed"]
    assert (resumed["dropped"], resumed["disk_writes"], resumed["disk_writable"]) == (12, 10, True)
    assert len(warnings["resumed"]) == 1
    # a second outage warns again (the writes had recovered in between)
    crash = stats["crash"]
    assert (crash["dropped"], crash["disk_writes"], crash["disk_blocks"], len(warnings["crash"])) == (15, 10, 10, 2)
    assert all(not any(fmt.is_temp_name(n) for n in v["files"]) for v in phases.values())

    # After the crash: exactly the 10 written records, each byte-exact; the rest MISS.
    on_disk = {i for i in range(6)} | {18, 19, 20, 21}
    names = _files(folder)
    assert names == sorted(records["crash"]) and len(names) == 10
    by_index = {b.index: b for b in fsize_blocks()}
    put = {int(i): phase for i, phase in report["put"].items()}
    with BlockStore(writer_config(str(folder), 0)) as store:
        assert (store.stats().corrupt, store.stats().disk_blocks) == (0, 10)
        served = {i for i in sorted(put) if _served(store, by_index[i])}
    assert served == on_disk
    print(
        f"\n{write_behind=}: {len(put)} puts, phases {Counter(put.values())}; "
        f"write_errors {crash['write_errors']}, dropped {crash['dropped']}, records {crash['disk_writes']}, "
        f"warnings {len(warnings['crash'])}; after the crash {len(served)} served exact, "
        f"{len(put) - len(served)} MISS"
    )


# ------------------------------------------------------------- 4. changed behind the store


def _record(block: Block, **change) -> bytes:
    """A valid record of ``block`` with some of its identity changed."""
    payload = change.pop("payload", None)
    fp = change.pop("fp", FP)
    meta = fmt.BlockMeta(
        0,
        block.ref.key,
        fmt.salt_bytes(block.salt),
        block.ref.parent,
        b"".join(int(t).to_bytes(4, "little") for t in block.ref.tokens),
        block.shape,
        block.dtype,
    )
    meta = meta.__class__(**{**{f: getattr(meta, f) for f in meta.__slots__}, **change})
    if payload is None:
        payload = payload_for(b"other/" + block.ref.key, meta.shape, meta.dtype)
    return bytes(fmt.encode_record(meta, memoryview(raw_bytes(payload)), fp))


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


_CHANGES = {
    # name -> what A's record file becomes (A, B: the blocks; b: B's record bytes)
    "other-key": lambda A, B, b: b,  # B's whole record under A's name
    "other-key-and-size": lambda A, B, b: _record(B, shape=(4, 2, 16, 4), dtype="float32"),
    "swapped": lambda A, B, b: "swap",  # A's and B's files trade names
    "other-salt": lambda A, B, b: _record(A, salt=fmt.salt_bytes("tenant-x")),
    "no-salt": lambda A, B, b: _record(A, salt=fmt.salt_bytes(None)),
    "other-tokens": lambda A, B, b: _record(A, tokens=bytes(4 * len(A.ref.tokens))),
    "other-parent": lambda A, B, b: _record(A, parent=B.ref.key),
    "other-fingerprint": lambda A, B, b: _record(A, fp=content_digest(b"another model")),
    "other-layout": lambda A, B, b: _record(A, dtype="float16"),
}
# A record of the *same* identity (key, tokens, parent, salt, fingerprint) with other
# bytes or another layout, put there while the store is closed, is trusted at the next
# open: the store detects damage, not forgery (the folder must be trusted).
_WHILE_CLOSED = [c for c in _CHANGES if c != "other-layout"]


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("change", "when"),
    [(c, "while-open") for c in _CHANGES] + [(c, "while-closed") for c in _WHILE_CLOSED],
)
def test_records_replaced_behind_the_store_are_never_served_as_another_block(tmp_path, caplog, change, when):
    """Someone else replaces a record (with a valid record of another key, salt, tokens,
    parent, fingerprint or layout) or swaps two records.  While the store is open (the
    blocks even pinned by ``match_prefix``) the load answers CORRUPT and deletes the
    file; after a restart the open removes what is inconsistent and the rest answers
    MISMATCH/MISS.  The other block's payload is never served under the wrong name."""
    caplog.set_level(logging.ERROR, logger=STORE_LOGGER)
    folder = tmp_path / "kv"
    A, B, C = sequence(11, 0)[:3]
    cfg = writer_config(str(folder), 0)
    store = BlockStore(cfg)
    filler = sequence(11, 1)  # 6 blocks of 2 KiB: push A, B and C out of the 8 KiB of DRAM
    for blk in (A, B, C, *filler):
        store.put(blk.ref, blk.payload(), salt=blk.salt)
    assert store.stats().dram_blocks and not any(k[1] in (A.ref.key, B.ref.key) for k in store._dram.keys())
    a = folder / fmt.record_name(0, A.ref.key)
    b = folder / fmt.record_name(0, B.ref.key)
    orig_b = b.read_bytes()
    if when == "while-closed":
        store.close()
    else:
        assert store.match_prefix([A.ref, B.ref], salt=A.salt, owner="req") == 2
    plan = _CHANGES[change](A, B, orig_b)
    if plan == "swap":
        _swap(a, b)
    else:
        a.write_bytes(plan)
    if when == "while-closed":
        store = BlockStore(cfg)
    got_a = store.get(A.ref, salt=A.salt)
    got_b = store.get(B.ref, salt=B.salt)
    want_b = HIT_DISK if plan != "swap" else (CORRUPT if when == "while-open" else MISS)
    if when == "while-open":
        assert got_a.status is CORRUPT and not a.exists()
    elif change in ("other-key", "other-key-and-size", "swapped", "other-fingerprint"):
        assert got_a.status is MISS  # removed at open (name/header mismatch, or foreign)
    else:
        assert got_a.status is MISMATCH and a.exists()  # indexed as what it says it is
    assert got_a.payload is None
    assert got_b.status is want_b
    if want_b is HIT_DISK:
        assert raw_bytes(got_b.payload) == raw_bytes(B.payload()) and b.read_bytes() == orig_b
    s = store.stats()
    if when == "while-open":
        assert s.corrupt == 1 + (plan == "swap")
        assert store.match_prefix([A.ref, B.ref], salt=A.salt) == 0
    else:
        assert (s.corrupt, s.foreign) == (
            2 if plan == "swap" else int(change in ("other-key", "other-key-and-size")),
            int(change == "other-fingerprint"),
        )
    # Whatever is left in the folder is consistent: a fresh store serves only exact blocks.
    store.close()
    with BlockStore(cfg) as again:
        for blk in (A, B, C, *filler):
            got = again.get(blk.ref, salt=blk.salt)
            if got.status.hit:
                assert raw_bytes(got.payload) == raw_bytes(blk.payload())
        assert again.stats().corrupt == 0


@pytest.mark.reliability
def test_write_downs_in_flight_finish_at_interpreter_exit(tmp_path, measured):
    """The background writer is a daemon thread: without closing the shared stores at
    exit, the evicted blocks still queued for the disk were dropped.  DRAM's own blocks
    are written down at exit too (since 2026-12-07): the restart serves every block."""
    folder = tmp_path / "store"
    proc = _spawn("exit", folder, 400)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, _stderr(proc)
    seen = json.loads(out.strip().splitlines()[-1])
    evicted = seen["puts"] - seen["dram_blocks"]
    assert seen["disk_writes"] < evicted  # writes were still queued when the child exited
    store = BlockStore(writer_config(str(folder), 0))
    try:
        assert store.stats().disk_blocks == seen["puts"] > evicted
        served = [b for b in _round_blocks(0, seen["puts"]) if _served(store, b)]
        assert len(served) == seen["puts"]
    finally:
        store.close()
    measured.update(puts=seen["puts"], evicted=evicted, pending_at_exit=evicted - seen["disk_writes"], lost=0)
