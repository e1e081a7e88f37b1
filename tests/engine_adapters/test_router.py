"""PrefixRouter / RoundRobinRouter: the ring and bounded loads, then TWO real loopback
``vllm serve`` (default model, block 32; started once per session, shared with
tests/benchmarks/test_routing_bench.py) with a RAG trace through both routers, and the
same trace on a real server and on the embedded engine (equal cached-token counts).
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import pytest

from promptsplice.engine_adapters._router import (
    DEFAULT_KEY_BLOCKS,
    Lease,
    PrefixRouter,
    RoundRobinRouter,
    prefix_route_key,
)
from promptsplice.blocks import chain_hashes, content_digest, root_hash
from promptsplice.errors import ConfigError, InputError

BS = 32
# The first 4 requests of the built-in RAG sample (seed 0) have 2 routing keys.  Checked
# offline over EVERY placement of those keys on two servers (the ring depends on the
# servers' random ports): affinity caches >= 1728 prompt tokens, round robin 960, so
# "affinity strictly wins" holds whatever ports the servers get.
TRACE_REQUESTS = 4
EQUALITY_REQUESTS = 10


def _keys(n: int) -> list[bytes]:
    return [content_digest(f"key-{i}".encode()) for i in range(n)]


# --------------------------------------------------------------------------- the ring


def test_key_is_the_chain_hash_of_the_first_k_blocks(make_assembler):
    asm = make_assembler(block_size=BS)
    docs = [f"Document {i}: the bridge was repainted in year {1900 + i}." for i in range(12)]
    prompt = asm.preview(docs, query="When?", system="Answer from the documents.")
    assert len(prompt.block_hashes) > DEFAULT_KEY_BLOCKS
    key = prefix_route_key(prompt, key_blocks=DEFAULT_KEY_BLOCKS)
    assert key == prompt.block_hashes[DEFAULT_KEY_BLOCKS - 1]
    ids = prompt.token_ids
    assert prefix_route_key(ids, key_blocks=4, block_size=BS) == chain_hashes(ids[: 4 * BS], BS)[-1]
    # same first K blocks, different tail -> same key; a different first block -> another key
    assert prefix_route_key(ids[:200] + [7, 8, 9], key_blocks=4, block_size=BS) == key
    assert prefix_route_key([5] + ids[1:], key_blocks=4, block_size=BS) != key
    # the salt isolates tenants' keys
    salted = asm.preview(docs, query="When?", system="Answer from the documents.", salt="t1")
    assert prefix_route_key(salted) != key
    # text prompts: chained over UTF-8 bytes; short prompts: a digest of all of it
    text = prompt.text
    assert prefix_route_key(text, block_size=BS) == prefix_route_key(text[:600] + "X", block_size=BS)
    assert prefix_route_key("short", block_size=BS) != prefix_route_key("shorter", block_size=BS)
    with pytest.raises(InputError):
        prefix_route_key([])
    with pytest.raises(InputError):
        prefix_route_key([1, -2, 3])
    with pytest.raises(InputError):
        prefix_route_key(b"bytes")
    with pytest.raises(ConfigError):
        prefix_route_key([1], key_blocks=0)


def test_same_key_same_endpoint_and_keys_spread():
    router = PrefixRouter([f"http://s{i}" for i in range(4)])
    keys = _keys(4000)
    owners = [router.owner(k) for k in keys]
    assert owners == [router.owner(k) for k in keys]
    share = Counter(owners)
    assert len(share) == 4
    assert all(700 < c < 1300 for c in share.values()), share  # ~1000 each


def test_adding_or_removing_an_endpoint_moves_about_one_nth_of_keys():
    keys = _keys(6000)
    router = PrefixRouter([f"http://s{i}" for i in range(4)])
    before = {k: router.owner(k) for k in keys}
    router.add_endpoint("http://s4")
    after = {k: router.owner(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "http://s4" for k in moved)  # only to the new endpoint
    assert 0.12 < len(moved) / len(keys) < 0.28  # ~1/5
    router.remove_endpoint("http://s2")
    again = {k: router.owner(k) for k in keys}
    moved = [k for k in keys if after[k] != again[k]]
    assert all(after[k] == "http://s2" for k in moved)  # only s2's keys move
    assert 0.12 < len(moved) / len(keys) < 0.28
    with pytest.raises(ConfigError):
        router.add_endpoint("http://s0")
    with pytest.raises(ConfigError):
        router.remove_endpoint("http://nope")


def test_bounded_loads_cap_every_endpoint_and_overflow_walks_on():
    router = PrefixRouter(["a", "b", "c"], load_factor=1.25)
    hot = _keys(1)[0]
    leases = [router.acquire(key=hot) for _ in range(30)]
    loads = router.loads()
    assert sum(loads.values()) == 30
    assert max(loads.values()) <= -(-1.25 * 30 // 3)  # ceil(1.25 * 30 / 3) = 13
    assert loads[router.owner(hot)] == max(loads.values())  # the owner fills first
    for lease in leases:
        lease.release()
        lease.release()  # idempotent
    assert router.loads() == {"a": 0, "b": 0, "c": 0}
    assert sum(router.requests().values()) == 30
    with router.acquire(key=hot) as lease:
        assert isinstance(lease, Lease) and lease.endpoint == router.owner(hot)
        assert router.loads()[lease.endpoint] == 1
    assert router.loads()[lease.endpoint] == 0


def test_acquire_release_is_thread_safe():
    router = PrefixRouter(["a", "b"], load_factor=1.5)
    keys = _keys(64)
    peak = []

    def work(i: int) -> None:
        for j in range(200):
            with router.acquire(key=keys[(i * 7 + j) % 64]):
                peak.append(max(router.loads().values()))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert router.loads() == {"a": 0, "b": 0}
    assert sum(router.requests().values()) == 1600
    assert max(peak) <= -(-1.5 * 8 // 2)  # never above ceil(1.5 * 8 / 2) = 6 in flight


def test_round_robin_and_bad_options():
    rr = RoundRobinRouter(["a", "b", "c"])
    got = []
    for _ in range(7):
        with rr.acquire([1, 2, 3]) as lease:
            got.append(lease.endpoint)
    assert got == ["a", "b", "c", "a", "b", "c", "a"]
    assert rr.requests() == {"a": 3, "b": 2, "c": 2} and rr.loads() == {"a": 0, "b": 0, "c": 0}
    for bad in ([], "http://one", ["a", "a"], ["a", ""]):
        with pytest.raises(ConfigError):
            PrefixRouter(bad)
    for kwargs in ({"load_factor": 1.0}, {"load_factor": True}, {"key_blocks": 0}, {"vnodes": 0}, {"block_size": 0}):
        with pytest.raises(ConfigError):
            PrefixRouter(["a"], **kwargs)
    with pytest.raises(InputError):
        PrefixRouter(["a"]).acquire()
    with pytest.raises(ConfigError):
        PrefixRouter(["a"]).remove_endpoint("a")


# --------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def remotes(two_servers):
    from promptsplice.engine_adapters import RemoteEngine

    engines = {s.base_url: RemoteEngine(s.base_url) for s in two_servers}
    yield engines
    for eng in engines.values():
        eng.close()


@pytest.fixture(scope="module")
def trace(default_tok):
    from promptsplice.benchmarks.routing import assemble_trace

    return assemble_trace(TRACE_REQUESTS, tokenizer=default_tok)


def test_affinity_beats_round_robin_on_two_real_servers(remotes, trace):
    from promptsplice.benchmarks.routing import route_trace

    urls = list(remotes)
    run = uuid.uuid4().hex[:8]
    reports = {}
    for name, router in (
        ("affinity", PrefixRouter(urls, block_size=BS)),
        ("round_robin", RoundRobinRouter(urls)),
    ):
        reports[name] = route_trace(router, remotes, trace, salt=f"t-{name}-{run}")
    for name, rep in reports.items():
        # every request got exactly one response
        assert sorted(r.index for r in rep["results"]) == list(range(TRACE_REQUESTS)), name
        assert rep["requests"] == TRACE_REQUESTS
        assert rep["prompt_tokens"] == sum(p.num_tokens for p in trace)
        assert sum(rep["per_endpoint_requests"].values()) == TRACE_REQUESTS
        # the servers' own /metrics agree with the per-response usage
        assert rep["metrics_cached_tokens"] == rep["cached_tokens"], name
        assert all(r.cached_tokens % BS == 0 for r in rep["results"])
    aff, rr = reports["affinity"], reports["round_robin"]
    assert rr["per_endpoint_requests"] == {u: TRACE_REQUESTS // 2 for u in urls}
    assert aff["hit_rate"] >= rr["hit_rate"], (aff["hit_rate"], rr["hit_rate"])
    assert aff["cached_tokens"] > rr["cached_tokens"]  # on this trace affinity strictly wins
    print(f"\ncluster hit rate: affinity {aff['hit_rate']:.3f} {aff['per_endpoint_requests']}, "
          f"round robin {rr['hit_rate']:.3f}")


def test_remote_and_embedded_engines_cache_the_same_tokens(remotes, fresh_engine, default_tok):
    """Same prompts, same block size, both from an empty cache (a fresh salt on the
    server, a reset embedded engine): per-request cached tokens must be equal."""
    from promptsplice.benchmarks.routing import assemble_trace

    prompts = assemble_trace(EQUALITY_REQUESTS, seed=1, tokenizer=default_tok)
    total_blocks = sum(len(p.token_ids) // BS + 1 for p in prompts)
    assert total_blocks < fresh_engine.usable_blocks  # nothing can be evicted
    assert fresh_engine.block_size == BS
    remote = next(iter(remotes.values()))
    salt = f"eq-{uuid.uuid4().hex[:8]}"
    remote_cached = [
        remote.complete(list(p.token_ids), max_tokens=2, cache_salt=salt).cached_tokens for p in prompts
    ]
    embedded_cached = [
        fresh_engine.generate(list(p.token_ids), max_tokens=2, cache_salt=salt).num_cached_tokens
        for p in prompts
    ]
    assert sum(remote_cached) > 0  # the trace really repeats prefixes
    assert remote_cached == embedded_cached


def test_bad_prompts_and_options_are_refused_before_routing():
    from promptsplice.errors import InvalidSaltError

    router = PrefixRouter(["a", "b"], block_size=16)
    for bad in ([], [1, -1], [1, True], [1, 2.0], b"ids", {"ids": [1]}, ""):
        with pytest.raises(InputError):
            router.acquire(bad)
    assert router.requests() == {"a": 0, "b": 0}  # nothing was routed
    with pytest.raises(InputError, match=r"prompt\[1\] is not a token id"):
        prefix_route_key([1, -1])
    for bad in (10**9, True, 1.5):
        with pytest.raises(ConfigError, match="block_size"):
            PrefixRouter(["a"], block_size=bad)
    with pytest.raises(ConfigError, match="load_factor"):
        PrefixRouter(["a"], load_factor=float("inf"))
    with pytest.raises(InvalidSaltError):
        router.acquire([1, 2, 3], salt="")


def test_a_lease_from_before_an_endpoint_was_removed_gives_nothing_back_to_it():
    """Remove and re-add an endpoint (a health check that flapped): the old leases'
    releases lowered the new endpoint's count, so it took more than its bounded load."""
    r = PrefixRouter(["a", "b", "c"], block_size=16)
    old = [r.acquire([i] * 16, salt="t") for i in range(30)]
    held_on = {lease.endpoint for lease in old}
    gone = sorted(held_on)[0]
    r.remove_endpoint(gone)
    r.add_endpoint(gone)
    new = [lease for lease in (r.acquire([100 + i] * 16, salt="t") for i in range(30)) if lease.endpoint == gone]
    for lease in old:
        lease.release()
    assert r.loads()[gone] == len(new)  # only the leases taken since it came back


