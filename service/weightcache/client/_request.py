"""What one :func:`weightcache.attach` asks for: its options, the validated request, and the pipeline's request.

Owns :class:`AttachOptions` (the keyword options of ``attach()``, grouped),
:class:`AttachRequest` (model, rank and options, checked once when built:
typed errors that name the argument, before any connection) and
:func:`load_request` (the :class:`~weightcache.spec.LoadRequest` of a
checkpoint directory). :mod:`weightcache.client` re-exports all three.

Forbidden imports: torch, numpy, re (no pattern compiled in an attach), weightcache.pipeline, weightcache.quant,
weightcache.memory, weightcache.daemon, weightcache.config.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

from ._device import physical_gpu
from ..errors import ConfigError
from ..session import resolve_socket_dir
from ..spec import DTYPE_NAMES, LoadRequest, RankRequest
from ..wire import DEFAULT_DTYPE, DEFAULT_KERNEL, DEFAULT_MODE, DEFAULT_NAMING, NAMINGS, AttachMode

__all__ = ["AttachOptions", "AttachRequest", "MAX_TIMEOUT_S", "Retry", "load_request"]

#: The longest ``timeout`` (seconds): a socket timeout past about 9.2e9 s overflows
#: (``OverflowError``, not a typed error, and no fallback).
MAX_TIMEOUT_S = 1e9


def load_request(path: str, dtype: str, naming: str, kernel: str, revision: str = "") -> LoadRequest:
    """The :class:`~weightcache.spec.LoadRequest` of checkpoint directory ``path`` (named after its last component)."""
    return LoadRequest(name=os.path.basename(os.path.normpath(path)) or path, path=path, dtype=dtype,
                       naming=naming, kernel=kernel, revision=revision)


@dataclass(frozen=True)
class Retry:
    """When :func:`attach` asks the service again before it falls back to disk or raises: off unless given.

    An attach caught in a restart of its service instance (``systemctl restart``,
    an upgrade: the service went away with the request, or its socket is not
    bound yet) or refused for a while (a per-client cap, no room in the budget
    until an engine releases a lease) gets an error whose ``retryable`` flag is
    set. With a policy, the attach waits ``backoff_s`` (doubling each time, at
    most ``max_backoff_s``) and sends the whole request again, up to
    ``retries`` times, never past its ``timeout``; each retry is logged at
    WARNING with the error that caused it. ``model_loading`` is not retried
    (the attach already waited for the load for its whole ``timeout``), nor is
    an error whose ``retryable`` flag is clear (``access_denied``,
    ``cache_key_mismatch``, ``model_not_found``...), nor anything when the
    engine's device cannot be set up (``device_error``: every attempt and the
    disk fallback need it).

    Attributes:
        retries (`int`): extra attempts after the first, 1 to 1000.
        backoff_s (`float`): seconds before the first retry, 0 to 60.
        max_backoff_s (`float`): the longest wait between two attempts, ``backoff_s`` to 60.

    Example:
        >>> w = attach("/srv/models/Qwen2.5-7B-Instruct", device="cuda:0", retry=Retry(retries=5))
    """

    retries: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1 is the first): ``backoff_s * 2**(attempt - 1)``,
        at most ``max_backoff_s``."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** min(attempt - 1, 60))

    def problems(self) -> Iterator[str]:
        """What makes this policy unusable, one message per field (none: usable)."""
        if not _is_int(self.retries) or not 1 <= self.retries <= 1000:
            yield f"retry.retries {self.retries!r} must be an integer from 1 to 1000"
        for name in ("backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= 60):
                yield f"retry.{name} {v!r} must be a finite number of seconds from 0 to 60"
                return
        if self.max_backoff_s < self.backoff_s:
            yield f"retry.max_backoff_s {self.max_backoff_s!r} must be at least retry.backoff_s {self.backoff_s!r}"


@dataclass(frozen=True)
class AttachOptions:
    """How to attach: the keyword options of :func:`attach`, grouped (see there for each field).

    Build one per engine and pass it to every rank's :func:`attach` as
    ``options=``; keywords given beside it override its fields. Validated
    when :func:`attach` runs, with the request (:class:`AttachRequest`).

    Example:
        >>> opts = AttachOptions(device="cuda:0", fallback=False, timeout=60.0)
        >>> w = attach("/srv/models/Qwen2.5-7B-Instruct", tp_size=2, tp_rank=0, options=opts)
    """

    device: str = "cpu"
    mode: AttachMode = DEFAULT_MODE
    fallback: bool = True
    timeout: float = 30.0
    socket_dir: str | None = None
    gpu: int | None = None
    dtype: str | None = None
    naming: str | None = None
    kernel: str = DEFAULT_KERNEL
    retry: Retry | None = None


@dataclass(frozen=True)
class AttachRequest:
    """One :func:`attach`: the model and rank with its :class:`AttachOptions`, validated once (see :func:`attach`).

    Attributes:
        model (`str`): checkpoint directory, or a model name from the service's config.
        tp_size, tp_rank (`int`): the layout and this engine's rank.
        device (`str`): ``cpu`` or ``cuda:N``.
        mode (`AttachMode`): ``zero_copy`` or ``copy`` (a string is parsed into the member).
        fallback (`bool`): load from disk when the service cannot serve.
        timeout (`float`): seconds to wait for the service, a load in progress included
            (0 to :data:`MAX_TIMEOUT_S`).
        socket_dir (`str | None`): see :func:`resolve_socket_dir`.
        gpu (`int | None`): the service instance; None: the physical index of ``device`` (``CUDA_VISIBLE_DEVICES`` mapped back).
        dtype, naming (`str | None`): what to ask for. By path: None is ``auto`` and ``hf``
            (:attr:`path_dtype`, :attr:`path_naming`). By name: None takes what the operator
            configured; a value given must be what the service holds for that name.
        kernel (`str`): the kernel layout target of quantized weights (checked against a local checkpoint).
        retry (`Retry | None`): when to ask the service again before falling back or raising; None: never.

    Raises:
        ValueError: ``mode`` is not ``zero_copy`` or ``copy``.
        ConfigError (`config_invalid`): another field no service could accept;
            ``details["key"]`` names it.
    """

    model: str
    tp_size: int
    tp_rank: int
    device: str
    mode: AttachMode
    fallback: bool
    timeout: float
    socket_dir: str | None
    gpu: int | None
    dtype: str | None
    naming: str | None
    kernel: str
    retry: Retry | None = None

    @classmethod
    def of(cls, model: str, tp_size: int, tp_rank: int, options: AttachOptions) -> AttachRequest:
        """The request for ``model``'s rank ``tp_rank`` of ``tp_size`` with ``options``."""
        return cls(model, tp_size, tp_rank, **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})

    def __post_init__(self) -> None:
        try:  # the engine's API raises ValueError (documented); the wire message parses the same enum
            object.__setattr__(self, "mode", AttachMode(self.mode))
        except ValueError:
            raise ValueError(f"mode must be one of {', '.join(repr(m.value) for m in AttachMode)}, "
                             f"got {self.mode!r}") from None
        # A pathlib.Path, a torch.device or a torch.dtype is as good as its string.
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if not isinstance(self.device, str) and type(self.device).__name__ == "device":
            object.__setattr__(self, "device", str(self.device))
        if type(self.dtype).__name__ == "dtype" and type(self.dtype).__module__ == "torch":
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))  # torch.bfloat16 -> bfloat16
        for problem, key in _arg_problems(self):
            raise ConfigError(f"attach(): {problem}", key=key)

    @property
    def socket_path(self) -> str:
        """The service's socket: ``<socket dir>/<gpu>.sock``, ``gpu`` defaulting to the physical index of ``device``."""
        gpu = self.gpu
        if gpu is None:  # ``cuda`` is device 0 of the process, as local_backend() maps it
            gpu = (physical_gpu(int(self.device.partition(":")[2] or 0), os.environ.get("CUDA_VISIBLE_DEVICES"))
                   if self.device.startswith("cuda") else 0)
        return os.path.join(resolve_socket_dir(self.socket_dir), f"{gpu}.sock")

    @property
    def path_dtype(self) -> str:
        """The dtype asked for by path: the one given, else ``auto`` (as stored)."""
        return self.dtype or DEFAULT_DTYPE

    @property
    def path_naming(self) -> str:
        """The naming asked for by path: the one given, else ``hf`` (as in the checkpoint)."""
        return self.naming or DEFAULT_NAMING

    def load_request(self, path: str, dtype: str | None = None, naming: str | None = None,
                     kernel: str | None = None, revision: str = "") -> LoadRequest:
        """What the pipeline needs for checkpoint ``path``: this request's choices unless overridden."""
        return load_request(path, dtype or self.path_dtype, naming or self.path_naming, kernel or self.kernel,
                            revision)

    def rank_request(self, path: str) -> RankRequest:
        """This engine's :class:`~weightcache.spec.RankRequest` for checkpoint ``path``."""
        return RankRequest(self.load_request(path), self.tp_size, self.tp_rank)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_device(v: Any) -> bool:
    """``v`` is ``cpu``, ``cuda`` or ``cuda:N`` (ASCII digits): what ``re.fullmatch(r"cpu|cuda(:[0-9]+)?", v)``
    accepts, without compiling a pattern in the first attach of a process."""
    if not isinstance(v, str):
        return False
    index = v[5:]
    return v in ("cpu", "cuda") or (v.startswith("cuda:") and index.isascii() and index.isdigit())


