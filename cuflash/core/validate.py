"""Validation: user arrays -> a checked :class:`Problem`, or a ValueError/TypeError naming the values.

Nothing past this module checks user input again; everything after it may trust a Problem.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import dtypes
from .spec import HEAD_DIMS

LAYOUTS = ("bhsd", "bshd")
_INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
#: The largest float32: scales, caps and descales reach the kernels as float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def real_number(value) -> bool:
    """Whether value is a Python or NumPy real number (a bool is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def float32_number(name: str, value, *, positive: bool = False) -> float:
    """value as a float: a real number finite in float32 (and above 0 where positive), else
    TypeError / ValueError naming it."""
    if not real_number(value):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    low = 0 < value if positive else -FLOAT32_MAX <= value
    if not (low and value <= FLOAT32_MAX):
        what = "positive and finite" if positive else "finite"
        raise ValueError(f"{name}={value!r} must be {what} in float32 (|{name}| <= {FLOAT32_MAX:.4g})")
    return value


@dataclass(slots=True)
class Problem:
    """A validated attention call, in the kernel's terms (strides in elements, bhsd order).

    Read-only by convention (not frozen: a frozen dataclass costs microseconds per call)."""

    dtype: dtypes.DType
    batch: int
    heads: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    scale: float
    layout: str
    device_id: int
    q_strides: tuple  # (batch, head, row) strides in elements
    k_strides: tuple
    v_strides: tuple

    @property
    def empty(self) -> bool:
        """True when the output has no elements (no launch needed)."""
        return self.batch == 0 or self.heads == 0 or self.seqlen_q == 0

    @property
    def out_shape(self) -> tuple:
        if self.layout == "bhsd":
            return (self.batch, self.heads, self.seqlen_q, self.head_dim)
        return (self.batch, self.seqlen_q, self.heads, self.head_dim)


def _dims(x, layout):
    """(batch, heads, seqlen, head_dim) and (batch, head, row) element strides of a 4-d array."""
    b, s0, s1, d = x.shape
    st = [s // x.itemsize for s in x.strides]
    if layout == "bhsd":
        return (b, s0, s1, d), (st[0], st[1], st[2])
    return (b, s1, s0, d), (st[0], st[2], st[1])


def validate(q, k, v, *, causal, scale, layout, fp8_format=None) -> Problem:
    import cupy

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use 'bhsd' ([batch, heads, seqlen, head_dim]) "
                         f"or 'bshd' ([batch, seqlen, heads, head_dim])")
    if not isinstance(causal, (bool,)) and not (hasattr(causal, "dtype") and causal.dtype == bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-d ({layout}), got {name}.shape={x.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype; got q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}")
    if fp8_format is None:
        entry = dtypes.from_numpy(q.dtype)
    else:
        if fp8_format not in dtypes.FP8_DTYPES:
            raise ValueError(f"fp8_format={fp8_format!r} is not supported; use 'e4m3' or 'e5m2'")
        if q.dtype.itemsize != 1:
            raise TypeError(f"fp8_format={fp8_format!r} takes 1-byte arrays of FP8 codes (uint8); got dtype {q.dtype}")
        entry = dtypes.FP8_DTYPES[fp8_format]
    devices = (q.device.id, k.device.id, v.device.id) if q.data.device_id != k.data.device_id or \
        q.data.device_id != v.data.device_id else (q.data.device_id,) * 3
    if len(set(devices)) != 1:
        raise ValueError(f"q, k and v must be on one device; got q on {devices[0]}, k on {devices[1]}, v on {devices[2]}")

    (b, hq, sq, d), q_strides = _dims(q, layout)
    (bk, hk, sk, dk), k_strides = _dims(k, layout)
    (bv, hv, sv, dv), v_strides = _dims(v, layout)
    if k.shape != v.shape:
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be equal")
    if bk != b:
        raise ValueError(f"q.shape={q.shape} and k.shape={k.shape} must agree on batch ({layout})")
    if dk != d:
        raise ValueError(f"q.shape={q.shape} and k.shape={k.shape} must agree on head_dim ({layout})")
    if hk == 0 and hq != 0 or hk and hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}); "
                         f"q.shape={q.shape}, k.shape={k.shape} ({layout})")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is not supported; cuflash supports multiples of 8 from 8 to 256")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.size and x.strides[-1] != x.itemsize:
            raise ValueError(f"{name} must be contiguous in its last dim; got {name}.strides={x.strides} "
                             f"(itemsize {x.itemsize})")
    scale = 1.0 / math.sqrt(d) if scale is None else float32_number("scale", scale)
    if sq > _INT32_MAX or sk > _INT32_MAX or b * hq > _INT32_MAX:
        raise ValueError(f"seqlen_q={sq}, seqlen_k={sk} and batch*heads={b * hq} must each be below 2**31")
    if hq > GRID_YZ_MAX or b > GRID_YZ_MAX:
        raise ValueError(f"batch={b} and heads={hq} must each be at most {GRID_YZ_MAX} (CUDA grid limits)")
    return Problem(dtype=entry, batch=b, heads=hq, heads_k=hk, seqlen_q=sq, seqlen_k=sk, head_dim=d,
                   causal=bool(causal), scale=scale, layout=layout, device_id=devices[0],
                   q_strides=q_strides, k_strides=k_strides, v_strides=v_strides)


