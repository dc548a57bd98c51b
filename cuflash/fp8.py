"""FP8 inputs: quantization with descale factors, and the rotation that spreads outliers.

FP8 values travel as uint8 arrays holding the bits of float8 e4m3 (``"e4m3"``: 4 exponent bits,
3 mantissa bits, largest finite 448, no infinity) or e5m2 (``"e5m2"``: 5 and 2, largest finite
57344), the encodings of ml_dtypes' ``float8_e4m3fn`` / ``float8_e5m2`` and of CUDA's
``__nv_fp8_e4m3`` / ``__nv_fp8_e5m2``. A quantized tensor is ``(bits, descale)`` with
``x ≈ float(bits) * descale``, the descale broadcast per tensor, per (batch, head) or per
(batch, head, block of rows).

Every function takes NumPy or CuPy arrays and computes with the array's own module: the
rounding is written with elementwise float32 and integer operations (round to nearest even,
saturating), not with a float8 dtype, which CuPy does not have.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GRANULARITIES = ("tensor", "head", "block")


@dataclass(frozen=True)
class Fp8Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float        # largest finite value
    nan_code: int     # the code (sign bit clear) a NaN becomes

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def subnormal_step(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)


FORMATS = {
    "e4m3": Fp8Format("e4m3", 4, 3, 7, 448.0, 0x7F),
    "e5m2": Fp8Format("e5m2", 5, 2, 15, 57344.0, 0x7E),
}


def fp8_format(name: str) -> Fp8Format:
    if name not in FORMATS:
        raise ValueError(f"fp8_format={name!r} is not supported; choose one of {sorted(FORMATS)}")
    return FORMATS[name]


def _xp(x):
    """The array module of ``x`` (CuPy for CuPy arrays, else NumPy)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def to_fp8_bits(x, format: str = "e4m3"):
    """float -> uint8 FP8 codes, rounding to nearest even and saturating: values beyond the
    largest finite one (infinities included) become ±max; NaN stays NaN."""
    fmt = fp8_format(format)
    xp = _xp(x)
    x = xp.asarray(x, dtype=xp.float32)
    nan = xp.isnan(x)
    a = xp.where(nan, xp.float32(0), xp.minimum(xp.abs(x), xp.float32(fmt.max)))
    m = fmt.mantissa_bits
    # Normal range: round float32's 23-bit mantissa to m bits on the integer bit pattern (the
    # carry moves into the exponent), then rebias the exponent.
    bits = a.view(xp.uint32)
    shift = 23 - m
    rounded = (bits + xp.uint32((1 << (shift - 1)) - 1) + ((bits >> shift) & xp.uint32(1))) >> shift
    normal = rounded.astype(xp.int32) - ((127 - fmt.bias) << m)
    # Subnormal range: multiples of the smallest step, rint rounds half to even; the top value
    # (2^m steps) is the smallest normal, whose code is 1 << m, so both ranges meet exactly.
    tiny = xp.minimum(a, xp.float32(fmt.min_normal))
    sub = xp.rint(tiny / xp.float32(fmt.subnormal_step)).astype(xp.int32)
    code = xp.where(a < xp.float32(fmt.min_normal), sub, normal)
    code = xp.where(nan, fmt.nan_code, code)
    return (code | xp.where(xp.signbit(x), 0x80, 0)).astype(xp.uint8)


def from_fp8_bits(bits, format: str = "e4m3"):
    """uint8 FP8 codes -> float32 (NaN codes to NaN; e5m2's infinity codes to ±inf)."""
    fmt = fp8_format(format)
    xp = _xp(bits)
    bits = xp.asarray(bits).astype(xp.int32)
    m = fmt.mantissa_bits
    magnitude = bits & 0x7F
    exponent = magnitude >> m
    mantissa = (magnitude & ((1 << m) - 1)).astype(xp.float32)
    normal = (1 + mantissa / (1 << m)) * xp.exp2((exponent - fmt.bias).astype(xp.float32))
    value = xp.where(exponent == 0, mantissa * xp.float32(fmt.subnormal_step), normal).astype(xp.float32)
    if fmt.name == "e4m3":
        value = xp.where(magnitude == 0x7F, xp.float32(np.nan), value)
    else:
        value = xp.where(magnitude == 0x7C, xp.float32(np.inf), value)
        value = xp.where(magnitude > 0x7C, xp.float32(np.nan), value)
    return xp.where(bits & 0x80, -value, value).astype(xp.float32)


