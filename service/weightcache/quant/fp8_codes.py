"""FP8 E4M3 (``float8_e4m3fn``) codes in numpy, exactly as torch computes them; no torch.

Requantising an FP8 part from scale ``s`` to the fused scale ``m``
(:func:`weightcache.quant.modelopt_fp8.requantize`: ``clamp(f32(x) * s / m,
±448)`` converted to E4M3, round to nearest even) maps each of the 256 codes
to one code. :func:`requant_table` computes that map once per part from the
two scales with IEEE float32 arithmetic (numpy's ``float32`` multiply and
divide are correctly rounded, as torch's element-wise kernels on CPU and
GPU are) and c10's float-to-E4M3 bit conversion
(``c10/util/Float8_e4m3fn.h``: ``fp8e4m3fn_from_fp32_value``); the load then
applies the table to the part's bytes in place (``bytes.translate`` on a
host slab, a lookup kernel on the GPU, :mod:`weightcache.memory.kernels`).
The tests compare every table with torch's own ``requantize`` over all 256
codes.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import numpy as np

#: Largest finite E4M3 value (the clamp bound of the requantisation).
FP8_E4M3_MAX = 448.0
_U32 = 0xFFFFFFFF


def decode(codes: np.ndarray) -> np.ndarray:
    """E4M3 codes (``uint8``, any shape) -> their ``float32`` values (NaN for ``0x7f``/``0xff``); exact."""
    c = codes.astype(np.uint32)
    sign = np.where(c & 0x80, np.float32(-1.0), np.float32(1.0))
    exp = ((c >> 3) & 0xF).astype(np.int32)
    man = (c & 7).astype(np.float32)
    sub = man * np.float32(2.0 ** -9)
    norm = (np.float32(1.0) + man / np.float32(8.0)) * np.exp2(exp - 7).astype(np.float32)
    v = np.where(exp == 0, sub, norm).astype(np.float32) * sign
    v[(c & 0x7F) == 0x7F] = np.float32("nan")
    return v.astype(np.float32)


def encode(x: np.ndarray) -> np.ndarray:
    """``float32`` values -> E4M3 codes (``uint8``), bit for bit c10's ``fp8e4m3fn_from_fp32_value``.

    Round to nearest even; magnitudes at or above 480 (and NaN, inf) become NaN (``0x7f``, sign kept).
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)
    sign = bits & 0x80000000
    f = bits ^ sign
    nan = f >= (1087 << 20)
    small = f < (121 << 23)
    # Below 2**-6: add 2**14 in float32 (the hardware rounds), take the low bits.
    fs = (f & _U32).astype(np.uint32).view(np.float32) + np.float32(2.0 ** 14)
    res_small = (fs.view(np.uint32).astype(np.int64) - (141 << 23)) & 0xFF
    mant_odd = (f >> 20) & 1
    fn = (f + ((7 - 127) << 23) + 0x7FFFF + mant_odd) & _U32
    res_norm = (fn >> 20) & 0xFF
    res = np.where(nan, 0x7F, np.where(small, res_small, res_norm))
    return (res | (sign >> 24)).astype(np.uint8)


def requant_table(scale: float, new_scale: float) -> bytes:
    """The 256-byte map of every E4M3 code requantised from ``scale`` to ``new_scale``.

    ``table[c] = encode(clamp(decode(c) * f32(scale) / f32(new_scale), -448, 448))``,
    in float32 with the operations in that order (torch's ``requantize``).

    Args:
        scale (`float`), new_scale (`float`): the part's and the fused ``weight_scale`` (float32 values).

    Returns:
        `bytes`: 256 bytes; ``table[0] == 0`` for any positive scales (zero padding stays zero).
    """
    codes = np.arange(256, dtype=np.uint8)
    with np.errstate(all="ignore"):
        dq = decode(codes) * np.float32(scale)
        q = dq / np.float32(new_scale)
        q = np.clip(q, np.float32(-FP8_E4M3_MAX), np.float32(FP8_E4M3_MAX)).astype(np.float32)
    return encode(q).tobytes()
