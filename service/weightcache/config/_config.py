"""The TOML configuration: models, their TP layouts, and their placement on GPUs.

Files: ``/etc/weightcache/weightcache.toml`` plus drop-ins
``/etc/weightcache/conf.d/*.toml`` (read in lexical order; a drop-in's
``[models.X]`` table replaces the whole earlier definition of model X, and its
``[service]`` keys override earlier ones). The main path is overridden by
``--config`` or ``$WEIGHTCACHE_CONFIG``; drop-ins are then read from
``conf.d/`` beside it.

Schema (see ``docs/configuration.md`` and ``weightcache.toml(5)``)::

    [service]
    backend = "auto"            # auto | cuda | host
    socket_dir = "/run/weightcache"
    load_timeout_s = 3600       # per model
    memory_budget_bytes = 120000000000  # slabs on this GPU at most (default: device memory less a reserve)
    host_tier_bytes = 0         # host RAM for demoted slabs (0: none; demoted slabs go back to disk)

    [metrics]                   # weightcache-metrics.socket (the generator reads it)
    address = "127.0.0.1"       # an IP address; loopback by default
    port = 9661
    web_config = ""             # Prometheus' web config file (TLS, basic auth); "": plain HTTP

    [models.qwen]
    path = "/srv/models/Qwen2.5-7B-Instruct"   # HF directory of safetensors files
    dtype = "auto"              # auto (as stored) | bfloat16 | float16 | float32
    naming = "hf"               # hf | vllm (fused qkv_proj / gate_up_proj)
    kernel = "cutlass"          # layout target of quantized weights
    allow_users = []            # SO_PEERCRED allow list (empty: the socket's group decides)
    allow_groups = []
    publishers = []             # users whose publications every allowed engine attaches (root, the service user too)
    layouts = [ { tp = 1, gpus = [0] }, { tp = 2, gpus = [2, 3] } ]
    pin = false                 # true: never demoted or evicted by the budget
    priority = 0                # higher stays on the GPU longer (and loads first at start)
    preload = "gpu"             # gpu | host (into the host tier) | disk (loaded at the first attach)
    image = true                # processed images in [service] image_dir (unset: published slabs only)
    max_slab_bytes = 0          # bytes one slab (one rank) of it may take; a larger plan or publication is refused

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client, weightcache.pipeline.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..reader import default_threads
from ..spec import DTYPE_NAMES, LoadRequest, RankRequest
from ..wire import DEFAULT_DTYPE, DEFAULT_KERNEL, DEFAULT_NAMING, NAMINGS
from ._accounts import AccountNames
from ._accounts import resolve as resolve_accounts
from ._files import _commented_header, _drop_ins, _line_of, _locate, _read_toml, resolve_paths

DEFAULT_CONFIG = "/etc/weightcache/weightcache.toml"
BACKENDS = ("auto", "cuda", "host")
#: Highest GPU index a layout may name: CUDA device ordinals of one node (``nvidia-smi`` numbering).
MAX_GPU_INDEX = 1023

_SERVICE_KEYS = {
    "backend": str,
    "socket_dir": str,
    "load_timeout_s": (int, float),
    "staging_bytes": int,
    "read_threads": int,
    "operator_groups": list,
    "disabled_gpus": list,
    "max_unread_replies": int,
    "max_queued_bytes": int,
    "max_held_fds": int,
    "max_buffered_bytes": int,
    "max_connections_per_uid": int,
    "partial_frame_timeout_s": (int, float),
    "memory_budget_bytes": int,
    "host_tier_bytes": int,
    "max_fds_in_flight_per_uid": int,
    "max_leases_per_connection": int,
    "max_leases_per_uid": int,
    "max_connections": int,
    "reload_timeout_s": (int, float),
    "max_tensors_per_checkpoint": int,
    "max_fds_in_flight": int,
    "image_dir": str,
    "image_max_bytes": int,
    "image_write_bytes_per_s": int,
    "image_stop_write_s": (int, float),
    # Peer seeding (issue 37; weightcache.seeding, docs/configuration.md "Peer seeding").
    "peers": list,
    "peers_file": str,
    "seed_secret_file": str,
    "seed_listen": str,
    "seed_transport": str,
    "seed_devices": list,
    "seed_bandwidth_bytes_per_s": int,
    "seed_timeout_s": (int, float),
    "seed_max_transfers": int,
    "seed_max_bytes": int,
    "seed_samples": int,
}
#: Range of each numeric ``[service]`` key: (lower bound, inclusive?, maximum, what it is).
_SERVICE_RANGES: dict[str, tuple[float, bool, float, str]] = {
    "load_timeout_s": (0, False, 30 * 24 * 3600.0, "seconds one model may take to load"),
    "staging_bytes": (2 * 1024 * 1024, True, 1 << 40, "bytes of pinned staging memory"),
    "read_threads": (1, True, 256, "reader threads per checkpoint"),
    "max_unread_replies": (1, True, 65536, "unread replies per connection"),
    "max_queued_bytes": (1024 * 1024, True, 1 << 34, "bytes of unread replies per connection"),
    "max_held_fds": (1, True, 65536, "fds held for one connection"),
    "max_buffered_bytes": (64 * 1024, True, 1 << 34, "bytes of incomplete requests, all connections"),
    "max_connections_per_uid": (1, True, 65536, "connections per uid"),
    "partial_frame_timeout_s": (0, False, 3600.0, "seconds an incomplete request may wait"),
    "memory_budget_bytes": (1024 * 1024, True, 1 << 50, "bytes of slabs on the GPU"),
    "host_tier_bytes": (0, True, 1 << 50, "bytes of host RAM for demoted slabs"),
    "max_fds_in_flight_per_uid": (2, True, 1 << 20, "fds sent to one uid and not yet read"),
    "max_leases_per_connection": (1, True, 1 << 24, "leases per connection"),
    "max_leases_per_uid": (1, True, 1 << 24, "leases per uid"),
    "max_connections": (1, True, 1 << 20, "connections, all uids"),
    "reload_timeout_s": (0, False, 3600.0, "seconds a reload may take to read its files"),
    "max_tensors_per_checkpoint": (1, True, 1 << 24, "tensors in one checkpoint's headers"),
    "max_fds_in_flight": (0, True, 1 << 24, "fds sent to all uids and not yet read (0: half of RLIMIT_NOFILE)"),
    "image_max_bytes": (0, True, 1 << 60, "bytes of the image directory (0: no limit of its own)"),
    "image_write_bytes_per_s": (0, True, 1 << 40, "bytes per second an image write may take (0: no cap)"),
    "image_stop_write_s": (0, True, 3600.0, "seconds a stop lets an image write under way finish (0: none)"),
    "seed_bandwidth_bytes_per_s": (0, True, 1 << 44, "bytes per second of one peer transfer (0: no cap)"),
    "seed_timeout_s": (0, False, 24 * 3600.0, "seconds one peer transfer may take"),
    "seed_max_transfers": (1, True, 1024, "peer transfers served at once"),
    "seed_max_bytes": (0, True, 1 << 50, "bytes registered for peers at once (0: no cap)"),
    "seed_samples": (0, True, 64, "4 KiB samples of tensor data compared with a peer's checkpoint"),
}
#: Transports of ``[service] seed_transport`` (NIXL backends).
SEED_TRANSPORTS = ("UCX", "LIBFABRIC")
#: Keys of ``[metrics]`` (weightcache-metrics.socket's address, the endpoint's web config file).
_METRICS_KEYS = ("address", "port", "web_config")
_MODEL_KEYS = {
    "path", "dtype", "naming", "kernel", "allow_users", "allow_groups", "layouts", "revision",
    "pin", "priority", "preload", "publishers", "image", "max_slab_bytes", "serve_to_peers",
}
#: Where a model's slabs go at start (``[models.X] preload``): the GPU as the budget allows, the host tier, or
#: nowhere (the first attach loads them).
PRELOADS = ("gpu", "host", "disk")
#: Range of ``[models.X] priority``.
PRIORITY_RANGE = (-1000, 1000)
#: Largest ``[models.X] max_slab_bytes`` (as ``memory_budget_bytes``); 0 is no cap.
MAX_SLAB_BYTES_MAX = 1 << 50


@dataclass(frozen=True)
class Layout:
    """A tensor-parallel layout: ``tp`` ranks, rank i on ``gpus[i]``."""

    tp: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig(LoadRequest):
    """One ``[models.NAME]`` table: a :class:`~weightcache.spec.LoadRequest` plus the operator's choices.

    Attributes:
        name (`str`): the table name; engines may attach by it.
        path (`str`): checkpoint directory.
        dtype (`str`): ``auto`` or a dtype name; see :data:`DTYPE_NAMES`.
        naming (`str`): ``hf`` or ``vllm``.
        kernel (`str`): layout target of quantized weights (``cutlass``).
        revision (`str`): the operator's label, part of the cache key.
        allow_users / allow_groups (`tuple[str]`): ``SO_PEERCRED`` allow lists.
        publishers (`tuple[str]`): user names (or numeric uids) whose publications of this model every engine
            on the allow lists attaches (root and the service user are trusted too); with the list set, no one
            else may publish it; without it, anyone on the allow lists may, for its own uid's engines only.
        layouts (`tuple[Layout]`): where the ranks sit.
        source (`str`): the file that defined the model (for error messages).
        pin (`bool`): never demoted or evicted by the memory budget.
        priority (`int`): :data:`PRIORITY_RANGE`; higher stays on the GPU longer and loads first at start.
        preload (`str`): :data:`PRELOADS`; where the slabs go at start.
        image (`bool | None`): write each ready slab to ``[service] image_dir``, and read it back from there
            (before the checkpoint, or for a publication before the engine is asked) when no fd-store entry
            holds it. None (unset): published slabs yes, slabs the service makes no (docs/configuration.md
            says why); :meth:`images_for` answers per kind.
        max_slab_bytes (`int`): bytes one slab of the model (one rank of one layout, holes of a sparse file
            counted at their length) may take on a GPU; a plan or a publication larger is refused
            (:meth:`slab_over_cap`). 0: no cap but the budget (and the size of its first load).
        serve_to_peers (`bool`): peers of the fleet may fetch its slabs from this service (issue 37).
    """

    allow_users: tuple[str, ...] = ()
    allow_groups: tuple[str, ...] = ()
    layouts: tuple[Layout, ...] = (Layout(1, (0,)),)
    source: str = ""
    pin: bool = False
    priority: int = 0
    preload: str = "gpu"
    publishers: tuple[str, ...] = ()
    image: bool | None = None
    max_slab_bytes: int = 0
    #: Peer services of the fleet may fetch this model's slabs from this one (issue 37); off by default.
    serve_to_peers: bool = False

    def images_for(self, published: bool) -> bool:
        """Whether this model's slabs get processed images: ``image`` when set, else published ones only."""
        return published if self.image is None else self.image

    def slab_over_cap(self, slab_bytes: int, label: str) -> str | None:
        """Why a slab of ``slab_bytes`` bytes (slab ``label``) is refused by :attr:`max_slab_bytes`, naming the
        model and the field; None when there is no cap or it fits."""
        if not self.max_slab_bytes or slab_bytes <= self.max_slab_bytes:
            return None
        return (f"model {self.name} ({label}) needs a slab of {slab_bytes} bytes, more than its "
                f"models.{self.name}.max_slab_bytes = {self.max_slab_bytes} (set in {self.source or 'the configuration'}); "
                f"raise it (and reload) if the checkpoint is meant to be this large")


