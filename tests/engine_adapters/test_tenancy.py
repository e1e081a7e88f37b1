"""Tenant isolation by ``cache_salt``, measured over a mixed trace on the real engine.

Every tenant sends the *same* RAG requests, interleaved (the worst case: any leak would
hit).  A request may only hit what its own tenant's earlier requests put in a cache:
the longest block-aligned prefix it shares with one of them (capped, as vLLM caps it,
below the prompt's last token).  ``cross_tenant`` counts hits above that bound, in
vLLM's prefix cache (APC), the prefix-cache mirror, the tiered block store and the
router's keys.  The unsalted control runs the same measure and must find leaks, so the
measure is shown to catch them.
"""

from __future__ import annotations

import warnings

import pytest

from promptsplice.engine_adapters import PrefixRouter, RemoteEngine, chain_refs
from promptsplice.blocks import round_down
from promptsplice.errors import EngineUnavailableError, MissingSaltError, UnsaltedTenantWarning
from promptsplice.tenancy import SaltGuard
from tests.engine_adapters.test_embedded import chunk_dicts

TENANTS = ("tenant-a", "tenant-b", "tenant-c")


def mixed_trace(rag_requests, tenants, per_tenant):
    """Round-robin over tenants: request 0 of every tenant, then request 1, ..."""
    return [(t, req) for req in rag_requests[:per_tenant] for t in tenants]


def own_bound(earlier: list[list[int]], ids: list[int], bs: int) -> int:
    """Most tokens ``ids`` can hit from its own tenant's ``earlier`` prompts."""
    best = 0
    for prev in earlier:
        n = 0
        for a, b in zip(prev, ids):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return round_down(min(best, len(ids) - 1), bs)


class Ledger:
    """Per-tenant history and the hits measured above each request's own bound."""

    def __init__(self, bs: int) -> None:
        self.bs = bs
        self.seen: dict[object, list[list[int]]] = {}
        self.hits = 0
        self.cross = {"apc": 0, "mirror": 0, "store": 0}
        self.requests = 0

    def record(self, tenant, ids, **hits: int) -> None:
        bound = own_bound(self.seen.get(tenant, []), ids, self.bs)
        for where, n in hits.items():
            self.cross[where] += max(0, n - bound)
        self.hits += max(hits.values())
        self.seen.setdefault(tenant, []).append(list(ids))
        self.requests += 1


def run_apc(eng, trace, salt_of):
    asm = eng.make_assembler()
    led = Ledger(eng.block_size)
    for tenant, req in trace:
        prompt = asm.assemble(chunk_dicts(req), query=req.query, system=req.system, salt=salt_of(tenant))
        predicted = asm.mirror.predict(prompt.block_hashes, len(prompt.token_ids)).cached_tokens
        done = eng.generate(prompt, max_tokens=1)
        assert done.num_cached_tokens == predicted  # the mirror models the engine exactly
        led.record(tenant, prompt.token_ids, apc=done.num_cached_tokens, mirror=predicted)
    return led


@pytest.mark.reliability
def test_salts_isolate_tenants_in_vllms_cache_and_the_mirror(fresh_engine, rag_requests, measured):
    led = run_apc(fresh_engine, mixed_trace(rag_requests, TENANTS, 6), salt_of=lambda t: t)
    assert led.requests == 18
    assert led.cross == {"apc": 0, "mirror": 0, "store": 0}
    assert led.hits > 0  # tenants do hit their own earlier requests

    # Control: the same tenants without salts leak (so the measure can see a leak).
    fresh_engine.reset_prefix_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsaltedTenantWarning)
        control = run_apc(fresh_engine, mixed_trace(rag_requests[6:], TENANTS[:2], 3), salt_of=lambda t: None)
    assert control.cross["apc"] > 0 and control.cross["mirror"] == control.cross["apc"]
    measured.update(requests=led.requests, own_hit_tokens=led.hits, cross_tenant_tokens=led.cross,
                    control_requests=control.requests, control_cross_tenant_tokens=control.cross["apc"])


