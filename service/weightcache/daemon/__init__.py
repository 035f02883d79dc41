"""The per-GPU service, one room per concern.

One process serves one GPU (``weightcache serve --gpu N``). The main thread
runs the serving loop (:mod:`.loop`) over the listening socket, the client
connections and a wake-up pipe; one loader thread (:mod:`.loads`) runs the
pipeline for every (model, layout, rank) placed on the GPU, one after the
other, and posts its results to the loop. Clients are served while loads run:
an ``attach`` for a model still loading waits (up to its ``wait_ms``) or gets
a ``loading`` reply with progress.

========================  =====================================================
module                    owns
========================  =====================================================
:mod:`.state`             SlotState, the transition table, Slot, Lease, Peer,
                          ServiceState (no I/O, no threads)
:mod:`.handlers`          one function per request, returning replies and
                          effects; the failure rule for one request
:mod:`.effects`           what handlers take (Context) and return (Outcome:
                          replies and effects)
:mod:`.reload`            a new configuration: the plan (keep, add, drop,
                          retire) and carrying it out on the state
:mod:`.loads`             the loader thread and the load timeout
:mod:`.load_results`      the results the loader posts, applied by the loop
:mod:`.fdstore`           systemd's fd store: put, remove, adopt
:mod:`.access`            a peer's rights; allow-list and operator checks
:mod:`.limits`            the per-client caps (:class:`~.limits.Limits`)
:mod:`.transport`         listener, connections, backpressure, caps
:mod:`.outbox`            the send path: outboxes, fds in flight per uid
:mod:`.clients`           one accepted connection (Client), the peer's
                          credentials (SO_PEERCRED, SO_PEERGROUPS)
:mod:`.ticker`            STATUS, EXTEND_TIMEOUT, READY, WATCHDOG, gc.freeze
:mod:`.metrics`           the counters of the ``metrics`` reply (attaches,
                          their service times, loads, verifies)
:mod:`.loop`              :class:`~.loop.Daemon`: the serving loop; holds the
                          rooms, carries out effects
:mod:`.offloop`           :class:`~.offloop.OffLoop`: work the loop hands to
                          threads (demotion copies, reload reads, verify
                          hashing) and applying it
:mod:`.bootstrap`         ``weightcache serve``: the backend, the listener,
                          the fd store's entries, then :class:`~.loop.Daemon`
========================  =====================================================

Each room is imported where it lives (``weightcache.daemon.loop.Daemon``);
this face re-exports nothing, so importing one room (``daemon.state``) loads
only that room.

Trust boundary: a malformed frame, a protocol violation or a dead client ends
that connection only; a bad model fails alone; a failure inside one request
answers that client with ``internal_error``. A broken invariant of the
service's own state exits non-zero (systemd restarts it; the fd store keeps the
slabs).

Forbidden imports: torch.
"""
