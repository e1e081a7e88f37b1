"""Prefix-affinity routing across engines: the same prefix goes to the same server.

A prefix cache lives in one server: a request only hits the blocks *that* server
computed.  Round-robin spreads requests sharing a prefix over every server, so each
server computes that prefix once per server; :class:`PrefixRouter` sends them to one.

The routing key is the chain hash (:mod:`promptsplice.blocks`, the one hashing module)
of the first ``key_blocks`` whole blocks of the prompt: for an assembled prompt the
hash the assembler already computed (``AssembledPrompt.block_hashes[K-1]``, salt
included, so tenants are routed apart); for token ids the same chain over the ids; for
text, the chain over its UTF-8 bytes in blocks of ``4 * block_size`` bytes (about a
block of tokens' worth each).  A prompt shorter than one block is keyed by the content digest of
all of it.  Because a chain hash names the whole prefix, two prompts share a key exactly
when their first K blocks are identical, i.e. when the server's cache could serve those
blocks to both.  K trades affinity for spread: too small and every request with the same
system prompt lands on one server, too large and requests sharing their first chunks
are scattered.  The default, 4 blocks, covers the system prompt and the start of the
first chunk of a stable-ordered RAG prompt (the most popular chunks come first); on the
built-in RAG sample at block 32 it kept 99% of a single server's hit rate over two
servers, round-robin 80%.

Placement is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads", SODA 2018): each endpoint owns ``vnodes``
points on a 64-bit ring; a key goes to the first point clockwise whose endpoint has
fewer than ``ceil(load_factor * (in_flight + 1) / n)`` requests in flight, so no server
takes more than ``load_factor`` times its share and overflow walks on clockwise.  Adding
or removing an endpoint moves only about ``1/n`` of the keys (tested).  In-flight load is
counted by :meth:`PrefixRouter.acquire`, a context manager that releases on exit
(thread-safe).  :class:`RoundRobinRouter` has the same interface, for the baseline.

The same key drives the prefix-aware routers of existing stacks, which all hash (or
tree-index) prompt prefixes themselves:

* vLLM production-stack router (``--routing-logic prefixaware``) and llm-d's inference
  scheduler (prefix-cache scorer) hash prompt prefixes in chunks and send a request to
  the replica that saw the longest matching prefix; SGLang's router (cache-aware policy)
  keeps an approximate radix tree of each worker's prompts, with load thresholds.  They
  work on text or tokens they see; promptsplice makes the prefix *stable* (dedup +
  canonical order), which is what lets any of them match.  Where a stack routes by a
  header or session key instead, send ``PrefixRouter.key(prompt).hex()`` as that key
  (the assembled prompt's ``prefix_key`` names its system prompt and tools only: one
  worker for all of a tenant's traffic).
* OpenAI routes by a hash of the prompt's first tokens combined with
  ``prompt_cache_key``: send ``AssembledPrompt.prefix_key`` (``RemoteEngine`` does) so
  requests with one stable prefix share a cache machine.
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from promptsplice.blocks import chain_hashes, content_digest, root_hash, token_bytes
from promptsplice._validate import MAX_BLOCK_SIZE, check_block_size, check_int, check_number, check_salt, check_token_ids
from promptsplice.errors import ConfigError, EngineUnavailableError, InputError, InvalidSaltError, InvalidUTF8Error
from promptsplice.tenancy import SaltGuard

__all__ = [
    "DEFAULT_KEY_BLOCKS",
    "DEFAULT_VNODES",
    "Lease",
    "PrefixRouter",
    "RoundRobinRouter",
    "prefix_route_key",
]

DEFAULT_KEY_BLOCKS = 4
"""Whole blocks of the prompt that name its routing key."""

DEFAULT_VNODES = 160
"""Ring points per endpoint (more points: a more even share of keys)."""


def _is_assembled(prompt: Any) -> bool:
    """An ``AssembledPrompt`` (or alike): it carries its own block hashes and salt (a
    ``NaivePrompt`` has no salt and no block hashes of its own: it routes by its ids)."""
    return hasattr(prompt, "block_hashes") and hasattr(prompt, "token_ids") and hasattr(prompt, "salt")


def _ids_of(prompt: Any) -> Any:
    """A prompt object that is not assembled but carries token ids (``NaivePrompt``,
    what ``Assembler.naive`` returns, which ``RemoteEngine`` sends as its ids) routes as
    those ids; anything else as it is."""
    if not _is_assembled(prompt) and not isinstance(prompt, str | bytes | bytearray | Sequence) and hasattr(prompt, "token_ids"):
        return prompt.token_ids
    return prompt


def prefix_route_key(
    prompt: Any,
    *,
    key_blocks: int = DEFAULT_KEY_BLOCKS,
    block_size: int = 16,
    salt: str | None = None,
) -> bytes:
    """The routing key of ``prompt``: the chain hash of its first ``key_blocks`` blocks.

    ``prompt``: an ``AssembledPrompt`` (its own block size, salt and block hashes), a
    sequence of token ids (chained at ``block_size`` under ``salt``) or a ``str``
    (UTF-8 bytes chained in blocks of ``4 * block_size`` bytes under ``salt``).
    """
    check_int(key_blocks, "key_blocks")
    check_block_size(block_size)
    prompt = _ids_of(prompt)
    salt = _prompt_salt(prompt, salt)
    if _is_assembled(prompt) and prompt.salt is None and salt is not None:
        prompt = list(prompt.token_ids)  # sent under the request's salt: its ids chained under it
    if _is_assembled(prompt):
        hashes = list(prompt.block_hashes[:key_blocks])
        if hashes:
            return bytes(hashes[-1])
        return content_digest(root_hash(prompt.salt) + token_bytes(prompt.token_ids))
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("cannot route an empty prompt")
        unit = min(4 * block_size, MAX_BLOCK_SIZE)  # ~4 bytes a token; a hash unit is a block size
        try:
            data = prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidUTF8Error.lone_surrogate("the prompt", prompt, exc, index=0, fix="pass valid text") from None
        hashes = chain_hashes(list(data[: key_blocks * unit]), unit, salt=salt)
        return bytes(hashes[-1]) if hashes else content_digest(root_hash(salt) + data)
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise InputError(
            f"cannot route a {type(prompt).__name__}: pass an AssembledPrompt, token ids or a str"
        )
    # every id checked (not the key's only): a prompt the engine refuses is never routed
    ids = check_token_ids(prompt, "prompt")[: key_blocks * block_size]
    hashes = chain_hashes(ids, block_size, salt=salt)
    return bytes(hashes[-1]) if hashes else content_digest(root_hash(salt) + token_bytes(ids))


def _prompt_salt(prompt: Any, salt: Any) -> str | None:
    """The salt that keys ``prompt``: an assembled prompt's own (an explicit ``salt``
    must then be the same), else ``salt``; both under the one salt rule."""
    check_salt(salt, "salt")
    if not _is_assembled(prompt):
        return salt
    own = check_salt(prompt.salt, "the prompt's salt")
    if own is None:
        # an unsalted prompt goes under the request's salt, as both engines send it
        # (until 2026-12-08 refused here, so require_salt could not route it at all)
        return salt
    if salt is not None and salt != own:
        raise InvalidSaltError(
            f"salt={salt!r} differs from the assembled prompt's salt {own!r}: assemble the "
            "prompt with the tenant's salt and leave salt unset here"
        )
    return own


def _ring_pos(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


def _key_pos(key: bytes) -> int:
    """Where a request key sits on the ring: its digest's, not its own first bytes (an
    explicit key such as a session id or a tenant's name would otherwise put every key
    with one 8-byte start on one endpoint)."""
    return _ring_pos(content_digest(key))


MAX_VNODES = 4096
"""The most ring points an endpoint may have.  At the default 160, endpoints' shares of
random keys lie within about 0.8x-1.13x of an even split (2 to 8 endpoints, 50,000
keys; the load bound evens out what that leaves on busy endpoints); more points
narrow it at a larger ring."""


def _same_server(endpoint: str) -> str:
    """The form two spellings of one URL share: scheme and host lower-cased, no trailing
    ``/`` nor ``/v1`` (a server's root and its ``/v1`` are one server, as
    ``RemoteEngine`` reads them; names that are not URLs are compared as they are)."""
    if "://" not in endpoint:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{slash}{path}".rstrip("/").removesuffix("/v1")


@dataclass(slots=True)
class Lease:
    """One routed request: its ``endpoint`` and ``key``; holds one unit of in-flight
    load on the endpoint until :meth:`release` (or the end of the ``with`` block)."""

    endpoint: str
    key: bytes | None
    _router: Any = field(repr=False)
    _released: bool = field(default=False, repr=False)
    _generation: int = field(default=0, repr=False)
    """Which joining of the endpoint the load was taken on: a lease from before the
    endpoint was removed and added again gives nothing back to the new one."""

    def release(self) -> None:
        """Give the load back (idempotent)."""
        self._router._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Release; an :class:`EngineUnavailableError` raised in the block (the endpoint
        is down) gets the way out added to its message: remove the endpoint."""
        self.release()
        if isinstance(exc, EngineUnavailableError) and hasattr(self._router, "remove_endpoint"):
            hint = (f" (endpoint {self.endpoint!r} of a {type(self._router).__name__}: while it is down, "
                    f"route around it with router.remove_endpoint({self.endpoint!r}), and "
                    "router.add_endpoint(...) when it is back)")
            if exc.args and isinstance(exc.args[0], str) and hint not in exc.args[0]:
                exc.args = (exc.args[0] + hint, *exc.args[1:])