@pytest.mark.reliability
def test_salts_isolate_tenants_in_the_tiered_store(kv_engine, rag_requests, measured):
    eng = kv_engine
    store = eng.kv_store
    asm = eng.make_assembler()
    salt_of = {t: f"tenancy-store-{t}" for t in TENANTS}
    trace = mixed_trace(rag_requests[10:], TENANTS, 4)
    led = Ledger(eng.block_size)
    ext0 = eng.counters()
    for tenant, req in trace:
        prompt = asm.preview(chunk_dicts(req), query=req.query, system=req.system, salt=salt_of[tenant])
        ids = list(prompt.token_ids)
        eng.reset_prefix_cache()  # every hit below must come from the store
        in_store = store.match_prefix(chain_refs(ids, eng.block_size, salt=salt_of[tenant]), salt=salt_of[tenant])
        done = eng.generate(ids, max_tokens=1, cache_salt=salt_of[tenant])
        store.drain()
        led.record(tenant, ids, store=min(in_store * eng.block_size, len(ids) - 1), apc=done.num_cached_tokens)
    assert led.requests == 12
    assert led.cross == {"apc": 0, "mirror": 0, "store": 0}
    store_hits = eng.counters().since(ext0).external_hits
    assert led.hits > 0 and store_hits > 0  # served by the store
    measured.update(requests=led.requests, store_hit_tokens=store_hits, cross_tenant_tokens=led.cross)

    # Every stored prompt, asked for under every other tenant's salt: nothing.
    for tenant, prompts in led.seen.items():
        for other in TENANTS:
            if other == tenant:
                continue
            for ids in prompts:
                refs = chain_refs(ids, eng.block_size, salt=salt_of[other])
                got = store.match_prefix(refs, salt=salt_of[other]) * eng.block_size
                assert got <= own_bound(led.seen[other], ids + [0], eng.block_size)


@pytest.mark.reliability
def test_salts_give_tenants_disjoint_router_keys(rag_requests, make_assembler, measured):
    asm = make_assembler(block_size=32)
    keys: dict[str | None, set[bytes]] = {}
    router = PrefixRouter(["http://a", "http://b"], block_size=32)
    for tenant, req in mixed_trace(rag_requests, TENANTS, 20):
        prompt = asm.assemble(chunk_dicts(req), query=req.query, system=req.system, salt=tenant)
        keys.setdefault(tenant, set()).add(router.key(prompt))
    a, b, c = (keys[t] for t in TENANTS)
    assert len(a) > 1 and not (a & b) and not (a & c) and not (b & c)
    # Control: without salts the tenants' prompts get the same keys (a shared route).
    bare = {tenant: {router.key(list(p.token_ids)) for p in prompts} for tenant, prompts in _prompts(asm, rag_requests).items()}
    assert bare["tenant-a"] == bare["tenant-b"]
    measured.update(requests=60, keys_per_tenant=len(a), shared_keys=0, control_shared_keys=len(bare["tenant-a"]))


def _prompts(asm, rag_requests):
    out: dict[str, list] = {}
    for tenant, req in mixed_trace(rag_requests, TENANTS[:2], 20):
        out.setdefault(tenant, []).append(asm.assemble(chunk_dicts(req), query=req.query, system=req.system))
    return out


# -- unsalted multi-tenant use warns ------------------------------------------------


@pytest.mark.reliability
def test_salt_guard_warns_once_on_a_mix_and_refuses_when_required():
    guard = SaltGuard("X")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.check(None)
        guard.check(None)
    with pytest.warns(UnsaltedTenantWarning):
        guard.check("t1")  # the first salted request after unsalted ones
    with pytest.warns(UnsaltedTenantWarning, match="require_salt=True"):
        g = SaltGuard("Y")
        g.check("t1")
        g.check(None)
    assert g.mixed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.check(None)  # once only
        g.check("t2")
    with pytest.raises(MissingSaltError, match="cache_salt"):
        SaltGuard("Z", require=True).check(None)
    SaltGuard("Z", require=True).check("t1")


@pytest.mark.reliability
def test_engine_router_and_remote_warn_on_unsalted_multi_tenant_use(engine, monkeypatch):
    monkeypatch.setattr(engine, "_salts", SaltGuard("EmbeddedEngine"))  # the session engine saw mixes already
    engine.generate([5, 6, 7], max_tokens=1, cache_salt="tenant-w")
    with pytest.warns(UnsaltedTenantWarning, match="EmbeddedEngine"):
        engine.generate([5, 6, 7], max_tokens=1)
    monkeypatch.setattr(engine, "_salts", SaltGuard("EmbeddedEngine", require=True))
    with pytest.raises(MissingSaltError):
        engine.generate([5, 6, 7], max_tokens=1)

    router = PrefixRouter(["http://a", "http://b"], block_size=32)
    router.key(list(range(100)), salt="t")
    with pytest.warns(UnsaltedTenantWarning, match="PrefixRouter"):
        router.key(list(range(100)))
    with pytest.raises(MissingSaltError, match=r"pass salt=<"):  # acquire's own keyword, not cache_salt
        PrefixRouter(["http://a"], block_size=32, require_salt=True).acquire(list(range(100)))

    # RemoteEngine checks before it sends anything: a closed port is never reached.
    remote = RemoteEngine("http://127.0.0.1:9", require_salt=True, model="m")
    with pytest.raises(MissingSaltError):
        remote.complete([1, 2, 3], max_tokens=1)
    remote = RemoteEngine("http://127.0.0.1:9", model="m", max_retries=0)
    with pytest.raises(EngineUnavailableError):
        remote.complete([1, 2, 3], max_tokens=1, cache_salt="t")
    with pytest.warns(UnsaltedTenantWarning, match="RemoteEngine"), pytest.raises(EngineUnavailableError):
        remote.complete([1, 2, 3], max_tokens=1)


