"""Tenant isolation by salt: the one check that every shared cache runs on its salts.

A ``cache_salt`` enters the root of the chain hash (``promptsplice.blocks.root_hash``;
vLLM puts it in the first block's extra keys), so two salts never share a block: not in
vLLM's prefix cache, a prefix-cache mirror, the block store or the router's keys.
Requests *without* a salt all share one root, so unsalted tenants can hit, and time,
each other's prefixes.  A cache cannot know who its callers are, but it can see the
one mix that is always a mistake: salted and unsalted requests on one cache (someone
isolates tenants, someone else forgot).  :class:`SaltGuard` warns once on that mix
(:class:`~promptsplice.errors.UnsaltedTenantWarning`) and, with ``require=True``,
refuses unsalted requests (:class:`~promptsplice.errors.MissingSaltError`).  It also
enforces the one salt rule (:func:`promptsplice._validate.check_salt`: a non-empty
``str`` or ``None``), so a salt that slipped past a door (one carried by a prompt
object) is refused before it reaches a cache.

This module imports nothing heavy: the router and the engines share it.
"""

from __future__ import annotations

import threading
import warnings

from promptsplice._validate import check_bool, check_salt, salt_tenant
from promptsplice.errors import MissingSaltError, UnsaltedTenantWarning

__all__ = ["SaltGuard"]


class SaltGuard:
    """Watches the salts that reach one shared cache (thread-safe).

    ``owner`` names the cache in messages (``"EmbeddedEngine"``); ``require``: refuse
    requests without a salt (a bool, else :class:`~promptsplice.errors.ConfigError`
    naming ``require_salt``).
    """

    __slots__ = ("owner", "require", "keyword", "_salted", "_unsalted", "_warned", "_lock")

    def __init__(self, owner: str, *, require: bool = False, keyword: str = "cache_salt") -> None:
        self.owner = owner
        self.keyword = keyword  # the owner's own argument for the salt, named in its errors
        self.require = check_bool(require, "require_salt")
        self._salted = False
        self._unsalted = False
        self._warned = False
        self._lock = threading.Lock()

    @property
    def mixed(self) -> bool:
        """True once both salted and unsalted requests were seen."""
        return self._salted and self._unsalted

    def check(self, salt: object, *, stacklevel: int = 3) -> None:
        """Record one request's salt (``None`` or a salt derived from no tenant's:
        unsalted); warn on the first mix.  A salt that breaks the salt rule raises
        :class:`~promptsplice.errors.InvalidSaltError`."""
        check_salt(salt)
        # a salt derived from no tenant's ("\x1fexact", "\x1fpic:...": an unsalted
        # runner's) is shared by every unsalted caller: unsalted, as None is
        if salt is None or salt_tenant(salt) is None:
            if self.require:
                what = "no salt" if salt is None else f"only a salt derived from none ({salt!r:.40})"
                raise MissingSaltError(
                    f"{self.owner} was built with require_salt=True and this request has "
                    f"{what}: pass {self.keyword}=<the tenant's salt>"
                )
            if self._unsalted:
                return
            self._unsalted = True
        else:
            if self._salted:
                return
            self._salted = True
        with self._lock:
            if self._warned or not (self._salted and self._unsalted):
                return
            self._warned = True
        warnings.warn(
            f"{self.owner} serves requests with and without {self.keyword}: unsalted requests "
            "share one prefix cache with every other unsalted caller (each can hit, and "
            f"time, the others' prefixes). Give every tenant its own {self.keyword}, or pass "
            "require_salt=True to refuse unsalted requests.",
            UnsaltedTenantWarning,
            stacklevel=stacklevel,
        )