@dataclass(frozen=True)
class Placement(RankRequest):
    """One (model, layout, rank) placed on one GPU: a :class:`~weightcache.spec.RankRequest` of a configured
    model, plus the GPU (the pipeline and the cache key take it as the rank request it is)."""

    model: ModelConfig
    gpu: int

    @property
    def label(self) -> str:
        return f"{self.model.name}/tp{self.tp_size}/rank{self.tp_rank}"

    def to_json(self) -> dict[str, Any]:
        """The placement as a JSON object: the model's fields (layouts as ``[tp, [gpus]]``), rank, GPU."""
        m = self.model
        model = {"name": m.name, "path": m.path, "dtype": m.dtype, "naming": m.naming, "kernel": m.kernel,
                 "revision": m.revision, "allow_users": list(m.allow_users), "allow_groups": list(m.allow_groups),
                 "layouts": [[lay.tp, list(lay.gpus)] for lay in m.layouts], "source": m.source,
                 "pin": m.pin, "priority": m.priority, "preload": m.preload, "publishers": list(m.publishers),
                 "image": m.image, "max_slab_bytes": m.max_slab_bytes}
        return {"model": model, "tp_size": self.tp_size, "tp_rank": self.tp_rank, "gpu": self.gpu}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Placement":
        """Reverses :meth:`to_json`.

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        try:
            m = dict(d["model"])
            layouts = tuple(Layout(int(tp), tuple(int(g) for g in gpus)) for tp, gpus in m.pop("layouts"))
            model = ModelConfig(**{**m, "allow_users": tuple(m["allow_users"]),
                                   "allow_groups": tuple(m["allow_groups"]), "layouts": layouts,
                                   "publishers": tuple(m.get("publishers", ()))})
            return cls(model, int(d["tp_size"]), int(d["tp_rank"]), int(d["gpu"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"stored placement is damaged: {e!r}") from None


@dataclass(frozen=True)
class ServiceConfig:
    """``[service]``: ``backend`` (auto | cuda | host), ``socket_dir``,
    ``load_timeout_s`` (seconds per model), ``staging_bytes`` (pinned staging
    memory of the CUDA loader, bytes), ``read_threads`` (loader threads;
    by default the CPUs the service may run on, 4 to 32:
    :func:`weightcache.reader.default_threads`), ``operator_groups`` (who may
    evict, preload and verify), the per-client caps (``max_*``,
    ``partial_frame_timeout_s``: docs/configuration.md), ``memory_budget_bytes``
    (bytes of slabs on the GPU; None: :func:`default_budget_bytes` of the device)
    and ``host_tier_bytes`` (host RAM for demoted slabs, bytes; 0: no host tier).
    """
    backend: str = "auto"
    socket_dir: str = "/run/weightcache"
    load_timeout_s: float = 3600.0
    staging_bytes: int = 256 * 1024 * 1024
    read_threads: int = field(default_factory=default_threads)
    #: Groups whose members may evict, preload and verify (besides root and the service user).
    operator_groups: tuple[str, ...] = ()
    #: GPUs whose instance weightcache.target does not start (the generator skips their sockets), as
    #: postgresql's start.conf "manual": the per-instance off switch; "systemctl start" by hand still works.
    disabled_gpus: tuple[int, ...] = ()
    #: Per-client caps (see weightcache.daemon.limits.Limits).
    max_unread_replies: int = 64
    max_queued_bytes: int = 16 * 1024 * 1024
    max_held_fds: int = 128
    max_buffered_bytes: int = 16 * 1024 * 1024
    max_connections_per_uid: int = 64
    partial_frame_timeout_s: float = 10.0
    max_fds_in_flight_per_uid: int = 4096
    max_leases_per_connection: int = 256
    max_leases_per_uid: int = 4096
    max_connections: int = 4096
    #: Fds in flight to all uids together; 0: half the service's RLIMIT_NOFILE (issue 38, P11).
    max_fds_in_flight: int = 0
    #: Seconds a reload may take to read its files (on a worker thread) before it is refused.
    reload_timeout_s: float = 30.0
    memory_budget_bytes: int | None = None
    host_tier_bytes: int = 0
    #: Tensors a checkpoint's headers may list, all files together, refused before the plan (issue 38, P12).
    max_tensors_per_checkpoint: int = 150_000
    #: Processed images (issue 36): where they go, the directory's byte limit (0: none of its own), the
    #: rate cap of a write, bytes per second (0: none), and the seconds a stop lets a write under way finish
    #: without the cap (0: abandoned at once; below the unit's TimeoutStopSec=30 with room for the rest).
    image_dir: str = ""
    image_max_bytes: int = 0
    image_write_bytes_per_s: int = 1 << 30
    image_stop_write_s: float = 10.0

    def image_directory(self, environ: Any = None) -> str | None:
        """Where processed images go: ``image_dir``, else ``images`` in the unit's cache directory
        (``$CACHE_DIRECTORY``, which ``CacheDirectory=weightcache`` sets: /var/cache/weightcache/images);
        None when neither is there (a service run by hand keeps no images unless configured)."""
        if self.image_dir:
            return self.image_dir
        cache = (os.environ if environ is None else environ).get("CACHE_DIRECTORY", "").split(":")[0]
        return os.path.join(cache, "images") if os.path.isabs(cache) else None
    #: Peer seeding (issue 37, docs/configuration.md "Peer seeding"): peers' ``host:port``, a peers file a
    #: fleet tool writes, the fleet's secret, this node's listener (port + GPU index), the NIXL transport,
    #: its devices, a bandwidth cap (bytes/s, 0: none), a transfer's timeout and the source's bounds.
    peers: tuple[str, ...] = ()
    peers_file: str = ""
    seed_secret_file: str = "/etc/weightcache/seed.secret"
    seed_listen: str = ""
    seed_transport: str = "UCX"
    seed_devices: tuple[str, ...] = ()
    seed_bandwidth_bytes_per_s: int = 0
    seed_timeout_s: float = 120.0
    seed_max_transfers: int = 4
    seed_max_bytes: int = 0
    seed_samples: int = 8

    def budget_bytes(self, total_bytes: int) -> int:
        """The memory budget in bytes: ``memory_budget_bytes``, else :func:`default_budget_bytes` of ``total_bytes``."""
        return self.memory_budget_bytes if self.memory_budget_bytes is not None else default_budget_bytes(total_bytes)


#: The default budget leaves this share of the device's memory (and at least :data:`BUDGET_RESERVE_MIN_BYTES`,
#: at most half) to what is not a slab: the CUDA contexts, engines' activations and KV caches.
BUDGET_RESERVE_FRACTION = 0.10
BUDGET_RESERVE_MIN_BYTES = 4 << 30


def default_budget_bytes(total_bytes: int) -> int:
    """``[service] memory_budget_bytes`` when unset: the device's memory (GPU memory on the ``cuda``
    backend, ``MemTotal`` of host RAM on the ``host`` backend) less a reserve of 10 %, at least 4 GiB and
    at most half of it.

    Example:
        >>> default_budget_bytes(150_000_000_000)
        135000000000
    """
    reserve = min(max(int(total_bytes * BUDGET_RESERVE_FRACTION), BUDGET_RESERVE_MIN_BYTES), total_bytes // 2)
    return max(0, total_bytes - reserve)


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: where ``weightcache-metrics.socket`` listens (TCP), and how the endpoint answers.

    Attributes:
        address (`str`): an IPv4 or IPv6 address; ``127.0.0.1`` (loopback) by default.
        port (`int`): 1..65535; :data:`DEFAULT_METRICS_PORT` by default.
        web_config (`str`): absolute path of a Prometheus web configuration file (``tls_server_config``,
            ``basic_auth_users``: :mod:`weightcache.metrics_web`); empty (the default): plain HTTP, no
            authentication.
    """

    address: str = "127.0.0.1"
    port: int = 9661
    web_config: str = ""

    @property
    def listen(self) -> str:
        """``ADDRESS:PORT`` as systemd's ``ListenStream=`` takes it (``[ADDRESS]:PORT`` for IPv6)."""
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


