"""The user-facing call: validate -> spec -> (render, compile: cached) -> launch."""
from __future__ import annotations

import functools

from . import compile as _compile
from .launch import launch
from .spec import KernelSpec, default_spec
from .validate import Problem, aligned_for_async_copy, readable_by_tma, validate

_arch_of_device: dict[int, str] = {}


def _arch(device_id: int) -> str:
    arch = _arch_of_device.get(device_id)
    if arch is None:
        arch = _arch_of_device[device_id] = _compile.device_arch(device_id)
    return arch


@functools.lru_cache(maxsize=1024)
def _default(head_dim: int, dtype: str, causal: bool, device_id: int, family) -> KernelSpec:
    return default_spec(head_dim, dtype, causal, _arch(device_id), family)


def select_spec(problem: Problem, family: str | None = None) -> KernelSpec:
    """The specialization cuflash runs for a validated problem on its device (of ``family``, or
    of the default family there)."""
    return _default(problem.head_dim, problem.dtype.tag, problem.causal, problem.device_id, family)


def _check_forced_spec(spec, problem: Problem) -> KernelSpec:
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a cuflash.KernelSpec, got {type(spec).__name__}")
    wanted = (problem.head_dim, problem.dtype.tag, problem.causal)
    if (spec.head_dim, spec.dtype, spec.causal) != wanted:
        raise ValueError(f"spec {spec.name} does not match the problem (head_dim={problem.head_dim}, "
                         f"dtype={problem.dtype.tag}, causal={problem.causal})")
    arch = _arch(problem.device_id)
    if spec.arch != arch:
        raise ValueError(f"spec {spec.name} targets {spec.arch} but device {problem.device_id} is {arch}")
    return spec


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, layout="bhsd", family=None, spec=None):
    """Scaled dot-product attention, ``softmax(scale * q @ k^T) @ v``, without materializing the scores.

    Args:
        q: CuPy array [batch, heads, seqlen_q, head_dim] (``layout="bshd"``: [batch, seqlen_q,
            heads, head_dim]); float16, bfloat16 or float32. Any strides with a contiguous last dim.
        k, v: [batch, heads_k, seqlen_k, head_dim] in the same layout and dtype; ``heads`` must be
            a multiple of ``heads_k`` (grouped-query attention).
        causal: mask aligned bottom-right: query i attends key j iff j <= i + seqlen_k - seqlen_q.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the natural-log log-sum-exp of each query row, float32
            [batch, heads, seqlen_q] (``-inf`` for a row with no key to attend).
        layout: ``"bhsd"`` or ``"bshd"``; the output uses the same layout.
        family: kernel family, for tests and comparisons: ``"wgmma"`` (Hopper warpgroup MMAs,
            sm_90a, head dims 64/96/128/192/256), ``"mma"`` (portable tensor-core kernel, fp16/bf16)
            or ``"simt"`` (float32). Default: wgmma where it applies, else the dtype's portable one.
        spec: force a :class:`cuflash.KernelSpec` (for tuning and comparisons); it must match the
            problem's head_dim, dtype and causality and the device's target.

    Returns:
        The output in q's dtype and layout (rows with no key to attend are 0), and the LSE if
        ``return_lse``. Runs on the current CuPy stream and device.
    """
    import cupy

    problem = validate(q, k, v, causal=causal, scale=scale, layout=layout)
    with _on_device(problem.device_id):
        out = cupy.empty(problem.out_shape, dtype=q.dtype)
        lse = cupy.empty((problem.batch, problem.heads, problem.seqlen_q), dtype=cupy.float32)
        if problem.empty:
            pass
        elif problem.seqlen_k == 0:
            out.fill(0)
            lse.fill(-cupy.inf)
        else:
            spec = select_spec(problem, family) if spec is None else _check_forced_spec(spec, problem)
            if problem.scale <= 0:
                q, k, scale = _positive_scale(q, k, problem.scale)
                problem = validate(q, k, v, causal=causal, scale=scale, layout=layout)
            readable = readable_by_tma if spec.warp_specialized else aligned_for_async_copy
            if spec.async_copies and not (readable(q) and readable(k) and readable(v)):
                # 16-byte copies (and TMA) need aligned rows; a view they cannot read is copied once.
                q, k, v = (x if readable(x) else cupy.ascontiguousarray(x) for x in (q, k, v))
                problem = validate(q, k, v, causal=causal, scale=scale, layout=layout)
            kernel = _compile.get_kernel(spec, problem.device_id)
            out_strides = _out_strides(out, layout)
            launch(kernel, spec, problem, q, k, v, out, lse, out_strides)
    return (out, lse) if return_lse else out


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NOTHING = _Nothing()


def _on_device(device_id: int):
    """The device's context, or nothing when it is already current (the common, cheap case)."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        return _NOTHING
    return cupy.cuda.Device(device_id)


def _positive_scale(q, k, scale):
    """The kernels take the row max on raw scores, which needs scale > 0. A negative scale is
    folded into k (q . -k = -(q . k)); a zero scale makes every score 0, as q = 0 with scale 1 does."""
    import cupy

    if scale == 0:
        return cupy.zeros_like(q), k, 1.0
    bits = cupy.dtype(f"uint{8 * k.itemsize}")
    sign = bits.type(1 << (8 * k.itemsize - 1))
    return q, (k.view(bits) ^ sign).view(k.dtype), -scale


def _out_strides(out, layout):
    st = [s // out.itemsize for s in out.strides]
    return (st[0], st[1], st[2]) if layout == "bhsd" else (st[0], st[2], st[1])
