"""The node's metrics in Prometheus' exposition format, written with ``prometheus_client``.

Owns the metric names, their labels and help texts (:data:`FAMILIES` lists
them; docs/operations.md has the table), how the instances of a node are
found and asked (:func:`collect`), and the text (:func:`exposition`,
:func:`write_textfile`). ``weightcache metrics`` prints it;
``weightcache serve-metrics`` (:mod:`weightcache.metrics_http`, behind
``weightcache-metrics.socket``) answers ``GET /metrics`` with it.

Never starts an instance. Connecting to ``/run/weightcache/N.sock`` while
``weightcache@N.service`` is not running would start it (socket activation)
and with it every load placed on GPU N. So an instance is asked (one
``metrics`` request over its socket) only when its service is already
running, decided without touching the socket:

1. systemd is asked, read-only: ``systemctl show -p ActiveState
   weightcache@N.service ...`` (one call for all GPUs); ``active`` and
   ``reloading`` are asked, every other state is reported as it is and not asked;
2. where systemd cannot answer (no D-Bus for an unprivileged caller), the
   service's ``RuntimeDirectory=`` decides: ``/run/weightcache/N/`` exists from
   the service's start until it stops or fails (kept across its automatic
   restarts), so present means running;
3. on a host without systemd (``/run/systemd/system`` missing) nothing can be
   socket-activated: every socket is asked (a ``weightcache serve`` run by hand).

A window remains between the check and the connect: an instance stopped in it
is started again by the connect. ``systemctl stop`` of an instance stops its
socket too when both are stopped together, as ``weightcache.target`` does.

Labels: ``gpu`` (the instance number) on every series; ``gpu_uuid`` (``GPU-...``, empty on the host
backend, which Prometheus stores as no label) on every series the instance itself reports (its answer
carries its device), so they join dcgm-exporter's ``UUID`` one-to-one. The four series the endpoint
writes from outside the instance (:data:`OUTSIDE`: socket, unit state, answered, configured slabs) carry
``gpu`` only: they exist while the instance is down, when its UUID is unknown, and must stay one series
through its starts and stops (``for:`` of an alert, ``changes()``); ``weightcache_build_info`` joins the
UUID onto them where it is known (docs/operations.md, "GPU identity").

GPUs reported: every ``N.sock`` in the socket directory and every GPU the
config places a model on (a configured GPU without a socket shows
``weightcache_socket_listening 0``). An idle node answers with what it knows:
socket and unit state, no slabs.

Forbidden imports: torch, weightcache.daemon, weightcache.memory, weightcache.pipeline, weightcache.client.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest, write_to_textfile
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    InfoMetricFamily, Metric)

from . import protocol
from .session import Session, listening_gpus
from .errors import WeightcacheError
from .wire import SlotState

log = logging.getLogger(__name__)

#: systemd's ActiveState values of a unit, plus ``unknown`` (systemd not asked or not there).
UNIT_STATES = ("active", "reloading", "inactive", "failed", "activating", "deactivating", "unknown")
#: States of a service that may be asked without starting it.
ASKABLE = frozenset({"active", "reloading"})
#: A slab's states: every :class:`~weightcache.wire.SlotState` member, in its order (one series each).
SLAB_STATES: tuple[SlotState, ...] = tuple(SlotState)
#: Where a slab is (``weightcache.daemon.budget.TIERS``).
SLAB_TIERS = ("gpu", "host", "disk")

#: Labels of the series the instance reports about its device (see the module docstring).
GPU_LABELS = ("gpu", "gpu_uuid")
SLAB_LABELS = GPU_LABELS + ("model", "tp_size", "tp_rank")
#: Families the endpoint writes from outside the instance (systemd, the socket directory, the configuration):
#: ``gpu`` only, never ``gpu_uuid``.
OUTSIDE = ("weightcache_socket_listening", "weightcache_configured_slabs", "weightcache_service_state",
           "weightcache_instance_up")

#: name -> (type, labels, help): every family this module writes (docs/operations.md has the same table).
FAMILIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "weightcache_socket_listening": ("gauge", ("gpu",),
                                     "1 when N.sock exists in the socket directory ([service] socket_dir, "
                                     "/run/weightcache by default; weightcache@N.socket listens)"),
    "weightcache_configured_slabs": ("gauge", ("gpu",),
                                     "Slabs ((model, layout, rank)) the configuration files place on GPU N; 0 for a "
                                     "GPU of [service] disabled_gpus or one they place nothing on"),
    "weightcache_service_state": ("gauge", ("gpu", "state"),
                                  "1 for the systemd ActiveState of weightcache@N.service (unknown: not asked)"),
    "weightcache_instance_up": ("gauge", ("gpu",),
                                "1 when the instance's daemon answered this scrape's metrics request (it may still "
                                "serve nothing: see weightcache_config_rejected); 0 when nothing answered or "
                                "weightcache-hold did (runtime missing)"),
    "weightcache_config_rejected": ("gauge", GPU_LABELS,
                                    "1 while the instance serves without its configuration files (they did not load "
                                    "at start or at the last reload; the journal's config_rejected event names the "
                                    "file, line and key)"),
    "weightcache_build": ("info", ("gpu", "version", "protocol_version", "backend", "gpu_uuid",
                                   "compute_capability"), "The instance's weightcache version and device"),
    "weightcache_start_time_seconds": ("gauge", GPU_LABELS, "When the instance started, Unix time in seconds"),
    "weightcache_clients": ("gauge", GPU_LABELS, "Open client connections of the instance"),
    "weightcache_memory_slab_bytes": ("gauge", GPU_LABELS, "Device memory held by resident slabs, bytes"),
    "weightcache_memory_free_bytes": ("gauge", GPU_LABELS, "Free memory of the device (host RAM: host backend), bytes"),
    "weightcache_memory_total_bytes": ("gauge", GPU_LABELS,
                                       "Total memory of the device (host RAM: host backend), bytes"),
    "weightcache_memory_budget_bytes": ("gauge", GPU_LABELS, "The memory budget in force (memory_budget_bytes), bytes"),
    "weightcache_memory_budget_used_bytes": ("gauge", GPU_LABELS,
                                             "Bytes of the budget taken: slabs on the GPU and loads granted room"),
    "weightcache_host_tier_bytes": ("gauge", GPU_LABELS, "Size of the host tier (host_tier_bytes), bytes"),
    "weightcache_host_tier_used_bytes": ("gauge", GPU_LABELS, "Bytes the host tier holds, bytes"),
    "weightcache_memory_held_elsewhere_bytes": ("gauge", GPU_LABELS,
                                                "Bytes of slabs the service freed that engines still map, bytes"),
    "weightcache_slab_state": ("gauge", SLAB_LABELS + ("state",), "1 for the slab's state"),
    "weightcache_slab_tier": ("gauge", SLAB_LABELS + ("tier",), "1 for the slab's tier (gpu, host, disk)"),
    "weightcache_slab_resident_bytes": ("gauge", SLAB_LABELS, "Size of the slab's resident mapping, bytes"),
    "weightcache_slab_tensors": ("gauge", SLAB_LABELS, "Tensor records in the resident slab's manifest"),
    "weightcache_slab_leases": ("gauge", SLAB_LABELS, "Leases held on the slab (attached engines)"),
    "weightcache_slab_adopted": ("gauge", SLAB_LABELS, "1 when the slab was taken back from systemd's fd store"),
    "weightcache_slab_last_load_duration_seconds": ("gauge", SLAB_LABELS,
                                                    "Duration of the slab's last load since start, seconds"),
    "weightcache_slab_last_load_bytes": ("gauge", SLAB_LABELS, "Payload bytes written by the slab's last load"),
    "weightcache_loads": ("counter", SLAB_LABELS + ("outcome", "code", "source"),
                          "Loads that ended, by outcome (loaded, failed), error code and source (checkpoint, image, peer)"),
    "weightcache_images_written": ("counter", GPU_LABELS, "Images written to the image directory"),
    "weightcache_image_written_bytes": ("counter", GPU_LABELS, "Slab bytes written to images, bytes"),
    "weightcache_image_write_seconds": ("counter", GPU_LABELS, "Time spent writing images, seconds"),
    "weightcache_image_write_failures": ("counter", GPU_LABELS, "Image writes that did not finish (no room, I/O)"),
    "weightcache_images_read": ("counter", GPU_LABELS, "Slabs made from a valid image instead of the checkpoint"),
    "weightcache_image_read_bytes": ("counter", GPU_LABELS, "Slab bytes read from images, bytes"),
    "weightcache_image_read_seconds": ("counter", GPU_LABELS, "Time spent reading and checking images, seconds"),
    "weightcache_images_rejected": ("counter", GPU_LABELS + ("reason",),
                                    "Images not served, by reason (digest, identity, key, layout, format, access)"),
    "weightcache_images_removed": ("counter", GPU_LABELS, "Images removed to keep within image_max_bytes"),
    "weightcache_verify_runs": ("counter", SLAB_LABELS, "verify requests that recomputed the slab's digests"),
    "weightcache_verify_failures": ("counter", SLAB_LABELS, "verify runs that found a changed tensor"),
    "weightcache_attaches": ("counter", GPU_LABELS + ("model", "outcome", "code"),
                             "Attaches answered, by outcome (daemon, loading, refused) and error code"),
    "weightcache_publishes": ("counter", SLAB_LABELS + ("outcome", "code"),
                              "Publications answered, by outcome (published, held, refused) and error code"),
    "weightcache_publications_dropped": ("counter", SLAB_LABELS + ("reason",),
                                         ("Publications that left the service, by reason (budget, evict, or the cause "
                                          "of a failed promotion or image load: digest_mismatch...)")),
    "weightcache_notify_dropped": ("counter", GPU_LABELS + ("key",),
                                   "sd_notify datagrams dropped because the service manager's socket was full, by "
                                   "their first key (STATUS, FDSTORE...)"),
    "weightcache_peer_seeds": ("counter", GPU_LABELS + ("model", "outcome", "reason"),
                               ("Peer seeding asked of peers (issue 37), by outcome (seeded; fallback: one per peer "
                                "that did not seed, by reason)")),
    "weightcache_peer_seed_bytes": ("counter", GPU_LABELS + ("model",), "Bytes read from peers into slabs"),
    "weightcache_peer_seed_seconds": ("counter", GPU_LABELS + ("model",), "Seconds of the READs from peers"),
    "weightcache_peer_served": ("counter", GPU_LABELS + ("model", "outcome", "reason"),
                                ("Peer seeding requests answered by this service, by outcome (served, refused, "
                                 "refused_by_peer) and reason")),
    "weightcache_peer_served_bytes": ("counter", GPU_LABELS + ("model",), "Bytes peers read from this service"),
    "weightcache_attach_duration_seconds": ("histogram", GPU_LABELS + ("model",),
                                            "Attach service time, request read to reply queued, seconds"),
}


@dataclass(frozen=True)
class Instance:
    """What is known about one GPU's instance at one scrape.

    Attributes:
        gpu (`int`): the GPU index (the instance name).
        socket_listening (`bool`): ``N.sock`` exists in the socket directory.
        service_state (`str`): one of :data:`UNIT_STATES`.
        status (`ServiceStatus | None`), counters (`ServiceCounters | None`): its
            ``metrics`` reply, when it was asked and answered.
        error (`str`): why an asked instance did not answer (empty otherwise).
        configured_slabs (`int | None`): slabs the configuration places on the GPU
            (0 for one of ``disabled_gpus``); ``None`` when the configuration was not read.
    """

    gpu: int
    socket_listening: bool
    service_state: str
    status: protocol.ServiceStatus | None = None
    counters: protocol.ServiceCounters | None = None
    error: str = ""
    configured_slabs: int | None = None


def _systemd_running() -> bool:
    return os.path.isdir("/run/systemd/system")


def service_states(gpus: list[int], socket_dir: str) -> dict[int, str]:
    """The state of ``weightcache@N.service`` for each GPU, without starting anything.

    See the module docstring for the order: systemd (read-only ``systemctl
    show``), then the ``RuntimeDirectory=`` ``<socket_dir>/N/``, then
    ``unknown`` on a host without systemd.
    """
    if not gpus:
        return {}
    if not _systemd_running():
        return {g: "unknown" for g in gpus}
    units = [f"weightcache@{g}.service" for g in gpus]
    try:
        r = subprocess.run(["systemctl", "show", "--property=Id,ActiveState", "--", *units],
                           capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        r = None
        why = str(e)
    else:
        why = r.stderr.strip()
    states: dict[int, str] = {}
    if r is not None and r.returncode == 0:
        for block in r.stdout.strip().split("\n\n"):
            props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            unit, state = props.get("Id", ""), props.get("ActiveState", "")
            if unit in units and state in UNIT_STATES:
                states[gpus[units.index(unit)]] = state
    if len(states) == len(gpus):
        return states
    log.debug("systemctl show gave no unit states (%s); using the runtime directories", why)
    return {g: states.get(g) or ("active" if os.path.isdir(os.path.join(socket_dir, str(g))) else "inactive")
            for g in gpus}


def collect(socket_dir: str, configured_gpus: Mapping[int, int] | Sequence[int] = (),
            timeout: float = 5.0) -> list[Instance]:
    """Asks every running instance of the node for its metrics; never starts one.

    Args:
        socket_dir (`str`): where the ``N.sock`` sockets are (``/run/weightcache``).
        configured_gpus (`Mapping[int, int] | list[int]`): GPUs the config places models on; as a mapping,
            GPU -> slabs placed there (0 for one of ``disabled_gpus``), which every instance then carries as
            ``configured_slabs`` (0 where the mapping has no entry).
        timeout (`float`): seconds to connect and for each reply, per instance.

    Returns:
        `list[Instance]`: one per GPU, by index.
    """
    listening = set(listening_gpus(socket_dir))
    gpus = sorted(listening | set(configured_gpus))
    states = service_states(gpus, socket_dir)
    counts = configured_gpus if isinstance(configured_gpus, Mapping) else None
    out = []
    for g in gpus:
        state = states.get(g, "unknown")
        placed = None if counts is None else int(counts.get(g, 0))
        if g not in listening or (state not in ASKABLE and state != "unknown"):
            out.append(Instance(g, g in listening, state, configured_slabs=placed))
            continue
        try:
            s = Session(os.path.join(socket_dir, f"{g}.sock"), timeout=timeout, client="weightcache-metrics")
            try:
                status, counters = s.request(protocol.Metrics()).typed()
            finally:
                s.close()
        except WeightcacheError as e:
            log.warning("metrics request failed gpu=%d code=%s error=%s", g, e.code, e.message)
            out.append(Instance(g, True, state, error=f"{e.code}: {e.message}", configured_slabs=placed))
            continue
        out.append(Instance(g, True, state, status, counters, configured_slabs=placed))
    return out


class _Families:
    """One metric family object per name of :data:`FAMILIES`, filled instance by instance."""

    def __init__(self) -> None:
        self.f: dict[str, Metric] = {}
        for name, (kind, labels, text) in FAMILIES.items():
            cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "info": InfoMetricFamily,
                   "histogram": HistogramMetricFamily}[kind]
            lab = list(labels) if kind != "info" else ["gpu"]
            self.f[name] = cls(name, text, labels=lab)

    def add(self, name: str, labels: tuple, value: float) -> None:
        self.f[name].add_metric([str(v) for v in labels], value)


def _add_instance(fam: _Families, inst: Instance) -> None:
    g = str(inst.gpu)
    fam.add("weightcache_socket_listening", (g,), int(inst.socket_listening))
    if inst.configured_slabs is not None:
        fam.add("weightcache_configured_slabs", (g,), inst.configured_slabs)
    for state in UNIT_STATES:
        fam.add("weightcache_service_state", (g, state), int(inst.service_state == state))
    fam.add("weightcache_instance_up", (g,), int(inst.status is not None))
    st, co = inst.status, inst.counters
    if st is None or co is None:
        return
    u = st.device.gpu_uuid
    fam.f["weightcache_build"].add_metric([g], {
        "version": co.version, "protocol_version": str(protocol.PROTOCOL_VERSION), "backend": st.backend,
        "gpu_uuid": st.device.gpu_uuid, "compute_capability": st.device.compute_capability})
    fam.add("weightcache_config_rejected", (g, u), int(st.config_error is not None))
    fam.add("weightcache_start_time_seconds", (g, u), co.started_at)
    fam.add("weightcache_clients", (g, u), st.clients)
    fam.add("weightcache_memory_slab_bytes", (g, u), sum(sl.resident_bytes for sl in st.slabs))
    fam.add("weightcache_memory_free_bytes", (g, u), st.free_bytes)
    fam.add("weightcache_memory_total_bytes", (g, u), st.total_bytes)
    fam.add("weightcache_memory_budget_bytes", (g, u), st.budget_bytes)
    fam.add("weightcache_memory_budget_used_bytes", (g, u), st.gpu_bytes)
    fam.add("weightcache_host_tier_bytes", (g, u), st.host_tier_bytes)
    fam.add("weightcache_host_tier_used_bytes", (g, u), st.host_used_bytes)
    fam.add("weightcache_memory_held_elsewhere_bytes", (g, u), st.held_elsewhere_bytes)
    for sl in st.slabs:
        lab = (g, u, sl.model, sl.tp_size, sl.tp_rank)
        for state in SLAB_STATES:
            fam.add("weightcache_slab_state", lab + (state.value,), int(sl.state is state))
        for tier in SLAB_TIERS:
            fam.add("weightcache_slab_tier", lab + (tier,), int(sl.tier == tier))
        fam.add("weightcache_slab_resident_bytes", lab, sl.resident_bytes)
        fam.add("weightcache_slab_tensors", lab, sl.tensors)
        fam.add("weightcache_slab_leases", lab, sl.lease_count)
        fam.add("weightcache_slab_adopted", lab, int(sl.adopted))
    for sc in co.slabs:
        lab = (g, u, sc.model, sc.tp_size, sc.tp_rank)
        fam.add("weightcache_slab_last_load_duration_seconds", lab, sc.last_load_s)
        fam.add("weightcache_slab_last_load_bytes", lab, sc.last_load_bytes)
        fam.add("weightcache_verify_runs", lab, sc.verify_runs)
        fam.add("weightcache_verify_failures", lab, sc.verify_failures)
    for lc in co.loads:
        fam.add("weightcache_loads", (g, u, lc.model, lc.tp_size, lc.tp_rank, lc.outcome, lc.code, lc.source), lc.count)
    im = co.images or {}  # zeros for a service without images (or an older one)
    for name, field in (("weightcache_images_written", "written"), ("weightcache_image_written_bytes", "written_bytes"),
                        ("weightcache_image_write_seconds", "write_seconds"),
                        ("weightcache_image_write_failures", "write_failures"), ("weightcache_images_read", "read"),
                        ("weightcache_image_read_bytes", "read_bytes"), ("weightcache_image_read_seconds", "read_seconds"),
                        ("weightcache_images_removed", "removed")):
        fam.add(name, (g, u), im.get(field, 0))
    for reason in ("digest", "identity", "key", "layout", "format", "access"):
        fam.add("weightcache_images_rejected", (g, u, reason), (im.get("rejected") or {}).get(reason, 0))
    for ac in co.attaches:
        fam.add("weightcache_attaches", (g, u, ac.model, ac.outcome, ac.code), ac.count)
    for pc in co.publishes:
        fam.add("weightcache_publishes", (g, u, pc.model, pc.tp_size, pc.tp_rank, pc.outcome, pc.code), pc.count)
    for dc in co.publications_dropped:
        fam.add("weightcache_publications_dropped", (g, u, dc.model, dc.tp_size, dc.tp_rank, dc.reason), dc.count)
    for key, n in sorted((co.notify_dropped if isinstance(co.notify_dropped, dict) else {}).items()):
        if isinstance(n, int) and not isinstance(n, bool):
            fam.add("weightcache_notify_dropped", (g, u, str(key)[:64]), n)
    for sc in co.seeds:
        if sc.role == "received":
            fam.add("weightcache_peer_seeds", (g, u, sc.model, sc.outcome, sc.reason), sc.count)
            if sc.outcome == "seeded":
                fam.add("weightcache_peer_seed_bytes", (g, u, sc.model), sc.bytes)
                fam.add("weightcache_peer_seed_seconds", (g, u, sc.model), sc.seconds)
        else:
            fam.add("weightcache_peer_served", (g, u, sc.model, sc.outcome, sc.reason), sc.count)
            if sc.outcome == "served":
                fam.add("weightcache_peer_served_bytes", (g, u, sc.model), sc.bytes)
    for at in co.attach_times:
        cumulative, buckets = 0, []
        for bound, n in zip([*at.bounds_s, float("inf")], at.counts):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        fam.f["weightcache_attach_duration_seconds"].add_metric([g, u, at.model], buckets, at.sum_s)


class NodeCollector:
    """A ``prometheus_client`` collector of the node's instances, as :func:`collect` finds them.

    Args:
        socket_dir (`str`), timeout (`float`): see :func:`collect`.
        configured_gpus (`callable`): ``() -> dict[int, int] | list[int]``, the GPUs
            the config places models on (see :func:`collect`), called at each scrape
            (a long-running endpoint sees a changed config without a restart).
    """

    def __init__(self, socket_dir: str, configured_gpus: Callable[[], Mapping[int, int] | Sequence[int]] = list,
                 timeout: float = 5.0):
        self.socket_dir = socket_dir
        self.configured_gpus = configured_gpus
        self.timeout = timeout

    def collect(self) -> Iterator[Metric]:
        """The families of :data:`FAMILIES` (those with no sample left out)."""
        fam = _Families()
        for inst in collect(self.socket_dir, self.configured_gpus(), self.timeout):
            _add_instance(fam, inst)
        yield from (m for m in fam.f.values() if m.samples)


def registry(socket_dir: str, configured_gpus: Callable[[], Mapping[int, int] | Sequence[int]] = list,
             timeout: float = 5.0) -> CollectorRegistry:
    """A registry holding only :class:`NodeCollector` (no process or platform metrics of the caller)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(NodeCollector(socket_dir, configured_gpus, timeout))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    """The text exposition format (``text/plain; version=0.0.4``) of ``reg``, asking the instances now."""
    return generate_latest(reg)


def write_textfile(path: str, reg: CollectorRegistry) -> None:
    """Writes the exposition to ``path`` atomically (a temporary file renamed over it), for
    node_exporter's textfile collector, which must never read a half-written file."""
    write_to_textfile(path, reg)


__all__ = ["FAMILIES", "GPU_LABELS", "Instance", "NodeCollector", "OUTSIDE", "collect", "exposition", "registry",
           "service_states", "write_textfile"]