def _groups(x, granularity: str, layout: str, block: int):
    """x viewed as [batch, heads, groups, rows per group * head_dim] (bhsd order, padded rows
    are NaN-free zeros), and the shape of its descale."""
    xp = _xp(x)
    if x.ndim != 4:
        raise ValueError(f"x must be 4-d ({layout}), got shape {x.shape}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout={layout!r} is not supported; use 'bhsd' or 'bshd'")
    xb = x if layout == "bhsd" else x.transpose(0, 2, 1, 3)
    b, h, s, d = xb.shape
    if granularity == "tensor":
        return xb.reshape(1, 1, 1, -1), ()
    if granularity == "head":
        return xb.reshape(b, h, 1, s * d), (b, h)
    if granularity == "block":
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block={block!r} must be a positive number of rows")
        n = max(1, math.ceil(s / block))
        padded = xp.zeros((b, h, n * block, d), dtype=xp.float32)
        padded[:, :, :s] = xb
        return padded.reshape(b, h, n, block * d), (b, h, n)
    raise ValueError(f"granularity={granularity!r} is not supported; choose one of {GRANULARITIES}")


def _expand(descale, granularity: str, shape_bhsd, block: int):
    """The descale broadcast to [batch, heads, seqlen, 1] (bhsd order)."""
    xp = _xp(descale)
    b, h, s, _ = shape_bhsd
    if granularity == "tensor":
        return descale.reshape(1, 1, 1, 1)
    if granularity == "head":
        return descale.reshape(b, h, 1, 1)
    return xp.repeat(descale, block, axis=2)[:, :, :s, None]


def quantize_fp8(x, format: str = "e4m3", granularity: str = "tensor", *, layout: str = "bhsd",
                 block: int = 128, rotation=None):
    """Quantize a [batch, heads, seqlen, head_dim] (or ``layout="bshd"``) array to FP8.

    Args:
        x: float16, bfloat16 or float32 NumPy or CuPy array.
        format: ``"e4m3"`` or ``"e5m2"``.
        granularity: one descale for the whole tensor (``"tensor"``), per (batch, head)
            (``"head"``), or per (batch, head, ``block`` consecutive rows) (``"block"``).
        rotation: optional [head_dim, head_dim] orthogonal matrix applied as ``x @ rotation``
            before quantizing (see :func:`random_rotation`); give q and k the same one, which
            leaves ``q kᵀ`` unchanged while spreading outliers over the head dim.

    Returns:
        ``(bits, descale)``: uint8 codes shaped like x, and float32 descale factors shaped
        ``()``, ``(batch, heads)`` or ``(batch, heads, ceil(seqlen / block))``, with
        ``x ≈ from_fp8_bits(bits) * descale``. Each group's largest magnitude maps to the format's
        largest finite value; an all-zero group gets descale 1. Values saturate, NaN stays NaN.
    """
    fmt = fp8_format(format)
    xp = _xp(x)
    x = xp.asarray(x).astype(xp.float32)
    if rotation is not None:
        rotation = xp.asarray(rotation, dtype=xp.float32)
        if rotation.shape != (x.shape[-1], x.shape[-1]):
            raise ValueError(f"rotation.shape={rotation.shape} must be (head_dim, head_dim) = "
                             f"{(x.shape[-1], x.shape[-1])}")
        x = x @ rotation
    grouped, descale_shape = _groups(x, granularity, layout, block)
    amax = xp.max(xp.where(xp.isfinite(grouped), xp.abs(grouped), 0), axis=-1)
    descale = xp.where(amax > 0, amax / xp.float32(fmt.max), 1).astype(xp.float32)
    descale = descale.reshape(descale_shape)
    xb = x if layout == "bhsd" else x.transpose(0, 2, 1, 3)
    bits = to_fp8_bits(xb / _expand(descale, granularity, xb.shape, block), format)
    if layout == "bshd":
        bits = bits.transpose(0, 2, 1, 3)
    return xp.ascontiguousarray(bits), descale


def dequantize_fp8(bits, descale, format: str = "e4m3", granularity: str = "tensor", *,
                   layout: str = "bhsd", block: int = 128):
    """float32 values of a quantized tensor: ``from_fp8_bits(bits) * descale`` (broadcast)."""
    xp = _xp(bits)
    values = from_fp8_bits(bits, format)
    vb = values if layout == "bhsd" else values.transpose(0, 2, 1, 3)
    out = vb * _expand(xp.asarray(descale, dtype=xp.float32), granularity, vb.shape, block)
    return out if layout == "bhsd" else out.transpose(0, 2, 1, 3)


