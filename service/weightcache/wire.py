"""The values both ends of the wire share: slab states, attach modes, namings, request defaults.

One definition each, imported by the service (:mod:`weightcache.daemon`,
:mod:`weightcache.config`), the protocol's records (:mod:`weightcache.protocol`),
the engine side (:mod:`weightcache.client`, :mod:`weightcache.integrations`)
and the operator's tools (:mod:`weightcache.cli`, :mod:`weightcache.metrics`).
Each enum is a :class:`enum.StrEnum`: a member is its wire string (it
encodes to JSON as that string), and records parse the string into the
member when they are built or decoded, so code compares members.

A leaf: it imports nothing of weightcache, so any module may import it.

Forbidden imports: weightcache (a leaf), torch, numpy, socket.
"""

from __future__ import annotations

import enum


class SlotState(enum.StrEnum):
    """Where one slab (one (model, layout, rank) on one GPU) is in its life; the value is what ``status`` reports.

    The service's transition table (:data:`weightcache.daemon.state.TRANSITIONS`)
    says which moves are allowed; ``weightcache status`` renders each member and
    ``weightcache_slab_state{state=...}`` has one series per member.
    """

    PENDING = "pending"   # configured, waiting for the loader
    LOADING = "loading"   # the loader plans, reads and fills its slab
    READY = "ready"       # sealed slab resident, attachable
    FAILED = "failed"     # the last load failed; ``error`` says why
    EVICTED = "evicted"   # freed by ``evict``; ``preload`` loads it again
    RETIRED = "retired"   # replaced or removed by a reload, kept while leased, attachable by nobody new
    DROPPED = "dropped"   # removed from the config: out of the service's list (a load under way is discarded)
    HOSTED = "hosted"     # demoted to the host tier (memory budget, ``evict --to host``); an attach promotes it
    ON_DISK = "on_disk"   # not resident, by the memory budget or ``evict --to disk``; an attach loads it
    #: ``naming = "vllm"`` that the service cannot lay out itself (an architecture without rules, a scheme it cannot
    #: pre-process): not a failure; the first engine that starts it publishes it (docs/design.md §6.3).
    WAITING_FOR_ENGINE = "waiting_for_engine"


#: States in which a load is still to come or under way (an attach may wait; ``weightcache wait`` waits).
UNSETTLED: frozenset[SlotState] = frozenset({SlotState.PENDING, SlotState.LOADING})


class AttachMode(enum.StrEnum):
    """How an engine uses an attached slab (``attach`` request, lease records, :func:`weightcache.attach`)."""

    ZERO_COPY = "zero_copy"  # shared read-only views of the service's slab; the lease lasts as long as they do
    COPY = "copy"            # private writable copies; the lease ends once they are made


#: Tensor naming schemes a slab can be built in: ``hf`` (the checkpoint's names) or ``vllm`` (vLLM's fused
#: parameters); docs/sharding.md.
NAMINGS: tuple[str, ...] = ("hf", "vllm")

#: Defaults of a load request, the same in the config (``[models.NAME]``), :func:`weightcache.attach`,
#: the vLLM loader's extra config and a client attaching by name: the checkpoint's own dtype, its
#: own names, and the CUTLASS layout for quantized weights.
DEFAULT_DTYPE = "auto"
DEFAULT_NAMING = "hf"
DEFAULT_KERNEL = "cutlass"
DEFAULT_MODE = AttachMode.ZERO_COPY

__all__ = ["AttachMode", "DEFAULT_DTYPE", "DEFAULT_KERNEL", "DEFAULT_MODE", "DEFAULT_NAMING", "NAMINGS",
           "SlotState", "UNSETTLED"]
