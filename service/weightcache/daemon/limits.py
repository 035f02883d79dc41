"""What one client may cost the service: the caps that hold the trust boundary.

Owns :class:`Limits`, one frozen value built from ``[service]``
(:meth:`Limits.from_config`), and the constants that are not configurable
(:data:`MAX_REQUEST_BYTES`, :data:`MAX_MODEL_BYTES`). The transport and the
handlers read it; nothing here does I/O. The threat model these caps hold is
in docs/reliability.md ("Threat model").

A client over a per-connection cap gets ``resource_exhausted``
(:class:`~weightcache.errors.ResourceExhausted`, ``details.limit`` names the
cap, ``details.value`` its value) and the service stops reading from that
connection until the client has read its replies: it is never dropped
silently, and it never costs the service more than the caps say.

Forbidden imports: socket, selectors, threading, torch, weightcache.memory,
weightcache.pipeline, weightcache.daemon.transport, weightcache.daemon.handlers,
weightcache.daemon.loads, weightcache.daemon.loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..config import ServiceConfig

#: Largest request frame the service reads (bytes). Requests are small (a
#: ``model`` string of at most :data:`MAX_MODEL_BYTES` and a few numbers); replies
#: may still be up to :data:`weightcache.protocol.MAX_FRAME_BYTES`.
MAX_REQUEST_BYTES = 64 * 1024

#: Longest ``model`` string accepted (bytes of UTF-8): Linux ``PATH_MAX``.
MAX_MODEL_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Limits:
    """The caps, from ``[service]`` (docs/configuration.md lists the keys, ranges and defaults; the defaults
    live in :class:`~weightcache.config.ServiceConfig` only).

    Attributes:
        max_unread_replies (`int`): per connection, replies queued but not yet
            read plus attaches parked while their model loads. Past it, the
            next request gets ``resource_exhausted`` and reading pauses.
        max_queued_bytes (`int`): per connection, bytes of replies queued but
            not yet read.
        max_held_fds (`int`): per connection, fds the service holds for it:
            dups queued with unread replies plus those a parked attach will
            carry (``AttachReply.FD_COUNT``, 2: the slab and its manifest file).
        max_buffered_bytes (`int`): all connections together, bytes of
            incomplete request frames held. The connection whose read goes past
            it gets ``resource_exhausted`` and is closed.
        max_connections_per_uid (`int`): open connections of one uid
            (``SO_PEERCRED``; root and the service user are exempt). One more gets
            ``resource_exhausted`` and is closed.
        partial_frame_timeout_s (`float`): seconds an incomplete request frame
            may wait for its remaining bytes before the connection is closed
            with ``resource_exhausted``.
        max_fds_in_flight_per_uid (`int`): fds the service has sent (or queued)
            to the connections of one uid that the uid has not read yet (the
            kernel charges fds in flight to the *sender*, the service's user,
            and refuses every ``SCM_RIGHTS`` send past its ``RLIMIT_NOFILE``).
            An attach reply that would go past it is answered
            ``resource_exhausted`` instead, without fds and without a lease.
            Root and the service user are exempt.
        max_leases_per_connection (`int`): leases one connection holds; the
            next attach gets ``resource_exhausted``.
        max_leases_per_uid (`int`): leases all connections of one uid hold
            (root and the service user are exempt); the next attach gets
            ``resource_exhausted``.
        max_connections (`int`): open connections of all uids together (root and
            the service user are exempt): one more is answered
            ``resource_exhausted`` and closed.
        max_fds_in_flight (`int`): fds in flight to all uids together (0: half
            the service's ``RLIMIT_NOFILE``, read at each check); past it a uid
            still gets its share (this cap over the uids with fds in flight),
            the rest ``resource_exhausted`` as above
            (:meth:`~weightcache.daemon.outbox.Outbox._over_all_uids`).
    """

    max_unread_replies: int
    max_queued_bytes: int
    max_held_fds: int
    max_buffered_bytes: int
    max_connections_per_uid: int
    partial_frame_timeout_s: float
    max_fds_in_flight_per_uid: int
    max_leases_per_connection: int
    max_leases_per_uid: int
    max_connections: int
    max_fds_in_flight: int

    @classmethod
    def from_config(cls, service: Any) -> "Limits":
        """The caps of a :class:`~weightcache.config.ServiceConfig` (same attribute names)."""
        return cls(**{name: getattr(service, name) for name in cls.__dataclass_fields__})

    @classmethod
    def defaults(cls, **changes: Any) -> "Limits":
        """The caps of an empty ``[service]`` table, with ``changes`` applied."""
        return replace(cls.from_config(ServiceConfig()), **changes)