def test_keys_of_ids_beyond_32_bits_or_text_that_is_not_unicode_are_input_errors():
    from promptsplice.errors import InvalidSaltError, InvalidUTF8Error

    r = PrefixRouter(["a", "b"], block_size=16)
    for prompt in ([2**32], [1] * 16 + [2**40]):
        with pytest.raises(InputError, match="2\\*\\*32 - 1"):
            r.acquire(prompt)
    with pytest.raises(InvalidUTF8Error, match="lone surrogate"):
        r.acquire("abc\ud800def")
    with pytest.raises(InvalidSaltError, match="lone surrogate"):
        r.acquire([1, 2, 3], salt="t\ud800")


def test_both_routers_check_what_acquire_is_given():
    """``PrefixRouter(None)`` raised a raw TypeError; ``RoundRobinRouter.acquire`` took a
    str key and an empty salt that ``PrefixRouter.acquire`` refuses (same interface)."""
    from promptsplice.errors import InvalidSaltError

    for cls in (PrefixRouter, RoundRobinRouter):
        for endpoints in (None, 5):
            with pytest.raises(ConfigError, match="endpoints must be a list"):
                cls(endpoints)  # type: ignore[arg-type]
        router = cls(["a", "b"])
        with pytest.raises(InputError, match="key must be non-empty bytes"):
            router.acquire(key="abc")  # type: ignore[arg-type]
        with pytest.raises(InputError, match="needs a prompt or a key"):
            router.acquire()
        with pytest.raises(InvalidSaltError):
            router.acquire("some prompt text", salt="")
        with router.acquire("some prompt text", salt="t") as lease:
            assert lease.endpoint in ("a", "b")
        for prompt in (b"x", 5, [1, -2]):  # RoundRobinRouter took these
            with pytest.raises(InputError):
                router.acquire(prompt)
    with pytest.raises(InputError, match="key must be non-empty bytes"):
        PrefixRouter(["a", "b"]).owner("abc")  # type: ignore[arg-type]  # a TypeError


