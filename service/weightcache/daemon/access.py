"""Who may do what: a peer's rights, and the checks made against them.

Owns :class:`Policy` (the service's uid and the operator groups, from the
config), :class:`Rights` (a peer's uid, user name and gids) and the checks
handlers call before they touch a model. The trust model
(docs/reliability.md, "Threat model"):

- the socket's group and mode decide who may connect at all
  (units/weightcache@.socket);
- a model's ``allow_users`` / ``allow_groups`` decide who may ``attach`` it,
  and who may see it in ``status`` and ``list`` (a model without allow lists
  is open to everyone who may connect);
- ``evict``, ``preload`` and ``verify`` need an operator (root, the service
  user, or a member of ``service.operator_groups``) who may also attach the
  model;
- root and the service user pass every check;
- ``publish`` (DESIGN §6.4): a publication by root, the service user or a user on the model's ``publishers``
  is *shared* (every engine the allow lists admit attaches it); with ``publishers`` set, nobody else may
  publish the model; without it, anyone the allow lists admit may, and the publication is *private*: only
  engines of the publisher's own uid attach it (no one else, root included, and it changes nothing anyone
  else attaches).

Groups are the peer's primary gid (``SO_PEERCRED``) and the supplementary
groups it really holds (``SO_PEERGROUPS``, taken at ``connect()`` by the
transport), never what ``/etc/group`` says about its user name. The checks
compare ids only: the configured user and group names were resolved where the
configuration was read (:class:`~weightcache.config.AccountNames`,
``Policy.names``), so no check asks NSS (``/etc/passwd``, sssd, LDAP) on the
serving loop, however many peers connect.

Forbidden imports: socket, selectors, threading, torch, weightcache.memory,
weightcache.pipeline, weightcache.daemon.transport, weightcache.daemon.handlers,
weightcache.daemon.loads, weightcache.daemon.fdstore, weightcache.daemon.loop.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ..config import METRICS_USER, AccountNames
from ..errors import AccessDenied
from ..journal import event
from .lograte import warn_peer
from .state import Peer, Slot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Policy:
    """The service's side of the checks.

    Attributes:
        service_uid (`int`): the service's own uid (an operator, always allowed).
        operator_groups (`tuple[str]`): ``service.operator_groups``: group names
            (or numeric gids) whose members are operators.
        names (`AccountNames`): the configuration's user and group names resolved
            where it was read (``Config.names``); a name absent there matches nobody.
    """

    service_uid: int = field(default_factory=os.getuid)
    operator_groups: tuple[str, ...] = ()
    names: AccountNames = field(default_factory=AccountNames)


@dataclass(frozen=True, slots=True)
class Rights:
    """What the checks know of a peer: its uid, the configured user name with that uid (None when no
    configured name has it), and its gids (``SO_PEERCRED``'s primary gid and ``SO_PEERGROUPS``)."""

    uid: int
    user: str | None
    gids: frozenset[int]


def rights_of(peer: Peer, policy: Policy) -> Rights:
    """``peer``'s rights under ``policy``, for messages (the checks compare ids directly): no system lookup."""
    return Rights(peer.uid, policy.names.user_of(peer.uid), frozenset((peer.gid, *peer.groups)))


def _in_groups(peer: Peer, names: tuple[str, ...] | list[str], policy: Policy) -> bool:
    """Whether the peer's primary gid or one of its ``SO_PEERGROUPS`` is one of the configured groups ``names``."""
    return any((gid := policy.names.gid(n)) is not None and (gid == peer.gid or gid in peer.groups) for n in names)


def is_operator(peer: Peer, policy: Policy) -> bool:
    """Root, the service user, or a member (``SO_PEERGROUPS``) of ``service.operator_groups``."""
    return peer.uid in (0, policy.service_uid) or _in_groups(peer, policy.operator_groups, policy)


def may_observe_all(peer: Peer, policy: Policy) -> bool:
    """Whether ``metrics`` shows ``peer`` every slab: operators and :data:`METRICS_USER`.

    The endpoint exports node-wide numbers for the fleet's Prometheus, restricted
    models included; it is no operator (it may not evict, preload or verify) and
    sees no lease holder's pid, uid or gid.
    """
    return is_operator(peer, policy) or peer.uid == policy.names.uid(METRICS_USER)


def may_attach(peer: Peer, slot: Slot, policy: Policy) -> bool:
    """Whether ``peer`` is on ``slot``'s model's allow lists (or the model has none, or it is root/the service),
    and, for a private publication, of its publisher's uid."""
    if slot.publication is not None and not slot.publication.visible_to(peer.uid):
        return False
    m = slot.placement.model
    if not m.allow_users and not m.allow_groups:
        return True
    if peer.uid in (0, policy.service_uid):
        return True
    return any(policy.names.uid(u) == peer.uid for u in m.allow_users) or _in_groups(peer, m.allow_groups, policy)


def _who(r: Rights) -> str:
    """The peer in a refusal: ``user alice (uid 1001)`` when a configured name has its uid, else ``uid 1001``
    (names are resolved only where the configuration is read, never for a peer)."""
    return f"user {r.user} (uid {r.uid})" if r.user else f"uid {r.uid}"


def check_attach(peer: Peer, slot: Slot, policy: Policy, request: str = "attach") -> None:
    """Allows ``peer`` to use ``slot`` for ``request`` or raises.

    ``request`` is ``attach``, or ``evict``/``preload``/``verify`` after :func:`check_operator`.

    Raises:
        AccessDenied (`access_denied`): the peer is on neither ``allow_users``
            (by name or uid) nor ``allow_groups`` of the model.
    """
    if may_attach(peer, slot, policy):
        return
    m, r = slot.placement.model, rights_of(peer, policy)
    # Rate-limited per peer like the transport's warnings: one connection's denied attaches flooded the journal
    # (14,207, then 2,132 lines/s; issue 38, P13).
    warn_peer(log, peer.pid, peer.uid, "rejected %s model=%s peer_pid=%d peer_uid=%d user=%s "
              "reason=not-on-allow-list allow_users=%s allow_groups=%s source=%s", request, m.name, peer.pid,
              peer.uid, r.user, list(m.allow_users), list(m.allow_groups), m.source,
              extra=event("rejected", m.name, slot.placement.tp_rank, tp_size=slot.placement.tp_size,
                          error_code="access_denied", peer_uid=peer.uid))
    # The lists themselves stay in the journal: the refused client learns that it is refused, not whom they name.
    raise AccessDenied(
        f"{_who(r)} may not {request} model {m.name!r}: neither the user nor a group the process holds is on the "
        f"model's allow_users or allow_groups in {m.source}; ask the operator to add one (the refusal in the "
        f"service's journal lists them), then systemctl reload weightcache",
        model=m.name, uid=peer.uid, request=request)


def check_operator(peer: Peer, policy: Policy, request: str, model: str) -> None:
    """Allows ``request`` (``evict``, ``preload``, ``verify``) from an operator only.

    Raises:
        AccessDenied (`access_denied`): the peer is not root, the service user
            or a member of ``service.operator_groups``.
    """
    if is_operator(peer, policy):
        return
    r = rights_of(peer, policy)
    warn_peer(log, peer.pid, peer.uid, "rejected %s model=%s peer_pid=%d peer_uid=%d user=%s reason=not-an-operator",
              request, model[:200], peer.pid, peer.uid, r.user,
              extra=event("rejected", error_code="access_denied", peer_uid=peer.uid))
    raise AccessDenied(
        f"{_who(r)} may not {request}: only root, the service user and members "
        f"of service.operator_groups {list(policy.operator_groups)} may; run it as one of them (e.g. sudo)",
        model=model[:200], uid=peer.uid, request=request)


def is_trusted_publisher(peer: Peer, slot: Slot, policy: Policy) -> bool:
    """Root, the service user, or a user (by name or uid) on ``slot``'s model's ``publishers``."""
    if peer.uid in (0, policy.service_uid):
        return True
    return any(policy.names.uid(u) == peer.uid for u in slot.placement.model.publishers)


def check_publish(peer: Peer, slot: Slot, policy: Policy) -> bool:
    """Allows ``peer`` to publish ``slot``'s model (see the module docstring); returns whether the publication is
    shared (True) or private to the peer's uid (False).

    Raises:
        AccessDenied (`access_denied`): the peer is not on the model's allow lists, or the model names its
            ``publishers`` and the peer is none of them.
    """
    check_attach(peer, slot, policy, "publish")
    if is_trusted_publisher(peer, slot, policy):
        return True
    m = slot.placement.model
    if not m.publishers:
        return False
    r = rights_of(peer, policy)
    log.warning("rejected publish model=%s peer_pid=%d peer_uid=%d user=%s reason=not-a-publisher publishers=%s "
                "source=%s", m.name, peer.pid, peer.uid, r.user, list(m.publishers), m.source,
                extra=event("rejected", m.name, slot.placement.tp_rank, tp_size=slot.placement.tp_size,
                            error_code="access_denied", peer_uid=peer.uid))
    raise AccessDenied(
        f"{_who(r)} may not publish model {m.name!r}: the model's publishers in {m.source} do not name it; publish "
        f"as one of them, or ask the operator to add this user to publishers (then systemctl reload weightcache)",
        model=m.name, uid=peer.uid, request="publish")
