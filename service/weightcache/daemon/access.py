"""Who may do what: a peer's rights, and the checks made against them.

Owns :class:`Rights` (the peer's uid, user name and group names, looked up
once per connection from ``SO_PEERCRED``) and the checks a handler calls before
it touches a model (:func:`check_attach`). The socket's group and mode decide
who may connect at all (units/weightcache@.socket); a model's ``allow_users``
and ``allow_groups`` decide who may attach it. Further checks (operators for
evict/preload/verify, ``SO_PEERGROUPS``) belong here.

Forbidden imports: socket, selectors, threading, torch, weightcache.memory,
weightcache.pipeline, weightcache.daemon.transport, weightcache.daemon.handlers,
weightcache.daemon.loads, weightcache.daemon.fdstore, weightcache.daemon.loop.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
from dataclasses import dataclass

from ..errors import AccessDenied
from ..journal import event
from .state import Peer, Slot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rights:
    """What the system says about a peer: its user name (None when unknown) and group names.

    Groups are the user's supplementary groups (``getgrouplist``) plus its
    primary gid; a gid with no name appears as its number.
    """

    uid: int
    user: str | None
    groups: frozenset[str]


def rights_of(uid: int, gid: int) -> Rights:
    """Looks up the user name and groups of ``uid`` (primary group ``gid``) through NSS."""
    try:
        name = pwd.getpwuid(uid).pw_name
        gids = set(os.getgrouplist(name, gid))
    except KeyError:
        name, gids = None, {gid}
    groups = set()
    for g in gids:
        try:
            groups.add(grp.getgrgid(g).gr_name)
        except KeyError:
            groups.add(str(g))
    return Rights(uid, name, frozenset(groups))


def _rights(peer: Peer) -> Rights:
    if peer.rights is None:
        peer.rights = rights_of(peer.uid, peer.gid)
    return peer.rights


def check_attach(peer: Peer, slot: Slot, service_uid: int) -> None:
    """Allows ``peer`` to attach ``slot`` or raises.

    A model without allow lists is open to everyone who may connect; the
    service's own uid is always allowed.

    Raises:
        AccessDenied (`access_denied`): the peer is on neither ``allow_users``
            (by name or uid) nor ``allow_groups`` of the model.
    """
    m = slot.placement.model
    if not m.allow_users and not m.allow_groups:
        return
    if peer.uid == service_uid:
        return
    r = _rights(peer)
    if (r.user is not None and r.user in m.allow_users) or str(peer.uid) in m.allow_users \
            or r.groups & set(m.allow_groups):
        return
    log.warning("rejected attach model=%s peer_pid=%d peer_uid=%d user=%s reason=not-on-allow-list",
                m.name, peer.pid, peer.uid, r.user, extra=event("rejected", m.name, slot.placement.tp_rank, error_code="access_denied",
                                                                 peer_uid=peer.uid))
    raise AccessDenied(
        f"user {r.user or peer.uid} (uid {peer.uid}) may not attach model {m.name!r}: not in allow_users "
        f"{list(m.allow_users)} or allow_groups {list(m.allow_groups)} of {m.source}",
        model=m.name, uid=peer.uid)