def _check_endpoints(endpoints: Iterable[str]) -> list[str]:
    if isinstance(endpoints, str):
        raise ConfigError("endpoints must be a list of names or URLs, not one str")
    try:
        out = list(endpoints)
    except TypeError:
        raise ConfigError(f"endpoints must be a list of names or URLs, got {type(endpoints).__name__}") from None
    if not out:
        raise ConfigError("a router needs at least one endpoint")
    for e in out:
        if not isinstance(e, str) or not e:
            raise ConfigError(f"endpoints must be non-empty str (names or URLs), got {e!r}")
        if e != e.strip():
            raise ConfigError(f"endpoint {e!r} has surrounding whitespace: pass {e.strip()!r}")
    seen: dict[str, str] = {}
    for e in out:
        if _same_server(e) in seen:
            raise ConfigError(
                f"endpoints must be distinct servers: {seen[_same_server(e)]!r} and {e!r} name the same one "
                "(URLs are compared without a trailing '/' and with scheme and host lower-cased)"
            )
        seen[_same_server(e)] = e
    return out


def _request_prompt(prompt: Any) -> Any:
    if prompt is None:
        raise InputError("acquire needs a prompt or a key")
    return prompt


def _request_key(key: Any) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise InputError(f"key must be non-empty bytes, got {key!r}")
    return bytes(key)


