"""Launching: a loaded kernel + a validated Problem + device arrays -> one kernel launch.

All run-time values travel in one by-value parameter block whose layout is defined once, by
:data:`cuflash.spec.PARAM_FIELDS`.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from .spec import PARAM_FIELDS, KernelSpec, ceil_div
from .validate import Problem

_STRUCT = struct.Struct("<" + "".join({"u8": "Q", "i8": "q", "i4": "i", "f4": "f"}[fmt] for _, _, fmt in PARAM_FIELDS))
_PARAMS = np.dtype((np.void, _STRUCT.size))
_LOG2E = 1.0 / math.log(2.0)


def grid(spec: KernelSpec, problem: Problem) -> tuple[int, int, int]:
    """(query tiles, heads, batch). Query tiles vary fastest so that the blocks resident at one
    time work on few heads and find their K/V tiles in L2; the kernel walks each head's tiles
    heaviest first."""
    return (ceil_div(problem.seqlen_q, spec.block_m), problem.heads, problem.batch)


def pack_params(problem: Problem, q, k, v, out, lse, out_strides) -> np.ndarray:
    """The parameter block as a one-element void array, which CuPy passes by value."""
    raw = _STRUCT.pack(
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
        *problem.q_strides, *problem.k_strides, *problem.v_strides, *out_strides,
        problem.heads, problem.heads // max(problem.heads_k, 1),
        problem.seqlen_q, problem.seqlen_k,
        problem.scale * _LOG2E, 0,
    )
    return np.frombuffer(raw, dtype=_PARAMS)


def launch(kernel, spec: KernelSpec, problem: Problem, q, k, v, out, lse, out_strides) -> None:
    """Launch on the current CuPy stream."""
    params = pack_params(problem, q, k, v, out, lse, out_strides)
    kernel(grid(spec, problem), (spec.threads, 1, 1), (params,), shared_mem=spec.smem_bytes)