DEFAULT_METRICS_PORT = MetricsConfig.port


def _parse_metrics(path: str, table: Any, into: dict[str, Any]) -> None:
    """Checks one file's ``[metrics]`` table and merges it into ``into``.

    Raises:
        ConfigError (`config_invalid`): not a table, an unknown key, an address
            that is not an IP address, a port outside 1..65535.
    """
    if not isinstance(table, dict):
        raise _err(path, "metrics", "must be a table")
    for key, value in table.items():
        if key == "address":
            _check_type(path, "metrics.address", value, str)
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise _err(path, "metrics.address", f"{value!r} is not an IP address; give one the node has, "
                                                     f"e.g. \"127.0.0.1\" (loopback, the default) or \"::1\"") from None
        elif key == "port":
            _check_type(path, "metrics.port", value, int)
            if not 1 <= value <= 65535:
                raise _err(path, "metrics.port", f"{value} is out of range for a TCP port: expected 1..65535 "
                                                  f"(default {DEFAULT_METRICS_PORT})")
        elif key == "web_config":
            _check_type(path, "metrics.web_config", value, str)
            if value:
                _check_absolute(path, "metrics.web_config", value)
        else:
            raise _err(path, f"metrics.{key}", f"unknown key (known: {', '.join(_METRICS_KEYS)})")
        into[key] = value