def _salted_key(key: Any, salt: Any, prompt: Any) -> bytes:
    """An explicit request key under the request's ``salt`` (checked by the salt rule, as
    a prompt's is): the tenant's key.  A ``prompt`` given with it is refused: which of the
    two routes would be a guess."""
    if prompt is not None:
        raise InputError("acquire got both a prompt and a key: pass one (the key routes, the prompt would be ignored)")
    key = _request_key(key)
    salt = check_salt(salt, "salt")
    return key if salt is None else content_digest(root_hash(salt) + key)


class _Base:
    """Endpoint set, in-flight loads and per-endpoint request counts, under one lock."""

    def __init__(self, endpoints: Iterable[str]) -> None:
        names = _check_endpoints(endpoints)
        self._lock = threading.Lock()
        self._load: dict[str, int] = {e: 0 for e in names}
        self._generations: dict[str, int] = {}  # endpoint -> times it was added again
        self._requests: dict[str, int] = {e: 0 for e in names}

    @property
    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._load)

    def loads(self) -> dict[str, int]:
        """Requests in flight per endpoint."""
        with self._lock:
            return dict(self._load)

    def requests(self) -> dict[str, int]:
        """Requests routed to each endpoint so far (removed endpoints keep their count)."""
        with self._lock:
            return dict(self._requests)

    def _release(self, lease: Lease) -> None:
        with self._lock:  # the flag too: two threads releasing one lease give back one unit
            if lease._released:
                return
            lease._released = True
            endpoint = lease.endpoint
            if self._generations.get(endpoint, 0) == lease._generation and self._load.get(endpoint, 0) > 0:
                self._load[endpoint] -= 1

    def _explicit_key(self, key: Any, salt: Any, prompt: Any) -> bytes:
        """``acquire(key=...)``: the tenant's key (:func:`_salted_key`), its salt under the
        router's salt rule as a prompt's would be."""
        out = _salted_key(key, salt, prompt)
        self._check_tenant(salt)
        return out

    def _check_tenant(self, salt: str | None) -> None:
        """The router's salt rule for a request that routes (none here)."""

    def _take(self, endpoint: str, key: bytes | None) -> Lease:
        self._load[endpoint] += 1
        self._requests[endpoint] = self._requests.get(endpoint, 0) + 1
        return Lease(endpoint, key, self, _generation=self._generations.get(endpoint, 0))