@dataclass(slots=True)
class Fp8Scales:
    """The validated extras of an FP8 call: the output dtype and the descale factors as float32
    device arrays, with (batch, head) element strides (0 for one factor per tensor); k and v
    share theirs."""

    out_dtype: dtypes.DType
    q_descale: object
    k_descale: object
    v_descale: object
    q_strides: tuple
    kv_strides: tuple


_ONES: dict = {}


def _descale_array(name, value, shape, device_id):
    """A descale as a float32 device array of shape (1,) (per tensor) or ``shape`` (per head)."""
    import cupy

    if value is None or real_number(value):
        value = 1.0 if value is None else float32_number(name, value, positive=True)
        key = (device_id, value)
        array = _ONES.get(key)
        if array is None:
            with cupy.cuda.Device(device_id):
                array = cupy.full((1,), value, dtype=cupy.float32)
            if len(_ONES) >= 64:
                _ONES.clear()
            _ONES[key] = array
        return array
    if isinstance(value, (np.ndarray, np.generic)):
        with cupy.cuda.Device(device_id):
            value = cupy.asarray(value)
    if not isinstance(value, cupy.ndarray):
        raise TypeError(f"{name} must be a number or a float32 array, got {type(value).__name__}")
    if value.dtype.kind != "f":
        raise TypeError(f"{name}.dtype={value.dtype} must be a floating dtype (float32)")
    if value.data.device_id != device_id:
        raise ValueError(f"{name} is on device {value.data.device_id}, q on device {device_id}")
    if value.shape in ((), (1,)):
        return value.reshape(1).astype(cupy.float32, copy=False)
    if value.shape != shape:
        raise ValueError(f"{name}.shape={value.shape} must be () (per tensor) or {shape} (per batch and head)")
    return value.astype(cupy.float32, copy=False)


def validate_window(window_size, causal: bool) -> tuple[int, int]:
    """FlashAttention's ``window_size=(left, right)`` (-1 unbounded) as two ints; with ``causal`` right is 0."""
    if isinstance(window_size, np.ndarray) and window_size.shape == (2,) and window_size.dtype.kind in "iu":
        window_size = tuple(window_size.tolist())
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size={tuple(window_size)}: each bound is -1 (unbounded) or a number of keys >= 0")
    if causal:
        if right > 0:
            raise ValueError(f"window_size={tuple(window_size)} with causal=True: a causal query sees no key after "
                             f"its own position (right must be 0 or -1)")
        right = 0
    if max(left, right) >= 2**31 - 2**20:
        raise ValueError(f"window_size={tuple(window_size)} is too large")
    return left, right