def random_rotation(head_dim: int, seed: int = 0, xp=np):
    """A [head_dim, head_dim] float32 orthogonal matrix: a Hadamard matrix with random column
    signs, scaled by 1/sqrt(head_dim), where head_dim is a power of two; else the Q factor of a
    Gaussian matrix. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        matrix = h * rng.choice([-1.0, 1.0], size=head_dim)[None, :] / math.sqrt(head_dim)
    else:
        matrix, _ = np.linalg.qr(rng.standard_normal((head_dim, head_dim)))
    return xp.asarray(matrix.astype(np.float32))


#: Keys of V^T are grouped by 16 in the kernel's operand (see :func:`v_operand`).
V_KEY_GROUP = 16


def v_operand(v, layout: str = "bhsd"):
    """V's FP8 codes laid out as the Hopper FP8 kernel reads them: V^T, [batch, heads_k,
    head_dim, keys], keys padded with zero codes to a multiple of 16 and, within each 16, in the
    order 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15.

    FP8 matrix products read both operands K-major, so P V needs V with the keys contiguous.
    The order inside each 16 keys is the one in which a thread's softmax probabilities already
    sit as the A operand (slot 4t + 2b + e holds key 8b + 2t + e), so they need no exchange
    between threads; the sum over keys does not depend on their order. One pass over V (on a
    CuPy array, by a small kernel, templates/include/cuflash/fp8_v.cuh).
    """
    xp = _xp(v)
    if xp is not np and v.shape[3] % 16 == 0:
        return _v_operand_device(v, layout)
    vb = v if layout == "bhsd" else v.transpose(0, 2, 1, 3)
    b, h, s, d = vb.shape
    padded = -(-s // V_KEY_GROUP) * V_KEY_GROUP
    if padded != s:
        full = xp.zeros((b, h, padded, d), dtype=xp.uint8)
        full[:, :, :s] = vb
        vb = full
    # key = 16 c + 8 b' + 2 t + e  ->  slot = 16 c + 4 t + 2 b' + e
    grouped = vb.reshape(b, h, padded // 16, 2, 4, 2, d)          # (.., c, b', t, e, d)
    out = xp.ascontiguousarray(grouped.transpose(0, 1, 6, 2, 4, 3, 5))  # (.., d, c, t, b', e)
    return out.reshape(b, h, d, padded)


def _v_operand_device(v, layout: str):
    import cupy

    from .core.compile import arch_options, device_arch
    from .core.validate import aligned_copy, aligned_for_async_copy

    vb = v if layout == "bhsd" else v.transpose(0, 2, 1, 3)
    b, h, s, d = vb.shape  # d is a multiple of 16 (v_operand)
    if not aligned_for_async_copy(vb):
        vb = aligned_copy(vb)
    padded = -(-s // V_KEY_GROUP) * V_KEY_GROUP
    out = cupy.empty((b, h, d, padded), dtype=cupy.uint8)
    if out.size == 0:
        return out
    device = vb.data.device_id
    kernel = _V_KERNELS.get(device)
    if kernel is None:
        module = cupy.RawModule(code='#include "cuflash/fp8_v.cuh"\n', options=arch_options(device_arch(device)))
        kernel = _V_KERNELS[device] = module.get_function("cuflash_fp8_v_operand")
    blocks = -(-padded // 128) * -(-d // 128) * b * h  # 128 keys by 128 columns each (fp8_v.cuh)
    kernel((blocks,), (256,),
           (vb, out, np.int32(h), np.int32(s), np.int32(d), np.int32(padded),
            np.int64(vb.strides[0]), np.int64(vb.strides[1]), np.int64(vb.strides[2])))
    return out


_V_KERNELS: dict = {}


@dataclass(frozen=True, eq=False)
class PreparedV:
    """V's FP8 codes already in the Hopper FP8 kernel's layout (:func:`v_operand`), made once by
    :func:`prepare_v` and passed to :func:`cuflash.attention` as ``v``: a KV cache kept this way
    skips the per-call rearrangement (one pass over all of V). ``shape`` and ``layout`` are the
    original V's; ``data`` is the V^T array, uint8 [batch, heads_k, head_dim, keys padded to 16]."""

    data: object
    shape: tuple
    layout: str

    def stand_in(self):
        """A view shaped like the original V over ``data`` (for validation only: its bytes are
        not V's)."""
        from cupy.lib.stride_tricks import as_strided

        return as_strided(self.data, shape=self.shape, strides=(0, 0, 0, 1))


def prepare_v(v, layout: str = "bhsd") -> PreparedV:
    """V's FP8 codes (a uint8 or int8 CuPy array in ``layout``) rearranged once into the layout
    the Hopper FP8 kernel reads, for repeated calls of :func:`cuflash.attention` with
    ``fp8_format`` set (on sm_90a, head dims that are multiples of 16 from 32; other calls need V
    itself)."""
    import cupy

    if not isinstance(v, cupy.ndarray) or v.dtype.itemsize != 1 or v.ndim != 4:
        raise TypeError(f"prepare_v takes a 4-d CuPy array of FP8 codes (uint8 or int8); got "
                        f"{type(v).__name__} {getattr(v, 'dtype', '')} {getattr(v, 'shape', '')}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout={layout!r} is not supported; use 'bhsd' or 'bshd'")
    v = v.view(cupy.uint8)
    if v.size and v.strides[-1] != 1:
        raise ValueError(f"v must be contiguous in its last dim; got v.strides={v.strides}")
    return PreparedV(v_operand(v, layout), tuple(v.shape), layout)


__all__ = ["FORMATS", "v_operand", "prepare_v", "PreparedV", "GRANULARITIES", "quantize_fp8", "dequantize_fp8", "to_fp8_bits", "from_fp8_bits",
           "random_rotation"]
