"""User and group names of the configuration, resolved to ids where the configuration is read.

``allow_users``, ``allow_groups`` and ``service.operator_groups`` name
accounts; the access checks (:mod:`weightcache.daemon.access`) compare ids
(``SO_PEERCRED``, ``SO_PEERGROUPS``). The names go through NSS
(``getpwnam``/``getgrnam``: ``/etc/passwd``, or sssd/LDAP, which can take
seconds or hang), so they are resolved once where the configuration is read,
at start before serving and on the reload worker thread, never on the
serving loop, and never because a peer connected. A name that does not
resolve then (an account created later) is unknown until the next reload,
which resolves every name again.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import grp
import pwd
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

#: The packaged metrics endpoint's user (units/weightcache.sysusers): the service shows it every slab.
METRICS_USER = "weightcache-metrics"


@dataclass(frozen=True)
class AccountNames:
    """Configured user and group names and their ids, as NSS answered when the configuration was read.

    Attributes:
        uids (`Mapping[str, int]`): user name -> uid (names that did not resolve are absent).
        gids (`Mapping[str, int]`): group name -> gid.

    Numbers written as strings (``"1001"``) are ids and need no entry.
    """

    uids: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    gids: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def uid(self, name: str) -> int | None:
        """The uid of a configured user name or number; None when it did not resolve."""
        return int(name) if name.isdigit() else self.uids.get(name)

    def gid(self, name: str) -> int | None:
        """The gid of a configured group name or number; None when it did not resolve."""
        return int(name) if name.isdigit() else self.gids.get(name)

    def user_of(self, uid: int) -> str | None:
        """The configured user name whose uid is ``uid`` (for messages); None when none is."""
        for name, u in self.uids.items():
            if u == uid:
                return name
        return None


def resolve(users: Iterable[str], groups: Iterable[str]) -> AccountNames:
    """Looks up ``users`` and ``groups`` (and :data:`METRICS_USER`) through NSS; numbers are skipped.

    Called where the configuration is read; names that do not exist are left
    out (they match nobody, as an unknown name did before).
    """
    uids: dict[str, int] = {}
    gids: dict[str, int] = {}
    for name in {*users, METRICS_USER}:
        if name and not name.isdigit():
            try:
                uids[name] = pwd.getpwnam(name).pw_uid
            except (KeyError, OSError):  # unknown, or NSS failed: matches nobody until a reload
                continue
    for name in set(groups):
        if name and not name.isdigit():
            try:
                gids[name] = grp.getgrnam(name).gr_gid
            except (KeyError, OSError):  # unknown, or NSS failed: matches nobody until a reload
                continue
    return AccountNames(MappingProxyType(uids), MappingProxyType(gids))