def validate_softcap(softcap) -> float:
    """A logit cap ``softcap * tanh(s / softcap)`` as a float, 0 (or None) for none."""
    if softcap is None:
        return 0.0
    if not real_number(softcap) or not 0 <= float(softcap) <= FLOAT32_MAX:
        raise ValueError(f"softcap={softcap!r} must be a number from 0 (none) to {FLOAT32_MAX:.4g} (float32)")
    return float(softcap)


def no_variants(window_size, softcap) -> bool:
    """No window and no cap, as the calls' fast paths tell it before validate_variants (a tuple
    compared only: an array would compare element-wise)."""
    return not softcap and type(window_size) is tuple and window_size == (-1, -1)


def validate_variants(window_size, softcap, causal: bool):
    """``((left, right), cap)`` of a call's FlashAttention-style ``window_size`` and ``softcap``, or
    None where they change nothing (no bound beyond the causal one, no cap)."""
    window = validate_window(window_size, causal)
    cap = validate_softcap(softcap)
    if not cap and window[0] < 0 and (causal or window[1] < 0):
        return None
    return window, cap


def variant_mods(variants, causal: bool, score_mod, mask_mod):
    """``(cap, window)`` of checked ``variants`` (:func:`validate_variants`) beside a call's own
    mods: the cap (0: none) and the window's ``(left, right)`` with causal's right bound left to
    causal (-1), or None where no bound is left; a cap beside a score_mod, or a window beside a
    mask_mod or block mask (``mask_mod``: either), is refused."""
    window, cap = variants
    left, right = window
    if cap and score_mod is not None:
        raise ValueError(f"softcap={cap} and score_mod were both given; put the cap into the score_mod "
                         f"(cuflash.mods.softcap shows how)")
    right = -1 if causal else right  # causal bounds the right side already
    if left < 0 and right < 0:
        return cap, None
    if mask_mod is not None:
        raise ValueError(f"window_size={window} and a mask_mod or block_mask were both given; combine the "
                         f"window with the mask (cuflash.mods.and_masks) and pass that")
    return cap, (left, right)


def validate_sinks(sinks, heads: int, device_id: int):
    """Attention sinks as the kernels read them: float32, contiguous, one logit per each of the
    ``heads`` query heads, on device ``device_id`` (a copy where the array is not that already)."""
    import cupy

    if not isinstance(sinks, cupy.ndarray):
        raise TypeError(f"sinks must be a cupy.ndarray (one logit per query head), got "
                        f"{type(sinks).__module__}.{type(sinks).__name__}")
    if sinks.dtype.kind != "f" and sinks.dtype != dtypes.DTYPES["bf16"].numpy:
        raise TypeError(f"sinks must be a floating-point array, got sinks.dtype={sinks.dtype}")
    if sinks.shape != (heads,):
        raise ValueError(f"sinks.shape={sinks.shape} must be (heads,) = ({heads},): one logit per query head")
    if sinks.data.device_id != device_id:
        raise ValueError(f"sinks is on device {sinks.data.device_id}, q on device {device_id}")
    if sinks.dtype == cupy.float32 and sinks.flags.c_contiguous:
        return sinks
    with cupy.cuda.Device(device_id):
        return cupy.ascontiguousarray(sinks.astype(cupy.float32))


