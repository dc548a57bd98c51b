"""Tensor maps for the Hopper copy engine (TMA), encoded through the CUDA driver (cuda-bindings).

A tensor map describes one device array to the copy engine: its base address, extents, byte
strides, the box copied per instruction and the shared-memory swizzle. The warp-specialized
forward kernel takes the maps of q, k and v by value; this module builds them from a validated
:class:`cuflash.validate.Problem`. Encoding costs a driver call, so maps are memoized by
everything they encode.
"""
from __future__ import annotations

import functools
import struct

import numpy as np

from .spec import KernelSpec
from .validate import Problem

#: Bytes of one encoded map (CUtensorMap), as the kernel's TensorMap struct holds it.
MAP_BYTES = 128
_MAPS = np.dtype((np.void, 3 * MAP_BYTES))
_MAP = np.dtype((np.void, MAP_BYTES))


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - installed with the cuda extras
        raise ImportError("the warp-specialized Hopper kernel needs cuda-bindings "
                          "(pip install 'cuflash[cuda13]' or 'cuflash[cuda12]')") from exc
    return driver


_DATA_TYPES = {"bf16": "BFLOAT16", "fp16": "FLOAT16", "e4m3": "UINT8", "e5m2": "UINT8"}


@functools.lru_cache(maxsize=4096)
def _encode(ptr: int, dims: tuple, strides: tuple, box: tuple, dtype_tag: str, swizzle: int = 128) -> bytes:
    """One map of a 4-d tensor (innermost dim first; 16-bit floats or FP8 bytes), read in boxes
    of box[0] elements (the swizzle's span: 128 bytes, or 64) by box[1] rows, zeros out of
    bounds."""
    driver = _driver()
    dtype = getattr(driver.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + _DATA_TYPES[dtype_tag])
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        dtype, 4, ptr,
        [driver.cuuint64_t(d) for d in dims],
        [driver.cuuint64_t(s) for s in strides],
        [driver.cuuint32_t(b) for b in (*box, 1, 1)],
        [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}B"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err.name}) for dims={dims}, byte strides={strides}, "
                           f"box={box}")
    return struct.pack("<16Q", *(int(word) for word in tensor_map.opaque))


def _map(x, problem: Problem, heads: int, rows: int, strides: tuple, box: tuple, row_len: int,
         dtype_tag: str | None = None, swizzle: int = 128) -> bytes:
    """Map of a (row_len, rows, heads, batch) tensor with (batch, head, row) element strides, of
    the problem's dtype unless told."""
    extents = (problem.batch, heads, rows)
    # An extent of 1 may carry any stride (validate.readable_by_tma); give the driver one it accepts.
    batch_s, head_s, row_s = (s * x.itemsize if e > 1 else 16 for e, s in zip(extents, strides))
    return _encode(x.data.ptr, (row_len, rows, heads, problem.batch), (row_s, head_s, batch_s), box,
                   dtype_tag or problem.dtype.tag, swizzle)


def forward_maps(spec: KernelSpec, problem: Problem, q, k, v) -> np.ndarray:
    """The FwdTensorMaps kernel parameter (maps of q, k, v) as a one-element void array. A call
    that repeats the last arrays and geometry (a training or decoding loop) reuses its maps."""
    key = (spec.block_m, spec.block_n, problem.dtype.tag, problem.batch, problem.heads, problem.heads_k,
           problem.seqlen_q, problem.seqlen_k, problem.head_dim, problem.q_strides, problem.k_strides,
           problem.v_strides, q.data.ptr, k.data.ptr, v.data.ptr)

    def make():
        cols, d = spec.col_block_elems, problem.head_dim
        swizzle = spec.col_block_bytes
        raw = (_map(q, problem, problem.heads, problem.seqlen_q, problem.q_strides, (cols, spec.block_m), d,
                    swizzle=swizzle)
               + _map(k, problem, problem.heads_k, problem.seqlen_k, problem.k_strides, (cols, spec.block_n), d,
                      swizzle=swizzle))
        if spec.fp8:  # V^T [batch, heads_k, head_dim, keys]: boxes of 128 or 64 keys by every head-dim row
            b_s, h_s, r_s, _ = (s // v.itemsize for s in v.strides)
            keys = spec.fp8_v_box_keys
            raw += _map(v, problem, problem.heads_k, d, (b_s, h_s, r_s), (keys, spec.padded_head_dim),
                        v.shape[3], swizzle=keys)
        else:
            raw += _map(v, problem, problem.heads_k, problem.seqlen_k, problem.v_strides, (cols, spec.block_n), d)
        return np.frombuffer(raw, dtype=_MAPS)

    return _cached(_forward_maps, key, make)


_forward_maps: dict = {}


def backward_maps(spec, bp, q, k, v, dout) -> np.ndarray:
    """The BwdTensorMaps kernel parameter of a backward with ``spec.tma_loads`` (maps of q, k, v
    and dout, in boxes of 64 columns by a query or key tile's rows) as a one-element void array."""
    problem = bp.forward
    key = (spec.block_m, spec.block_n, problem.dtype.tag, problem.batch, problem.heads, problem.heads_k,
           problem.seqlen_q, problem.seqlen_k, problem.head_dim, problem.q_strides, problem.k_strides,
           problem.v_strides, bp.do_strides, q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr)

    def make():
        d = problem.head_dim
        raw = (_map(q, problem, problem.heads, problem.seqlen_q, problem.q_strides, (64, spec.block_m), d)
               + _map(k, problem, problem.heads_k, problem.seqlen_k, problem.k_strides, (64, spec.block_n), d)
               + _map(v, problem, problem.heads_k, problem.seqlen_k, problem.v_strides, (64, spec.block_n), d)
               + _map(dout, problem, problem.heads, problem.seqlen_q, bp.do_strides, (64, spec.block_m), d))
        return np.frombuffer(raw, dtype=_BWD_MAPS)

    return _cached(_backward_maps, key, make)


_BWD_MAPS = np.dtype((np.void, 4 * MAP_BYTES))
_backward_maps: dict = {}


def output_map(problem: Problem, out, out_strides: tuple, out_tag: str) -> np.ndarray:
    """The out_map kernel parameter of a kernel with ``spec.tma_store``: O (16-bit, ``out_tag``)
    in boxes of 64 columns by 64 rows, one consumer warpgroup's rows. The memory pool hands a
    loop's repeated output allocations the same address, so the map is usually reused."""
    key = (out_tag, problem.batch, problem.heads, problem.seqlen_q, problem.head_dim, out_strides, out.data.ptr)
    return _cached(_output_maps, key, lambda: np.frombuffer(
        _map(out, problem, problem.heads, problem.seqlen_q, out_strides, (64, 64), problem.head_dim, out_tag),
        dtype=_MAP))


_output_maps: dict = {}


def _cached(cache: dict, key, make):
    """cache[key], made by make() when missing; a cache that reaches 256 entries starts over."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= 256:
            cache.clear()
        value = cache[key] = make()
    return value
