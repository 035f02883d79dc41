"""Ending a lease before its connection: ``release`` and ``release_reply``, frozen self-validating dataclasses as in
:mod:`._messages`.

A lease also ends with its connection, which is how weightcache's own client
ends them (:meth:`weightcache.client.Attachment.close` closes the session), so
an engine's attach never builds these: imported on first use (the first ``release`` or ``release_reply``
decoded by :mod:`._codec`, ``protocol.Release``...).

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._messages import Message


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Ends one lease (closing the connection ends all of them)."""

    lease_id: int


@dataclass(frozen=True, slots=True)
class ReleaseReply(Message):
    """Answer to ``release``: the lease that ended."""

    lease_id: int