def _arg_problems(req: AttachRequest) -> Iterator[tuple[str, str]]:
    """``(message, key)`` for each argument of ``req`` that no service or disk load could accept."""
    if not isinstance(req.model, str) or not req.model or "\0" in req.model:
        yield f"model {req.model!r} must be a checkpoint directory or a configured model name", "model"
    if not _is_int(req.tp_size) or req.tp_size < 1:
        yield f"tp_size {req.tp_size!r} must be an integer >= 1", "tp_size"
    elif not _is_int(req.tp_rank) or not 0 <= req.tp_rank < req.tp_size:
        yield f"tp_rank {req.tp_rank!r} must be an integer in [0, {req.tp_size}) for tp_size={req.tp_size}", "tp_rank"
    if not _is_device(req.device):
        yield f"device {req.device!r} must be 'cpu', 'cuda' or 'cuda:N'", "device"
    if isinstance(req.timeout, bool) or not isinstance(req.timeout, (int, float)) or not (
            math.isfinite(req.timeout) and 0 <= req.timeout <= MAX_TIMEOUT_S):
        yield (f"timeout {req.timeout!r} must be a finite number of seconds from 0 to {MAX_TIMEOUT_S:.0e} "
               f"(about 31 years)"), "timeout"
    if req.gpu is not None and (not _is_int(req.gpu) or req.gpu < 0):
        yield f"gpu {req.gpu!r} must be a GPU index (an integer >= 0) or None", "gpu"
    if req.dtype is not None and req.dtype not in DTYPE_NAMES:
        yield f"dtype {req.dtype!r} is not one of {', '.join(DTYPE_NAMES)}", "dtype"
    if req.naming is not None and req.naming not in NAMINGS:
        yield f"naming {req.naming!r} is not one of {', '.join(NAMINGS)}", "naming"
    if not isinstance(req.kernel, str):
        yield f"kernel {req.kernel!r} must be a string such as 'cutlass'", "kernel"
    if req.retry is not None:
        if not isinstance(req.retry, Retry):
            yield f"retry {req.retry!r} must be a weightcache.Retry policy or None", "retry"
        else:
            for problem in req.retry.problems():
                yield problem, "retry"
