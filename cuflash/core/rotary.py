"""Rotary position embeddings (RoPE) as FlashAttention's KV-cache call applies them: the queries
and the new keys rotated by cos / sin tables at their positions, before the append and the
attention (CuPy arrays for the call, NumPy arrays for the reference)."""
from __future__ import annotations

import numpy as np

from .validate import validate_window

#: The table dtypes (float16, bfloat16 and float32), by name.
TABLE_DTYPES = ("float16", "bfloat16", "float32")


def check(xp, cos, sin, head_dim: int, capacity: int) -> None:
    """Refuse tables that are not [seqlen_ro, rotary_dim / 2] of one float dtype, with rotary_dim
    at most head_dim and seqlen_ro covering the cache's positions."""
    if (cos is None) != (sin is None):
        raise ValueError("pass rotary_cos and rotary_sin together, or neither")
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(x, xp.ndarray):
            raise TypeError(f"{name} must be a {xp.__name__} array [seqlen_ro, rotary_dim / 2], got "
                            f"{type(x).__module__}.{type(x).__name__}")
        if x.ndim != 2 or x.dtype.name not in TABLE_DTYPES:
            raise ValueError(f"{name} must be [seqlen_ro, rotary_dim / 2] in float16, bfloat16 or float32, got "
                             f"{x.dtype} {x.shape}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(f"rotary_cos {cos.dtype} {cos.shape} and rotary_sin {sin.dtype} {sin.shape} must match")
    seqlen_ro, half = cos.shape
    if not 1 <= 2 * half <= head_dim:
        raise ValueError(f"rotary_cos {cos.shape} rotates {2 * half} dims; rotary_dim runs from 2 to head_dim="
                         f"{head_dim}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos {cos.shape} has {seqlen_ro} positions; the cache holds {capacity}, so "
                         f"seqlen_ro must be at least that")


def positions(xp, cache_seqlens, batch: int, count: int, first: int, per_token: bool):
    """int32 [batch, count]: ``cache_seqlens[b] + first + i`` for token i, or ``cache_seqlens[b]``
    for every token (``per_token=False``)."""
    if isinstance(cache_seqlens, (int, np.integer)):  # filled on the device: no copy from the host
        lengths = xp.full((batch, 1), int(cache_seqlens), dtype=xp.int32)
    else:
        lengths = xp.broadcast_to(xp.asarray(cache_seqlens, dtype=xp.int32).reshape(-1), (batch,))[:, None]
    if not per_token:
        return xp.broadcast_to(lengths, (batch, count))
    return lengths + (first + xp.arange(count, dtype=xp.int32))[None, :]


def rotate(xp, x, cos, sin, pos, interleaved: bool, compute=np.float32, out_dtype=None):
    """x [batch, seqlen, heads, head_dim] with its first rotary_dim dims rotated at ``pos``
    [batch, seqlen]: halves (x1, x2) = (first, second half), or even and odd dims with
    ``interleaved``, become (x1 cos - x2 sin, x1 sin + x2 cos), computed in ``compute``. A new
    C-contiguous array of ``out_dtype`` (default x's)."""
    half = cos.shape[1]
    pos = xp.clip(pos, 0, cos.shape[0] - 1)  # past the table: NaN rows in the kernels anyway
    c, s = (t[pos].astype(compute)[:, :, None, :] for t in (cos, sin))
    r = x[..., :2 * half].astype(compute)
    x1, x2 = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
    out = x.astype(out_dtype or x.dtype, order="C", copy=True)
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
        (slice(0, half), slice(half, 2 * half))
    out[..., first] = (x1 * c - x2 * s).astype(out.dtype)
    out[..., second] = (x1 * s + x2 * c).astype(out.dtype)
    return out


def rotate_on_device(cupy, x, cos, sin, lens, first: int, per_token: bool, interleaved: bool):
    """:func:`rotate` of a float16 / bfloat16 CuPy array in one kernel (rotary.cuh): token s of
    sequence b at ``lens[b] + first + s`` (``per_token``) or ``lens[b]``; ``lens`` an int or an
    int32 array of one or ``batch`` lengths, read on the device."""
    batch, seqlen, heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is not supported (multiples of 8 from 8 to 256)")
    out = cupy.empty(x.shape, dtype=x.dtype)
    if out.size == 0:
        return out
    if x.strides[3] != x.itemsize or any(st % x.itemsize for st in x.strides):
        x = cupy.ascontiguousarray(x)
    if isinstance(lens, (int, np.integer)):
        if not 0 <= int(lens) < 2**31:
            raise ValueError(f"cache_seqlens={int(lens)} must be from 0 to 2**31 - 1")
        lens = cupy.full((1,), int(lens), dtype=cupy.int32)
    else:
        lens = cupy.ascontiguousarray(cupy.asarray(lens, dtype=cupy.int32).reshape(-1))
        if lens.size not in (1, batch):
            raise ValueError(f"cache_seqlens holds {lens.size} lengths; batch={batch}")
    cos, sin = cupy.ascontiguousarray(cos), cupy.ascontiguousarray(sin)
    pairs = batch * seqlen * heads * (head_dim // 2)
    _kernel(cupy, x, cos)(
        (-(-pairs // 256),), (256,),
        (x, out, cos, sin, lens, np.int32(0 if lens.size == 1 else 1), np.int32(seqlen), np.int32(heads),
         np.int32(head_dim), np.int32(cos.shape[1]), np.int32(cos.shape[0]), np.int32(first), np.int32(per_token),
         np.int32(interleaved), *(np.int64(st // x.itemsize) for st in x.strides[:3]), np.int64(pairs)))
    return out


_KERNELS: dict = {}


def _kernel(cupy, x, table):
    """The rotation kernel of x's dtype and the tables' on x's device, compiled once."""
    device = x.data.device_id
    key = (device, x.dtype.name, table.dtype.name)
    kernel = _KERNELS.get(key)
    if kernel is None:
        from .compile import arch_options, device_arch

        options = arch_options(device_arch(device)) + (
            f"-DCUFLASH_ROTARY_TABLE={TABLE_DTYPES.index(table.dtype.name)}",
            *(("-DCUFLASH_ROTARY_BF16",) if x.dtype.name == "bfloat16" else ()))
        module = cupy.RawModule(code='#include "cuflash/rotary.cuh"\n', options=options)
        kernel = _KERNELS[key] = module.get_function("cuflash_rotary")
    return kernel


def apply(xp, q, k_new, cache_seqlens, capacity: int, causal: bool, window_size, cos, sin, interleaved: bool,
          compute=np.float32, out_dtype=None):
    """(q, k_new) rotated: the new keys at ``cache_seqlens[b] + j``; the queries, the last seqlen_q
    tokens after the append, at theirs where causal or a window makes positions matter, else all at
    ``cache_seqlens[b]`` (as FlashAttention's call does)."""
    if k_new is None:
        raise ValueError("rotary_cos and rotary_sin rotate the new keys and the queries: pass k_new and v_new")
    for name, x in (("q", q), ("k_new", k_new)):
        if not isinstance(x, xp.ndarray) or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-d {xp.__name__} array to take rotary embeddings, got "
                             f"{type(x).__name__} {getattr(x, 'shape', '')}")
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool, got {interleaved!r}")
    if k_new.shape[0] != q.shape[0] or k_new.shape[3] != q.shape[3]:
        raise ValueError(f"k_new {k_new.shape} must be [batch={q.shape[0]}, seqlen_new, heads_k, "
                         f"head_dim={q.shape[3]}]")
    check(xp, cos, sin, q.shape[3], capacity)
    batch, seqlen_q = q.shape[:2]
    seqlen_new = k_new.shape[1]
    local = validate_window(window_size, bool(causal)) != (-1, -1)
    if xp is not np and out_dtype is None and q.dtype.name in ("float16", "bfloat16") and k_new.dtype == q.dtype:
        return (rotate_on_device(xp, q, cos, sin, cache_seqlens, seqlen_new - seqlen_q, bool(causal) or local,
                                 bool(interleaved)),
                rotate_on_device(xp, k_new, cos, sin, cache_seqlens, 0, True, bool(interleaved)))
    q_pos = positions(xp, cache_seqlens, batch, seqlen_q, seqlen_new - seqlen_q, bool(causal) or local)
    k_pos = positions(xp, cache_seqlens, batch, seqlen_new, 0, True)
    return (rotate(xp, q, cos, sin, q_pos, bool(interleaved), compute, out_dtype),
            rotate(xp, k_new, cos, sin, k_pos, bool(interleaved), compute, out_dtype))