@dataclass(frozen=True)
class Config:
    """The merged configuration.

    Attributes:
        service (`ServiceConfig`): ``[service]``.
        metrics (`MetricsConfig`): ``[metrics]``.
        models (`dict[str, ModelConfig]`): ``[models.*]`` by name.
        files (`tuple[str]`): files read, in order.
        realpaths (`dict[str, str]`): configured checkpoint path -> its ``os.path.realpath``, resolved
            when the files were read (off the serving loop); see :meth:`realpath_of`.
        names (`AccountNames`): the user and group names of the allow lists and ``operator_groups``,
            resolved to ids when the files were read (off the serving loop; :mod:`weightcache.config`).
    """

    service: ServiceConfig = field(default_factory=ServiceConfig)
    models: dict[str, ModelConfig] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    realpaths: dict[str, str] = field(default_factory=dict)
    names: AccountNames = field(default_factory=AccountNames)

    def realpath_of(self, path: str) -> str:
        """The resolution of configured checkpoint ``path`` recorded when the files were read; ``""`` when
        none was (a config built in code, or a path that could not be resolved). Does no I/O."""
        return self.realpaths.get(path, "")

    def placements(self, gpu: int | None = None) -> list[Placement]:
        """Every (model, layout, rank) on ``gpu`` (all GPUs when ``None``), in config order."""
        out = []
        for m in self.models.values():
            for lay in m.layouts:
                for rank, g in enumerate(lay.gpus):
                    if gpu is None or g == gpu:
                        out.append(Placement(m, lay.tp, rank, g))
        return out

    def gpus(self) -> list[int]:
        """Sorted GPU indices named by any layout."""
        return sorted({p.gpu for p in self.placements()})