def test_require_salt_is_validated():
    from promptsplice.engine_adapters import EngineConfig
    from promptsplice.errors import ConfigError

    with pytest.raises(ConfigError, match="require_salt"):
        EngineConfig(require_salt="yes")
    with pytest.raises(ConfigError, match="max_restarts"):
        EngineConfig(max_restarts=-1)
    with pytest.raises(ConfigError, match="require_salt"):
        PrefixRouter(["http://a"], require_salt=1)


# -- the one salt rule, at every door ------------------------------------------------

BAD_SALTS = ["", b"x", 5]
GOOD_SALTS = [None, "t"]


def salt_doors(engine, default_tok):
    """Every public door that takes a salt, as ``salt -> None`` (raises if refused).

    The remote doors talk to a closed port with no retries: a salt that passes the rule
    goes on to the connection and meets :class:`EngineUnavailableError`, which the door
    catches (the rule is checked before anything is sent)."""
    import dataclasses

    from promptsplice import assemble_prompt
    from promptsplice.assembler import Assembler, ContextHook
    from promptsplice.engine_adapters import AgentRunner, RagRunner, prefix_route_key

    asm = Assembler(default_tok, block_size=32)
    base = asm.preview(["a salted document"], query="q?")
    hook = ContextHook(asm)
    msgs = [{"role": "user", "content": "hello"}]
    remote = RemoteEngine("http://127.0.0.1:9", model="m", max_retries=0)

    def carried(salt):  # an assembled prompt that carries the salt (built by hand)
        return dataclasses.replace(base, salt=salt)

    def remote_call(fn):
        try:
            fn()
        except EngineUnavailableError:
            pass

    def generate(**kw):
        engine.generate(max_tokens=1, **kw)

    return {
        "assemble_prompt": lambda s: assemble_prompt(["doc"], query="q", tokenizer=default_tok, salt=s),
        "Assembler.assemble": lambda s: asm.preview(["doc"], query="q", salt=s),
        "ContextHook()": lambda s: ContextHook(asm, salt=s),
        "ContextHook call": lambda s: hook("session", msgs, salt=s),
        "RagRunner": lambda s: RagRunner(engine, salt=s),
        "AgentRunner": lambda s: AgentRunner(engine, mode="apc", salt=s),
        "generate(cache_salt=)": lambda s: generate(prompt=[5, 6, 7], cache_salt=s),
        "generate(prompt.salt)": lambda s: generate(prompt=carried(s)),
        "RemoteEngine cache_salt": lambda s: remote_call(lambda: remote.complete([1, 2], max_tokens=1, cache_salt=s)),
        "RemoteEngine prompt.salt": lambda s: remote_call(lambda: remote.complete(carried(s), max_tokens=1)),
        "RemoteEngine chat": lambda s: remote_call(lambda: remote.chat(msgs, max_tokens=1, cache_salt=s)),
        "prefix_route_key": lambda s: prefix_route_key([1, 2, 3], block_size=32, salt=s),
        "PrefixRouter.acquire": lambda s: PrefixRouter(["a", "b"], block_size=32).acquire([1, 2, 3], salt=s).release(),
        "PrefixRouter prompt.salt": lambda s: PrefixRouter(["a", "b"], block_size=32).key(carried(s)),
        "SaltGuard": lambda s: SaltGuard("X").check(s),
    }


@pytest.mark.reliability
def test_every_door_holds_the_one_salt_rule(engine, default_tok):
    """A salt is a non-empty str or None, at every door: ``""`` (which vLLM treats as no
    salt: a cross-tenant leak), bytes and ints are :class:`InvalidSaltError`, with the
    same message wherever they are passed."""
    from promptsplice.errors import ConfigError, InvalidSaltError

    doors = salt_doors(engine, default_tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsaltedTenantWarning)
        for name, door in doors.items():
            for bad in BAD_SALTS:
                with pytest.raises(InvalidSaltError, match="non-empty str|empty str") as info:
                    door(bad)
                assert isinstance(info.value, ConfigError), name  # one class, a ConfigError everywhere
            for good in GOOD_SALTS:
                door(good)  # accepted (remote doors: refused connection, after the check)
    assert len(doors) == 15