class PrefixRouter(_Base):
    """Consistent hashing with bounded loads over ``endpoints``, keyed by prompt prefix.

    ``load_factor`` (> 1): no endpoint takes more than ``ceil(load_factor * (in_flight
    + 1) / n)`` requests at once.  ``key_blocks``: blocks that name the key (see
    :func:`prefix_route_key`).  ``block_size``: the engines' (an assembled prompt must
    have it: its key is that of its token ids); ``salt``: for token-id and text prompts
    (an assembled prompt carries its own).  ``vnodes``: ring points per endpoint.
    ``require_salt``: refuse to key a prompt without a salt
    (:class:`~promptsplice.errors.MissingSaltError`); either way, keying salted and
    unsalted prompts warns once (:class:`~promptsplice.errors.UnsaltedTenantWarning`).
    """

    def __init__(
        self,
        endpoints: Iterable[str],
        *,
        load_factor: float = 1.25,
        key_blocks: int = DEFAULT_KEY_BLOCKS,
        block_size: int = 16,
        vnodes: int = DEFAULT_VNODES,
        require_salt: bool = False,
    ) -> None:
        check_number(load_factor, "load_factor (1.25 lets a server take 25% over its share)",
                     minimum=1, strict=True)
        check_int(key_blocks, "key_blocks")
        check_int(vnodes, "vnodes", maximum=MAX_VNODES)
        super().__init__(endpoints)
        self._salts = SaltGuard("PrefixRouter", require=require_salt, keyword="salt")
        self.load_factor = float(load_factor)
        self.key_blocks = key_blocks
        self.block_size = check_block_size(block_size)
        self.vnodes = vnodes
        self._ring: list[tuple[int, str]] = sorted(p for e in self._load for p in self._points(e))

    def _points(self, endpoint: str) -> list[tuple[int, str]]:
        # placed by the server, not the spelling: "http://a:8000/" and "http://a:8000"
        # (routed as one) took other points, so a re-add, or another process, moved a third of the keys
        same = _same_server(endpoint)
        return [(_ring_pos(content_digest(f"{same}\x00{i}".encode())), endpoint) for i in range(self.vnodes)]

    def _routed_as(self, endpoint: str) -> str | None:
        """How ``endpoint`` (any spelling of its URL) is routed to, or None."""
        same = _same_server(endpoint)
        return next((e for e in self._load if _same_server(e) == same), None)

    def add_endpoint(self, endpoint: str) -> None:
        """Add an endpoint: it takes over about ``1/n`` of the keys."""
        _check_endpoints([endpoint])
        points = self._points(endpoint)  # hashed outside the lock: acquire() waits for none of it
        with self._lock:
            routed = self._routed_as(endpoint)
            if routed is not None:
                raise ConfigError(f"endpoint {endpoint!r} is already routed to" + (
                    f" (as {routed!r})" if routed != endpoint else ""))
            self._load[endpoint] = 0
            self._generations[endpoint] = self._generations.get(endpoint, 0) + 1
            self._requests.setdefault(endpoint, 0)
            self._ring = list(heapq.merge(self._ring, sorted(points)))

    def remove_endpoint(self, endpoint: str) -> None:
        """Remove an endpoint (any spelling of its URL): only its keys move.  Leases still
        held on it are let go."""
        with self._lock:
            routed = self._routed_as(endpoint) if isinstance(endpoint, str) else None
            if routed is None:
                raise ConfigError(f"endpoint {endpoint!r} is not routed to")
            endpoint = routed
            if len(self._load) == 1:
                raise ConfigError("cannot remove the last endpoint")
            del self._load[endpoint]
            self._ring = [p for p in self._ring if p[1] != endpoint]

    def key(self, prompt: Any, *, salt: str | None = None) -> bytes:
        """The routing key of ``prompt`` (see :func:`prefix_route_key`).  An assembled
        prompt must have the router's block size: its key is then the key of its token
        ids (else one prompt, sent as both, would have two keys and two servers)."""
        return self._key(prompt, salt)

    def _key(self, prompt: Any, salt: str | None) -> bytes:
        """:meth:`key`, one frame under the caller of ``key`` or ``acquire`` (the salt
        rule's warning names that caller's line)."""
        if _is_assembled(prompt) and getattr(prompt, "block_size", self.block_size) != self.block_size:
            raise ConfigError(
                f"the assembled prompt has block_size={prompt.block_size}, this router "
                f"block_size={self.block_size}: give PrefixRouter(block_size={prompt.block_size}) "
                "(the engines' block size), so that the prompt and its token ids route alike"
            )
        key = prefix_route_key(prompt, key_blocks=self.key_blocks, block_size=self.block_size, salt=salt)
        self._check_tenant(_prompt_salt(_ids_of(prompt), salt))  # a request that routes: a refused one is no tenant's
        return key

    def _check_tenant(self, salt: str | None) -> None:
        self._salts.check(salt, stacklevel=5)  # check <- here <- _key/_explicit_key <- key/acquire <- the caller

    def capacity(self) -> int:
        """The most requests an endpoint may hold in flight when one more arrives."""
        with self._lock:
            return self._capacity()

    def _capacity(self) -> int:
        total = sum(self._load.values()) + 1
        return math.ceil(self.load_factor * total / len(self._load))

    def owner(self, key: bytes, *, salt: str | None = None) -> str:
        """The endpoint that owns ``key`` on the ring, ignoring load; with a ``salt``,
        the tenant's key (``acquire(key=key, salt=salt)`` routes by it)."""
        key = _salted_key(key, salt, None)
        with self._lock:
            return self._walk(key, None)

    def _walk(self, key: bytes, cap: int | None) -> str:
        ring = self._ring
        start = bisect.bisect_left(ring, (_key_pos(key), ""))
        for step in range(len(ring)):
            endpoint = ring[(start + step) % len(ring)][1]
            if cap is None or self._load[endpoint] < cap:
                return endpoint
        raise AssertionError("bounded loads: some endpoint is always under capacity")  # pragma: no cover

    def acquire(self, prompt: Any = None, *, key: bytes | None = None, salt: str | None = None) -> Lease:
        """Route one request and count it in flight until the lease is released.

        Pass the ``prompt`` (keyed by :meth:`key`) or an explicit ``key`` (bytes, e.g. a
        session id's digest; with a ``salt``, the tenant's key: one session id of two
        tenants is two keys).  Use as ``with router.acquire(prompt) as lease: ...``.
        """
        key = self._explicit_key(key, salt, prompt) if key is not None else self._key(_request_prompt(prompt), salt)
        with self._lock:
            return self._take(self._walk(key, self._capacity()), key)


class RoundRobinRouter(_Base):
    """The baseline: endpoints in turn, whatever the prompt (same interface)."""

    def __init__(self, endpoints: Iterable[str]) -> None:
        super().__init__(endpoints)
        self._next = 0

    def acquire(self, prompt: Any = None, *, key: bytes | None = None, salt: str | None = None) -> Lease:
        """Route one request to the next endpoint in turn (``prompt``/``key`` unused, but
        checked as :meth:`PrefixRouter.acquire` checks them: the same calls fail on both)."""
        if key is not None:
            key = self._explicit_key(key, salt, prompt)
        else:  # the prompt's types and salt, as a PrefixRouter reads them (one rule)
            prefix_route_key(_request_prompt(prompt), key_blocks=1, salt=salt)
        with self._lock:
            names = list(self._load)
            endpoint = names[self._next % len(names)]
            self._next += 1
            return self._take(endpoint, key)