def test_explicit_keys_spread_whatever_their_first_bytes():
    """A session id or tenant name passed as ``key=`` was placed by its first 8 bytes:
    every "session-..." key went to one endpoint."""
    router = PrefixRouter([f"http://s{i}" for i in range(4)])
    owners = Counter(router.owner(f"session-{i}".encode()) for i in range(400))
    assert len(owners) == 4 and min(owners.values()) > 40
    # a prompt and its key, passed back explicitly, route alike
    ids = list(range(200))
    assert router.owner(router.key(ids, salt="t")) == router.acquire(ids, salt="t").endpoint


def test_one_server_under_two_spellings_is_refused_and_removed_by_either():
    for endpoints in (["http://gpu-a:8000", "http://gpu-a:8000/"], ["http://gpu-a:8000", "HTTP://GPU-A:8000"]):
        with pytest.raises(ConfigError, match="name the same one"):
            PrefixRouter(endpoints)
    with pytest.raises(ConfigError, match="surrounding whitespace"):
        PrefixRouter(["http://gpu-a:8000", " http://gpu-b:8000"])
    router = PrefixRouter(["http://gpu-a:8000", "http://gpu-b:8000"])
    with pytest.raises(ConfigError, match=r"already routed to \(as 'http://gpu-a:8000'\)"):
        router.add_endpoint("http://GPU-A:8000/")
    router.remove_endpoint("http://gpu-b:8000/")
    assert router.endpoints == ["http://gpu-a:8000"]
    assert {router.owner(k) for k in _keys(50)} == {"http://gpu-a:8000"}
    assert PrefixRouter(["a", "A"]).endpoints == ["a", "A"]  # names that are not URLs: as given
    # two spellings of one server place it at the same points: a router (or a process)
    # that spells it otherwise routes every key alike (a third of them moved)
    one = PrefixRouter(["http://gpu-a:8000/", "http://gpu-b:8000"])
    other = PrefixRouter(["HTTP://gpu-a:8000", "http://gpu-b:8000/"])
    same = {"http://gpu-a:8000/": "a", "HTTP://gpu-a:8000": "a", "http://gpu-b:8000": "b", "http://gpu-b:8000/": "b"}
    assert [same[one.owner(k)] for k in _keys(300)] == [same[other.owner(k)] for k in _keys(300)]