def validate_fp8_scales(problem: Problem, *, q_descale, k_descale, v_descale, out_dtype) -> Fp8Scales:
    """Check an FP8 call's descales and output dtype. Descales are numbers (positive, finite) or
    float arrays shaped () or (batch, heads) for q and (batch, heads_k) for k and v. Values in
    device arrays are not read back (that would stop the host): the kernel gives NaN rows where
    q's and k's factors multiply to a negative number."""
    import cupy

    tag = "bf16" if out_dtype is None else out_dtype
    try:
        out = dtypes.from_tag(tag) if isinstance(tag, str) else dtypes.from_numpy(tag)
    except (TypeError, ValueError):
        out = None
    if out is None or out.tag not in dtypes.FP8_OUT_TAGS:
        raise ValueError(f"out_dtype={out_dtype!r} is not supported for FP8 inputs; use 'bf16' or 'fp16'")
    b, dev = problem.batch, problem.device_id
    qd = _descale_array("q_descale", q_descale, (b, problem.heads), dev)
    kd = _descale_array("k_descale", k_descale, (b, problem.heads_k), dev)
    vd = _descale_array("v_descale", v_descale, (b, problem.heads_k), dev)
    if kd.shape != vd.shape:  # one pair of strides for both: give both one factor per head
        with cupy.cuda.Device(dev):
            kd, vd = (cupy.ascontiguousarray(cupy.broadcast_to(x.reshape(()) if x.ndim == 1 else x,
                                                               (b, problem.heads_k))) for x in (kd, vd))

    def strides(x):
        return (0, 0) if x.ndim == 1 else tuple(st // x.itemsize for st in x.strides)

    return Fp8Scales(out_dtype=out, q_descale=qd, k_descale=kd, v_descale=vd, q_strides=strides(qd),
                     kv_strides=strides(kd))


def aligned_copy(x):
    """A fresh C-contiguous copy of x, for a view the kernels' copies cannot read: its base is as
    aligned as CuPy allocates. cupy.ascontiguousarray is not enough: it returns a view that is
    already C-contiguous as it is, however far its base lies off alignment."""
    return x.copy()


def aligned_for_async_copy(x, alignment: int = 16) -> bool:
    """16-byte copies need a 16-byte aligned base and row/head/batch strides in whole 16-byte units
    (``alignment``: the size of a smaller copy, e.g. 8 for FP8 rows of 8 mod 16 codes)."""
    s0, s1, s2, _ = x.strides
    return (x.data.ptr | s0 | s1 | s2) % alignment == 0


def readable_by_tma(x) -> bool:
    """The copy engine (TMA) needs what 16-byte copies need, and batch, head and row strides that
    are positive (a broadcast stride of 0 is not), except along extents of 1."""
    (b, h, s, _), (sb, sh, ss, _) = x.shape, x.strides
    return aligned_for_async_copy(x) and (b == 1 or sb > 0) and (h == 1 or sh > 0) and (s == 1 or ss > 0)


@dataclass(slots=True)
class BackwardProblem:
    """A validated backward call: the forward's :class:`Problem` plus the strides of dout and out."""

    forward: Problem
    deterministic: bool
    o_strides: tuple
    do_strides: tuple


def validate_backward(dout, q, k, v, out, lse, *, causal, scale, layout, deterministic) -> BackwardProblem:
    """Check a backward call: q, k, v as for the forward; dout and out shaped like the forward's
    output, in q's dtype and on its device; lse float32 [batch, heads, seqlen_q]."""
    import cupy

    problem = validate(q, k, v, causal=causal, scale=scale, layout=layout)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
        if x.data.device_id != problem.device_id:
            raise ValueError(f"{name} is on device {x.data.device_id}, q on device {problem.device_id}")
    for name, x in (("dout", dout), ("out", out)):
        if x.shape != problem.out_shape:
            raise ValueError(f"{name}.shape={x.shape} must equal the output's shape {problem.out_shape} ({layout})")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={x.dtype} must equal q.dtype={q.dtype}")
        if x.size and x.strides[-1] != x.itemsize:
            raise ValueError(f"{name} must be contiguous in its last dim; got {name}.strides={x.strides}")
    lse_shape = (problem.batch, problem.heads, problem.seqlen_q)
    if lse.shape != lse_shape or lse.dtype != cupy.float32:
        raise ValueError(f"lse must be float32 {lse_shape} (the forward's return_lse), "
                         f"got {lse.dtype} {lse.shape}")
    return BackwardProblem(forward=problem, deterministic=deterministic,
                           o_strides=_dims(out, layout)[1], do_strides=_dims(dout, layout)[1])