@pytest.mark.reliability
def test_an_empty_salt_never_reaches_vllm(engine, default_tok):
    """The leak the rule closes: an assembled prompt carrying ``salt=""`` would be sent
    as vLLM's "no salt" and hit every unsalted tenant's blocks."""
    import dataclasses

    from promptsplice.errors import InvalidSaltError

    prompt = engine.make_assembler().preview(["victim text " * 40], query="q?")
    with pytest.raises(InvalidSaltError):
        engine.generate(dataclasses.replace(prompt, salt=""), max_tokens=1)


@pytest.mark.reliability
def test_router_refuses_a_salt_that_contradicts_the_prompts(default_tok):
    from promptsplice.assembler import Assembler
    from promptsplice.errors import InvalidSaltError

    prompt = Assembler(default_tok, block_size=32).preview(["doc"], query="q", salt="a")
    router = PrefixRouter(["x", "y"], block_size=32)
    assert router.key(prompt, salt="a") == router.key(prompt)
    with pytest.raises(InvalidSaltError, match="differs"):
        router.key(prompt, salt="b")


def test_require_salt_refuses_the_unsalted_tenants_derived_salts():
    """``"\\x1fexact"`` (an unsalted runner's exact salt) was accepted under require_salt:
    every unsalted runner shared it.  A salt derived from no tenant's is unsalted."""
    from promptsplice.errors import MissingSaltError
    from promptsplice.tenancy import SaltGuard

    guard = SaltGuard("EmbeddedEngine", require=True)
    for s in ("\x1fexact", "\x1fpic:bounded:r2:d0.25", None):
        with pytest.raises(MissingSaltError, match="require_salt=True"):
            guard.check(s)
    guard.check("t\x1fexact")  # a tenant's derived salt is salted
    mixed = SaltGuard("EmbeddedEngine")
    mixed.check("\x1fexact")
    assert not mixed.mixed
    with pytest.warns(UnsaltedTenantWarning):
        mixed.check("t")
    assert mixed.mixed


def test_salt_tenant_refuses_an_empty_salt():
    """``salt_tenant("")`` was ``None`` (the unsalted tenant's), so a tenant check let ""
    pass as None, and "" then failed where it was hashed."""
    from promptsplice._validate import salt_tenant
    from promptsplice.errors import InvalidSaltError

    assert salt_tenant(None) is None and salt_tenant("\x1fexact") is None and salt_tenant("t\x1fx") == "t"
    with pytest.raises(InvalidSaltError, match="empty str"):
        salt_tenant("")


@pytest.mark.reliability
def test_an_engine_started_with_require_salt_refuses_unsalted_requests_before_vllm_sees_them():
    """``EngineConfig(require_salt=True)`` reaches the engine's guard (the test above swaps
    the guard in): every entry point refuses a request without a tenant's salt, or with
    only a salt derived from none, before it is sent (vLLM's counters do not move), and
    serves salted ones."""
    from tests.conftest import start_default_engine

    eng = start_default_engine(require_salt=True, kv_cache_bytes=64 << 20, max_model_len=1024)
    try:
        assert eng.config.require_salt is True
        prompt = list(range(100, 170))
        before = eng.counters().prefix_cache_queries
        for call in (lambda: eng.generate(prompt, max_tokens=1),
                     lambda: eng.generate(prompt, max_tokens=1, cache_salt="\x1fexact"),  # an unsalted runner's
                     lambda: eng.generate_many([prompt], max_tokens=1),
                     lambda: list(eng.stream(prompt, max_tokens=1)),
                     lambda: eng.generate(eng.make_assembler().assemble(["a chunk"], query="q"), max_tokens=1)):
            with pytest.raises(MissingSaltError, match="require_salt=True.*pass cache_salt=<the tenant's salt>"):
                call()
        assert eng.counters().prefix_cache_queries == before  # nothing reached vLLM
        done = eng.generate(prompt, max_tokens=1, cache_salt="tenant-r")
        salted = eng.make_assembler().assemble(["a chunk"], query="q", salt="tenant-r")
        assert done.prompt_tokens == 70 and eng.generate(salted, max_tokens=1).prompt_tokens == salted.num_tokens
        assert eng.counters().prefix_cache_queries == before + 70 + salted.num_tokens
    finally:
        eng.close()