def test_an_added_endpoint_gives_the_ring_of_a_router_built_with_it():
    grown = PrefixRouter(["a", "b"], vnodes=64)
    grown.add_endpoint("c")
    built = PrefixRouter(["a", "b", "c"], vnodes=64)
    assert [grown.owner(k) for k in _keys(300)] == [built.owner(k) for k in _keys(300)]
    with pytest.raises(ConfigError, match=r"vnodes must be an int >= 1 and <= 4096"):
        PrefixRouter(["a"], vnodes=50_000)


def test_an_assembled_prompt_of_another_block_size_is_refused(make_assembler):
    prompt = make_assembler(block_size=BS).preview(["Doc one.", "Doc two."], query="Q?", system="S.")
    with pytest.raises(ConfigError, match=r"block_size=32, this router block_size=16: give PrefixRouter\(block_size=32\)"):
        PrefixRouter(["a", "b"]).acquire(prompt)
    router = PrefixRouter(["a", "b"], block_size=BS)
    assert router.key(prompt) == router.key(list(prompt.token_ids), salt=prompt.salt)


@pytest.mark.reliability
def test_a_naive_prompt_routes_as_its_token_ids(make_assembler):
    """``Assembler.naive()``'s prompt has ``token_ids`` and an empty ``block_hashes`` but
    no salt: it was taken for an assembled prompt and raised a raw AttributeError on
    both routers (``RemoteEngine`` sends it as its ids)."""
    naive = make_assembler(block_size=16).naive(["doc one " * 20, "doc two " * 20], query="Q?", system="S.")
    ids = list(naive.token_ids)
    assert len(ids) > DEFAULT_KEY_BLOCKS * 16
    assert prefix_route_key(naive) == prefix_route_key(ids) == bytes(chain_hashes(ids[: DEFAULT_KEY_BLOCKS * 16], 16)[-1])
    router = PrefixRouter(["a", "b"])
    assert router.key(naive, salt="t") == router.key(ids, salt="t") != prefix_route_key(ids)
    with router.acquire(naive, salt="t") as lease:
        assert lease.endpoint == router.owner(router.key(ids, salt="t"))
    with RoundRobinRouter(["a", "b"]).acquire(naive) as lease:
        assert lease.endpoint == "a"


