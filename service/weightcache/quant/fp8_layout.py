"""The manifest layout of ModelOpt FP8 records, as frozen records read by attribute.

The processing (:mod:`weightcache.quant.modelopt_fp8`) writes a weight's
layout with :meth:`Fp8WeightLayout.merged` and a scale's with
:meth:`Fp8ScaleLayout.to_json`; the inverse (``checkpoint_form``) and engine
code read them back with :func:`layout_of`. The JSON keys, their order and
values are those of ``docs/quantization.md`` section 4 (the manifest bytes of
earlier releases).

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ManifestInvalid

#: The scheme names whose layouts these records describe (per tensor, per channel).
SCHEMES = ("modelopt_fp8", "modelopt_fp8_per_channel")

#: The ops of the ModelOpt FP8 family (a spec's ``op``), run by :mod:`weightcache.quant.modelopt_fp8` and
#: placed torch-free by :mod:`weightcache.quant.modelopt_fp8_placement`.
OP_WEIGHT = "modelopt_fp8_weight"
OP_WEIGHT_SCALE = "modelopt_fp8_weight_scale"
OP_INPUT_SCALE = "modelopt_fp8_input_scale"
#: Value the padded tail of a per-channel ``weight_scale`` is filled with. The
#: padded weight rows are zero, so any finite scale gives exactly 0 there; 1.0
#: (not 0) keeps every scale positive and invertible for engines that divide.
SCALE_PAD_VALUE = 1.0


@dataclass(frozen=True)
class Fp8WeightLayout:
    """The manifest layout of a processed FP8 weight, as a record (``docs/quantization.md`` section 4).

    The manifest carries it as the JSON object :meth:`to_json` writes (merged
    into the record's sharding layout); :meth:`from_layout` reads it back.

    Attributes:
        scheme (`str`): ``modelopt_fp8`` or ``modelopt_fp8_per_channel``.
        kernel (`str`): the kernel layout target (``cutlass``).
        unpadded_shape (`tuple[int, int]`): this rank's ``(N, K)`` before padding.
        stored_shape (`tuple[int, int]`): ``(N_pad, K_pad)`` of the stored row-major bytes.
        scale_granularity (`str`): ``tensor`` or ``channel``.
        activation_scheme (`str`): ``static_tensor`` or ``dynamic_token``.
        weight_scale (`str`): name of the matching ``weight_scale`` record.
        input_scale (`str | None`): name of the ``input_scale`` record (``None`` per token).
        fused_scale (`str | None`): ``max`` when fused per-tensor parts were requantized to the largest scale.
        logical_shape (`tuple[int, ...]`): the checkpoint tensor's ``(N, K)``
            (sharding's whole-tensor shape when sharded).
    """

    scheme: str
    kernel: str
    unpadded_shape: tuple[int, int]
    stored_shape: tuple[int, int]
    scale_granularity: str
    activation_scheme: str
    weight_scale: str
    input_scale: str | None
    fused_scale: str | None
    logical_shape: tuple[int, ...]

    #: The engine-facing view is the stored data transposed.
    view = "transpose"

    @property
    def logical_output_width(self) -> int:
        """``N``: slice the kernel's output ``[:, :N]``."""
        return self.unpadded_shape[0]

    @property
    def logical_input_width(self) -> int:
        """``K``: pad activations with zeros from ``K`` to ``K_pad``."""
        return self.unpadded_shape[1]

    @property
    def view_shape(self) -> tuple[int, int]:
        """``(K_pad, N_pad)``, the engine-facing shape."""
        return (self.stored_shape[1], self.stored_shape[0])

    @property
    def view_stride(self) -> tuple[int, int]:
        """``(1, K_pad)``: column-major, in elements."""
        return (1, self.stored_shape[1])

    @property
    def padding(self) -> dict[str, int]:
        """Zero rows (``output``) and columns (``input``) added."""
        return {"output": self.stored_shape[0] - self.unpadded_shape[0],
                "input": self.stored_shape[1] - self.unpadded_shape[1]}

    def to_json(self) -> dict[str, Any]:
        """The FP8 keys of the manifest layout, in their manifest order (``logical_shape`` excepted)."""
        n, k = self.unpadded_shape
        n_pad, k_pad = self.stored_shape
        return {"scheme": self.scheme, "kernel": self.kernel, "unpadded_shape": [n, k],
                "stored_shape": [n_pad, k_pad], "view_shape": list(self.view_shape),
                "view_stride": list(self.view_stride), "view": self.view,
                "processed_dims": {"input": 0, "output": 1}, "padding": self.padding,
                "logical_output_width": n, "logical_input_width": k,
                "scale_granularity": self.scale_granularity, "activation_scheme": self.activation_scheme,
                "weight_scale": self.weight_scale, "input_scale": self.input_scale, "fused_scale": self.fused_scale}

    def merged(self, sharding_layout: Mapping[str, Any]) -> dict[str, Any]:
        """The record's whole manifest layout: sharding's keys, then :meth:`to_json`'s, then ``logical_shape``
        (in sharding's place when it had one)."""
        layout = dict(sharding_layout)
        layout.update(self.to_json())
        layout["logical_shape"] = list(self.logical_shape)
        return layout

    @classmethod
    def from_layout(cls, layout: Mapping[str, Any]) -> "Fp8WeightLayout":
        """Reads a weight's manifest layout.

        Raises:
            ManifestInvalid (`manifest_invalid`): a key missing or malformed, or a view other than ``transpose``.
        """
        try:
            n, k = (int(x) for x in layout["unpadded_shape"])
            n_pad, k_pad = (int(x) for x in layout["stored_shape"])
            if layout["view"] != cls.view:
                raise ValueError(f"view {layout['view']!r}")
            return cls(str(layout["scheme"]), str(layout["kernel"]), (n, k), (n_pad, k_pad),
                       str(layout["scale_granularity"]), str(layout["activation_scheme"]), str(layout["weight_scale"]),
                       layout["input_scale"], layout["fused_scale"], tuple(int(x) for x in layout["logical_shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestInvalid(f"FP8 weight layout {dict(layout)!r:.300} is malformed: {e!r}",
                                  section="layouts") from None


@dataclass(frozen=True)
class Fp8ScaleLayout:
    """The manifest layout of a processed FP8 scale record.

    Attributes:
        scheme (`str`), kernel (`str`): as the weight's.
        role (`str`): ``weight_scale`` or ``input_scale``.
        weight (`str`): the weight record the scale belongs to.
        scale_granularity (`str`): ``tensor`` or ``channel``.
        logical_output_width (`int | None`): ``N`` (``weight_scale`` only).
        pad_output (`int | None`): padded tail length of a per-channel
            ``[1, N_pad]`` scale, filled with ``pad_value``; ``None`` otherwise.
        pad_value (`float | None`): :data:`SCALE_PAD_VALUE` (1.0) for a per-channel scale.
    """

    scheme: str
    kernel: str
    role: str
    weight: str
    scale_granularity: str
    logical_output_width: int | None = None
    pad_output: int | None = None
    pad_value: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The manifest layout, in manifest order."""
        out: dict[str, Any] = {"scheme": self.scheme, "kernel": self.kernel, "role": self.role, "weight": self.weight,
                               "scale_granularity": self.scale_granularity}
        if self.logical_output_width is not None:
            out["logical_output_width"] = self.logical_output_width
        if self.pad_output is not None:
            out.update({"padding": {"output": self.pad_output}, "pad_value": self.pad_value})
        return out

    @classmethod
    def from_layout(cls, layout: Mapping[str, Any]) -> "Fp8ScaleLayout":
        """Reads a scale's manifest layout.

        Raises:
            ManifestInvalid (`manifest_invalid`): a key missing or malformed.
        """
        try:
            width = layout.get("logical_output_width")
            pad = layout["padding"]["output"] if "padding" in layout else None
            return cls(str(layout["scheme"]), str(layout["kernel"]), str(layout["role"]), str(layout["weight"]),
                       str(layout["scale_granularity"]), None if width is None else int(width),
                       None if pad is None else int(pad), layout.get("pad_value"))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestInvalid(f"FP8 scale layout {dict(layout)!r:.300} is malformed: {e!r}",
                                  section="layouts") from None


def layout_of(layout: Mapping[str, Any]) -> Fp8WeightLayout | Fp8ScaleLayout | None:
    """The FP8 record of a manifest layout: a scale's (it has ``role``), a weight's (``view``), or ``None``.

    Raises:
        ManifestInvalid (`manifest_invalid`): an FP8 layout that is malformed.
    """
    if layout.get("scheme") not in SCHEMES:
        return None
    if "role" in layout:
        return Fp8ScaleLayout.from_layout(layout)
    if "view" in layout:
        return Fp8WeightLayout.from_layout(layout)
    return None