def _err(path: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {msg}", file=path, key=key)


def _check_type(path: str, key: str, value: Any, typ) -> None:
    if isinstance(value, bool) and typ is not bool:
        raise _err(path, key, f"expected {getattr(typ, '__name__', typ)}, got a boolean")
    if not isinstance(value, typ):
        want = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise _err(path, key, f"expected {want}, got {type(value).__name__} {value!r}")


def _parse_model(path: str, name: str, table: Any) -> ModelConfig:
    k = f"models.{name}"
    if not isinstance(table, dict):
        raise _err(path, k, "must be a table")
    unknown = set(table) - _MODEL_KEYS
    if unknown:
        raise _err(path, f"{k}.{sorted(unknown)[0]}", f"unknown key (known: {', '.join(sorted(_MODEL_KEYS))})")
    if "path" not in table:
        raise _err(path, f"{k}.path", "missing: the checkpoint directory is required")
    _check_type(path, f"{k}.path", table["path"], str)
    _check_absolute(path, f"{k}.path", table["path"])
    dtype = table.get("dtype", DEFAULT_DTYPE)
    if dtype not in DTYPE_NAMES:
        raise _err(path, f"{k}.dtype", f"{dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    naming = table.get("naming", DEFAULT_NAMING)
    if naming not in NAMINGS:
        raise _err(path, f"{k}.naming", f"{naming!r} is not one of {', '.join(NAMINGS)}")
    kernel = table.get("kernel", DEFAULT_KERNEL)
    _check_type(path, f"{k}.kernel", kernel, str)
    for lk in ("allow_users", "allow_groups", "publishers"):
        v = table.get(lk, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise _err(path, f"{k}.{lk}", "must be a list of strings")
    revision = table.get("revision", "")
    _check_type(path, f"{k}.revision", revision, str)
    pin = table.get("pin", False)
    _check_type(path, f"{k}.pin", pin, bool)
    priority = table.get("priority", 0)
    _check_type(path, f"{k}.priority", priority, int)
    lo, hi = PRIORITY_RANGE
    if not lo <= priority <= hi:
        raise _err(path, f"{k}.priority", f"{priority} is out of range: expected {lo}..{hi} (higher stays longer)")
    image = table.get("image")
    if image is not None:
        _check_type(path, f"{k}.image", image, bool)
    max_slab_bytes = table.get("max_slab_bytes", 0)
    _check_type(path, f"{k}.max_slab_bytes", max_slab_bytes, int)
    if not 0 <= max_slab_bytes <= MAX_SLAB_BYTES_MAX:
        raise _err(path, f"{k}.max_slab_bytes", f"{max_slab_bytes} is out of range: expected 0 (no cap) to "
                                                f"{MAX_SLAB_BYTES_MAX}, bytes one slab of the model may take")
    serve_to_peers = table.get("serve_to_peers", False)
    _check_type(path, f"{k}.serve_to_peers", serve_to_peers, bool)
    preload = table.get("preload", "gpu")
    if preload not in PRELOADS:
        raise _err(path, f"{k}.preload", f"{preload!r} is not one of {', '.join(PRELOADS)}")
    raw_layouts = table.get("layouts", [{"tp": 1, "gpus": [0]}])
    if not isinstance(raw_layouts, list) or not raw_layouts:
        raise _err(path, f"{k}.layouts", "must be a non-empty list of {tp = N, gpus = [...]} tables")
    layouts = []
    for i, lay in enumerate(raw_layouts):
        lk = f"{k}.layouts[{i}]"
        if not isinstance(lay, dict):
            raise _err(path, lk, "must be a table {tp = N, gpus = [...]}")
        unknown = set(lay) - {"tp", "gpus"}
        if unknown:
            raise _err(path, f"{lk}.{sorted(unknown)[0]}", "unknown key (known: tp, gpus)")
        tp = lay.get("tp", 1)
        _check_type(path, f"{lk}.tp", tp, int)
        if tp < 1:
            raise _err(path, f"{lk}.tp", f"must be >= 1, got {tp}")
        gpus = lay.get("gpus", list(range(tp)))
        if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
            raise _err(path, f"{lk}.gpus", f"must be a list of GPU indices (integers 0..{MAX_GPU_INDEX})")
        out_of_range = [g for g in gpus if not 0 <= g <= MAX_GPU_INDEX]
        if out_of_range:
            raise _err(path, f"{lk}.gpus", f"GPU index {out_of_range[0]} is out of range: expected 0..{MAX_GPU_INDEX} "
                                           f"(the node's CUDA device numbers, as `nvidia-smi -L` lists them)")
        if len(gpus) != tp:
            raise _err(path, f"{lk}.gpus", f"lists {len(gpus)} GPUs for tp = {tp}; give one GPU per rank")
        layouts.append(Layout(tp, tuple(gpus)))
    if len(set(layouts)) != len(layouts):
        raise _err(path, f"{k}.layouts", "lists the same layout twice")
    return ModelConfig(
        name=name,
        path=table["path"],
        dtype=dtype,
        naming=naming,
        kernel=kernel,
        allow_users=tuple(table.get("allow_users", [])),
        allow_groups=tuple(table.get("allow_groups", [])),
        publishers=tuple(table.get("publishers", [])),
        layouts=tuple(layouts),
        revision=revision,
        source=path,
        pin=pin,
        priority=priority,
        preload=preload,
        image=image,
        max_slab_bytes=max_slab_bytes,
        serve_to_peers=serve_to_peers,
    )


def _seed_list(path: str, key: str, value: list) -> tuple[str, ...]:
    """``peers`` (``host:port`` each) or ``seed_devices`` (device names) as a tuple, checked."""
    if not all(isinstance(x, str) and x for x in value):
        raise _err(path, f"service.{key}", "must be a list of non-empty strings")
    if key == "peers":
        for x in value:
            _check_address(path, "service.peers", x)
    return tuple(value)


def _check_address(path: str, key: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise _err(path, key, f"{value!r} is not host:port (a port 1..65535; IPv6 as [addr]:port)")


def _check_range(path: str, key: str, value: float) -> None:
    lo, inclusive, hi, what = _SERVICE_RANGES[key.rsplit(".", 1)[-1]]
    if not math.isfinite(value) or not (lo <= value if inclusive else lo < value) or value > hi:
        low = f"at least {_bound(lo)}" if inclusive else f"greater than {_bound(lo)}"
        raise _err(path, key, f"{value!r} is out of range for {what}: expected {low} and at most {_bound(hi)}")


def _bound(v: float) -> str:
    """A range bound as written in TOML: ``2097152``, not ``2.09715e+06``."""
    return str(int(v)) if float(v).is_integer() else repr(v)


def _check_absolute(path: str, key: str, value: str) -> None:
    if "\0" in value:
        raise _err(path, key, f"{value[:200]!r} contains a NUL character (\\u0000); no file can have that name")
    if not os.path.isabs(value):
        raise _err(path, key, f"{value!r} is a relative path; the service does not resolve it against the "
                              f"config file or any working directory: write the absolute path "
                              f"(e.g. {_absolute_example(key, value)!r})")


def _absolute_example(key: str, value: str) -> str:
    """An absolute path to suggest for the relative ``value`` of ``key``: the value with its leading ``/``
    (``srv/models/x`` -> ``/srv/models/x``), ``/srv/models/NAME`` for a bare checkpoint name."""
    if key == "metrics.web_config":
        return os.path.join("/etc/weightcache", os.path.basename(value) or "web-config.yml")
    if not key.endswith(".path"):
        return "/run/weightcache"
    rel = os.path.normpath(value)
    return "/" + rel if os.sep in rel else os.path.join("/srv/models", rel)


def _unknown_table(path: str, text: str, name: str) -> ConfigError:
    line = _line_of(text, name)
    where = f" (line {line})" if line else ""
    if name in _SERVICE_KEYS or name in _MODEL_KEYS:
        table = "[service]" if name in _SERVICE_KEYS else "[models.NAME]"
        header = _commented_header(text, "service" if name in _SERVICE_KEYS else "models", line)
        hint = f"; its {table} header (line {header}) is still commented out: uncomment it too" if header else (
            f"; put it under a {table} header")
        return ConfigError(f"{path}: {name}{where}: {name!r} is a {table} key outside any table{hint}",
                           file=path, key=name, line=line, commented_header_line=header)
    return ConfigError(f"{path}: {name}{where}: unknown table (known: service, models, metrics)", file=path, key=name,
                       line=line)


def config_path(explicit: str | None = None) -> Path:
    """The main config file: ``explicit``, else ``$WEIGHTCACHE_CONFIG``, else the default."""
    return Path(explicit or os.environ.get("WEIGHTCACHE_CONFIG") or DEFAULT_CONFIG)


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Reads and validates the main file and its ``conf.d/*.toml`` drop-ins.

    Args:
        path (`str`, *optional*): main file; see :func:`config_path`.

    Returns:
        `Config`.

    Raises:
        ConfigError (`config_invalid`): a file that is missing, unreadable,
            a directory or not UTF-8; invalid TOML; an unknown or mistyped key,
            a number out of its range, a relative path, an impossible layout
            (a GPU index outside 0..:data:`MAX_GPU_INDEX`),
            a ``[metrics]`` address that is not an IP address or a port outside 1..65535;
            the message names the file and the key
            (``/etc/weightcache/weightcache.toml: models.x.layouts[0].gpus: ...``).
    """
    main = config_path(str(path) if path else None)
    parsed = [(main, *_read_toml(main))]  # the main file's own errors come first
    parsed += [(f, *_read_toml(f)) for f in _drop_ins(main.parent / "conf.d")]
    files = [f for f, _, _ in parsed]
    service: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    models: dict[str, ModelConfig] = {}
    for f, data, text in parsed:
        try:
            _merge(f, data, text, service, metrics, models)
        except ConfigError as e:
            if e.details.get("line") is None and e.details.get("key"):
                e.details["line"] = _locate(text, e.details["key"])
            raise
    _check_host_preloads(service, models, {str(f): text for f, _, text in parsed})
    return Config(service=ServiceConfig(**service), models=models, files=tuple(str(f) for f in files),
                  metrics=MetricsConfig(**metrics), realpaths=resolve_paths(m.path for m in models.values()),
                  names=account_names(service.get("operator_groups", ()), models.values()))


def load_metrics_config(path: str | os.PathLike | None = None) -> MetricsConfig:
    """Only the ``[metrics]`` tables of the main file and its drop-ins, merged as :func:`load_config` merges them.

    The metrics endpoint reads this at start: a mistake elsewhere in the files (a model's key) must not
    decide whether it serves with TLS and authentication, while files it cannot parse must stop it (it
    cannot tell whether ``web_config`` is set). A missing main file is an empty configuration here.

    Raises:
        ConfigError (`config_invalid`): a file that is unreadable or not TOML, a ``[metrics]`` table
            with an unknown or mistyped key (the message names the file and the key).
    """
    main = config_path(str(path) if path else None)
    files = ([main] if main.exists() else []) + _drop_ins(main.parent / "conf.d")
    metrics: dict[str, Any] = {}
    for f in files:
        data, text = _read_toml(f)
        if "metrics" in data:
            try:
                _parse_metrics(str(f), data["metrics"], metrics)
            except ConfigError as e:
                if e.details.get("line") is None and e.details.get("key"):
                    e.details["line"] = _locate(text, e.details["key"])
                raise
    return MetricsConfig(**metrics)


def account_names(operator_groups: Any, models: Any) -> AccountNames:
    """The names of ``operator_groups``, of the ``models``' allow lists and publishers resolved to ids (NSS; where the
    configuration is read, never on the serving loop: :mod:`weightcache.config`)."""
    models = list(models)
    return resolve_accounts([u for m in models for u in (*m.allow_users, *m.publishers)],
                            [*operator_groups, *(g for m in models for g in m.allow_groups)])


def _check_host_preloads(service: dict[str, Any], models: dict[str, ModelConfig], texts: dict[str, str]) -> None:
    """``preload = "host"`` needs a host tier: ``config_invalid`` naming the model's file, line and key otherwise."""
    if service.get("host_tier_bytes", 0) > 0:
        return
    for m in models.values():
        if m.preload == "host":
            key = f"models.{m.name}.preload"
            raise ConfigError(f"{m.source}: {key}: \"host\" needs a host tier, but [service] host_tier_bytes is 0; "
                              f"set host_tier_bytes (bytes of host RAM for demoted slabs) or preload = \"gpu\"",
                              file=m.source, key=key, line=_locate(texts.get(m.source, ""), key))


def _merge(f: Path, data: dict[str, Any], text: str, service: dict[str, Any], metrics: dict[str, Any],
           models: dict[str, ModelConfig]) -> None:
    """Checks one parsed file and merges it into ``service``, ``metrics`` and ``models`` (later files win)."""
    unknown = set(data) - {"service", "models", "metrics"}
    if unknown:
        raise _unknown_table(str(f), text, sorted(unknown)[0])
    svc = data.get("service", {})
    if not isinstance(svc, dict):
        raise _err(str(f), "service", "must be a table")
    for key, value in svc.items():
        if key not in _SERVICE_KEYS:
            raise _err(str(f), f"service.{key}", f"unknown key (known: {', '.join(sorted(_SERVICE_KEYS))})")
        _check_type(str(f), f"service.{key}", value, _SERVICE_KEYS[key])
        if key == "backend" and value not in BACKENDS:
            raise _err(str(f), "service.backend", f"{value!r} is not one of {', '.join(BACKENDS)}")
        if key in _SERVICE_RANGES:
            _check_range(str(f), f"service.{key}", value)
        if key == "socket_dir" or (key == "image_dir" and value):
            _check_absolute(str(f), f"service.{key}", value)
        if key == "operator_groups":
            if not all(isinstance(g, str) and g for g in value):
                raise _err(str(f), "service.operator_groups", "must be a list of group names (non-empty strings)")
            value = tuple(value)
        if key == "disabled_gpus":
            if not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= MAX_GPU_INDEX for g in value):
                raise _err(str(f), "service.disabled_gpus", f"must be a list of GPU indices 0..{MAX_GPU_INDEX}")
            value = tuple(sorted(set(value)))
        if key in ("peers", "seed_devices"):
            value = _seed_list(str(f), key, value)
        if key in ("peers_file", "seed_secret_file") and value:
            _check_absolute(str(f), f"service.{key}", value)
        if key == "seed_transport" and value not in SEED_TRANSPORTS:
            raise _err(str(f), "service.seed_transport", f"{value!r} is not one of {', '.join(SEED_TRANSPORTS)}")
        if key == "seed_listen" and value:
            _check_address(str(f), "service.seed_listen", value)
        service[key] = value
    if "metrics" in data:
        _parse_metrics(str(f), data["metrics"], metrics)
    mtable = data.get("models", {})
    if not isinstance(mtable, dict):
        raise _err(str(f), "models", "must be a table of [models.NAME] tables")
    for name, table in mtable.items():
        models[name] = _parse_model(str(f), name, table)