def test_every_id_is_checked_and_a_refused_request_is_no_tenant():
    """Ids were checked in the routing key's span only (64 on PrefixRouter, 16 on
    RoundRobinRouter): a prompt the engine refuses was routed and counted; and the salt
    rule saw a request before its prompt was refused (its warning used up)."""
    import warnings

    from promptsplice.errors import MissingSaltError, UnsaltedTenantWarning

    for router in (PrefixRouter(["a", "b"]), RoundRobinRouter(["a", "b"])):
        for bad, where in (([1] * 20 + [-1], 20), ([1] * 64 + [2**40], 64)):
            with pytest.raises(InputError, match=rf"prompt\[{where}\] is not a token id"):
                router.acquire(bad)
        assert router.requests() == {"a": 0, "b": 0}
    guarded = PrefixRouter(["a", "b"])
    guarded.acquire("tenant text", salt="t1").release()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsaltedTenantWarning)
        with pytest.raises(InputError, match="cannot route a bytes"):
            guarded.acquire(b"bytes")  # refused: no warning, none used up
    with pytest.warns(UnsaltedTenantWarning):
        guarded.acquire("unsalted text").release()
    with pytest.raises(InputError, match="cannot route a bytes"):
        PrefixRouter(["a"], require_salt=True).acquire(b"bytes")  # the prompt's error, not the salt's
    with pytest.raises(MissingSaltError):
        PrefixRouter(["a"], require_salt=True).acquire("text")


def test_an_explicit_key_is_the_tenants_and_takes_no_prompt():
    """``acquire(key=...)`` dropped ``salt`` and ``prompt`` unread: an empty salt every
    other door refuses was taken, a require_salt router routed an unsalted key, one
    session id of two tenants was one key, and a prompt beside the key was ignored."""
    import warnings

    from promptsplice.errors import InvalidSaltError, MissingSaltError, UnsaltedTenantWarning

    key = b"session-7"
    for cls in (PrefixRouter, RoundRobinRouter):
        router = cls(["a", "b"])
        with pytest.raises(InvalidSaltError):
            router.acquire(key=key, salt="")
        with pytest.raises(InputError, match="both a prompt and a key"):
            router.acquire([1, 2, 3], key=key)
        assert router.acquire(key=key, salt="t1").key == content_digest(root_hash("t1") + key)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert router.acquire(key=key).key == key  # (a salted and an unsalted request: warned once, here)
        if cls is PrefixRouter:  # (RoundRobinRouter keeps no salt rule)
            assert [(w.category, w.filename) for w in seen] == [(UnsaltedTenantWarning, __file__)]
    with pytest.raises(MissingSaltError):
        PrefixRouter(["a", "b"], require_salt=True).acquire(key=key)
    router = PrefixRouter(["a", "b"], require_salt=True)
    tenants = {router.owner(key, salt=f"tenant-{i}") for i in range(16)}
    assert tenants == {"a", "b"}  # one session id of 16 tenants: spread, not one server
    for i in range(16):  # owner(key, salt=) names where acquire(key=, salt=) routes
        with router.acquire(key=key, salt=f"tenant-{i}") as lease:
            assert lease.endpoint == router.owner(key, salt=f"tenant-{i}") == router.owner(lease.key)


def test_a_servers_root_and_its_v1_are_one_server():
    """``RemoteEngine`` reads ``http://h:8000`` and ``http://h:8000/v1`` as one server;
    the router took them for two (two ring shares, two load counts)."""
    with pytest.raises(ConfigError, match="name the same one"):
        PrefixRouter(["http://h:8000", "http://h:8000/v1/"])
    router = PrefixRouter(["http://h:8000/v1", "http://g:8000"])
    router.remove_endpoint("http://h:8000")
    assert router.endpoints == ["http://g:8000"]


def test_an_unsalted_assembled_prompt_routes_under_the_requests_salt(default_tok):
    """Both engines send an unsalted assembled prompt with ``cache_salt=`` under that
    salt; the router refused the pair (InvalidSaltError), so under ``require_salt`` it
    could not route the prompt at all.  It now keys the prompt's ids under the salt, the
    same key as the ids themselves."""
    from promptsplice.assembler import Assembler
    from promptsplice.engine_adapters import PrefixRouter
    from promptsplice.errors import MissingSaltError

    p = Assembler(default_tok, block_size=16).assemble(
        system="You are a helpful assistant. " * 10, chunks=["chunk one " * 20], query="q?")
    assert p.salt is None
    r = PrefixRouter([f"http://h{i}" for i in range(8)], block_size=16, require_salt=True)
    assert r.key(p, salt="tenantA") == r.key(list(p.token_ids), salt="tenantA") != r.key(p, salt="tenantB")
    with r.acquire(p, salt="tenantA") as lease:
        assert lease.endpoint == r.owner(r.key(list(p.token_ids), salt="tenantA"))
    with pytest.raises(MissingSaltError):
        r.acquire(p)
