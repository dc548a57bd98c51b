"""The user-facing call: validate -> spec -> (render, compile: cached) -> launch."""
from __future__ import annotations

import functools
import math

from . import fp8 as _fp8
from .core import compile as _compile
from . import sparsity as _sparsity
from .core import modset as _modset
from .core.launch import LaunchPlan, launch, lse_scratch, outputs_unused
from .core.policy import FP8_WGMMA_MIN_HEAD_DIM, SHORT_SEQLEN, default_spec
from .core.spec import KernelSpec
from .core.validate import (Problem, aligned_copy, aligned_for_async_copy, no_variants, readable_by_tma, validate,
                            validate_fp8_scales, validate_sinks, validate_variants, variant_mods)

_arch_of_device: dict[int, str] = {}


def _arch(device_id: int) -> str:
    arch = _arch_of_device.get(device_id)
    if arch is None:
        arch = _arch_of_device[device_id] = _compile.device_arch(device_id)
    return arch


@functools.lru_cache(maxsize=1024)
def _default(head_dim: int, dtype: str, causal: bool, device_id: int, family, out_dtype, seqlen: int,
             lse: bool) -> KernelSpec:
    return default_spec(head_dim, dtype, causal, _arch(device_id), family, out_dtype, seqlen, lse)


def select_spec(problem: Problem, family: str | None = None, out_dtype: str | None = None,
                lse: bool = True) -> KernelSpec:
    """The specialization cuflash runs for a validated problem on its device (of ``family``, or
    of the default family there; FP8 inputs: writing ``out_dtype``; tiles by length class;
    ``lse``: whether the caller takes the LSE)."""
    if family is not None and not isinstance(family, str):  # named before the cached lookup hashes it
        raise TypeError(f"family must be a str or None, got {family!r}")
    # Lengths past SHORT_SEQLEN all take the long tiles: one cache entry for them.
    seqlen = min(max(problem.seqlen_q, problem.seqlen_k), SHORT_SEQLEN + 1)
    return _default(problem.head_dim, problem.dtype.tag, problem.causal, problem.device_id, family, out_dtype,
                    seqlen, lse)


def _check_forced_spec(spec, problem: Problem, out_dtype: str | None = None, return_lse: bool = False) -> KernelSpec:
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a cuflash.KernelSpec, got {type(spec).__name__}")
    if return_lse and not spec.lse:
        raise ValueError(f"spec {spec.name} has lse=False (row sums on the tensor cores, no exact LSE); "
                         f"call with return_lse=False or pass a spec with lse=True")
    wanted = (problem.head_dim, problem.dtype.tag, problem.causal, out_dtype or spec.out_dtype)
    if (spec.head_dim, spec.dtype, spec.causal, spec.out_dtype) != wanted:
        raise ValueError(f"spec {spec.name} does not match the problem (head_dim={problem.head_dim}, "
                         f"dtype={problem.dtype.tag}, causal={problem.causal}, out_dtype={wanted[3]})")
    arch = _arch(problem.device_id)
    if spec.arch != arch:
        raise ValueError(f"spec {spec.name} targets {spec.arch} but device {problem.device_id} is {arch}")
    return spec


_UNKEYED = object()  # _attention's key where the caller has not computed it
_NO_WINDOW = (-1, -1)


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, layout="bhsd", family=None, spec=None,
              fp8_format=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None, score_mod=None,
              mask_mod=None, block_mask=None, sinks=None, window_size=(-1, -1), softcap=0.0):
    """Scaled dot-product attention, ``softmax(scale * q @ k^T) @ v``, without materializing the scores.

    Args:
        q: CuPy array [batch, heads, seqlen_q, head_dim] (``layout="bshd"``: [batch, seqlen_q,
            heads, head_dim]); float16, bfloat16 or float32. Any strides with a contiguous last dim.
        k, v: [batch, heads_k, seqlen_k, head_dim] in the same layout and dtype; ``heads`` must be
            a multiple of ``heads_k`` (grouped-query attention).
        causal: mask aligned bottom-right: query i attends key j iff j <= i + seqlen_k - seqlen_q.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the natural-log log-sum-exp of each query row, float32
            [batch, heads, seqlen_q] (``-inf`` for a row with no key to attend). Without it the
            Hopper FP8 kernel sums P on the tensor cores (``KernelSpec.sums_on_tensor_cores``).
        layout: ``"bhsd"`` or ``"bshd"``; the output uses the same layout.
        family: kernel family, for tests and comparisons: ``"wgmma"`` (Hopper warpgroup MMAs,
            sm_90a, every head dim, the default from head dim 24; FP8: multiples of 16, the default
            from 32), ``"mma"`` (portable tensor-core kernel, fp16/bf16, and FP8 codes converted to
            fp16 on chip) or ``"simt"`` (float32). Default: wgmma where it applies, else the
            dtype's portable one.
        spec: force a :class:`cuflash.KernelSpec` (for tuning and comparisons); it must match the
            problem's head_dim, dtype and causality and the device's target.
        fp8_format: ``"e4m3"`` or ``"e5m2"``: q, k and v are 1-byte arrays (uint8) of FP8 codes
            (:func:`cuflash.quantize_fp8`), and the scores are
            ``scale * (q * q_descale) @ (k * k_descale)^T``, the values ``v * v_descale``.
            ``v`` may also be a :class:`cuflash.PreparedV` (:func:`cuflash.prepare_v`): V's codes
            rearranged once for the Hopper FP8 kernel, e.g. a KV cache, instead of on every call.
        q_descale, k_descale, v_descale: FP8 descale factors: a positive number (default 1), or
            a float32 CuPy array shaped () or, one per (batch, head), (batch, heads) for q and
            (batch, heads_k) for k and v.
        out_dtype: FP8 output dtype, ``"bf16"`` (default) or ``"fp16"``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, a Python function applied
            to every scaled score before the softmax (:mod:`cuflash.mods`: traced once into the
            kernel; the arrays it captures must be CuPy arrays on q's device).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``: the pairs that attend (and-ed with
            ``causal``). Mods run on fp16, bf16 and FP8 inputs.
        block_mask: a :class:`cuflash.BlockMask` of the mask_mod (:func:`cuflash.block_mask`, for
            this batch, heads and lengths): the Hopper kernel skips its empty tiles and the
            mask_mod's evaluation on its full ones. Its mask_mod is the call's when mask_mod is
            not given.
        sinks: attention sinks (gpt-oss): a CuPy array [heads] of logits, one per query head, each
            added to its rows' softmax sums as ``exp(sinks[h])``: a share of the probability that
            attends no value. The LSE includes it; a row with no key then gives O = 0 and LSE =
            its sink. Any float dtype (read as float32); every input dtype (FP8: the forward).
        window_size: ``(left, right)`` as in FlashAttention: query i sees keys i + d - left to
            i + d + right, d = seqlen_k - seqlen_q (-1: no bound; with ``causal`` right is 0).
            Only the window's key tiles are visited: on the Hopper kernel its bounds are kernel
            arguments, elsewhere a mask_mod with a block mask made once per shape. Not with
            another mask_mod or block_mask.
        softcap: a logit cap ``softcap * tanh(s / softcap)`` on the scaled scores (Gemma 2), 0 for
            none; a score_mod, not with another one.

    Returns:
        The output in q's dtype (FP8: ``out_dtype``) and layout (rows with no key to attend are
        0), and the LSE if ``return_lse``. Runs on the current CuPy stream and device.
    """
    key = _UNKEYED
    if score_mod is None and mask_mod is None and block_mask is None and fp8_format is None and q_descale is None \
            and k_descale is None and v_descale is None and out_dtype is None and sinks is None and not softcap \
            and no_variants(window_size, softcap):
        # a repeated plain call: straight to its plan
        cupy = _cupy or _import_cupy()
        key = _plan_key(cupy, q, k, v, causal, scale, return_lse, layout, family, spec)
        plan = _plans.get(key) if key is not None else None
        if plan is not None:
            result = _launch_planned(cupy, plan, key, q, k, v, None, return_lse)
            if result is not None:
                return result
    return _attention(q, k, v, None, causal=causal, scale=scale, return_lse=return_lse, layout=layout, family=family,
                      spec=spec, fp8_format=fp8_format, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      out_dtype=out_dtype, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, key=key,
                      sinks=sinks, window_size=window_size, softcap=softcap)


def _attention(q, k, v, outputs, *, causal, scale, return_lse, layout, family, spec, fp8_format, q_descale,
               k_descale, v_descale, out_dtype, score_mod=None, mask_mod=None, block_mask=None, keep=None,
               key=_UNKEYED, sinks=None, window_size=_NO_WINDOW, softcap=0.0):
    """:func:`attention`, writing into ``outputs`` = (out, lse) when given: C-contiguous arrays of
    the output's shape and q's dtype, and float32 [batch, heads, seqlen_q] (the torch bridge's).
    ``keep``: a list the call's launch plan is appended to, where it has one. ``key``: the call's
    :func:`_plan_key` where the caller has it (None too: no plan), else :data:`_UNKEYED`."""
    import cupy

    if key is _UNKEYED:
        key = _plan_key(cupy, q, k, v, causal, scale, return_lse, layout, family, spec) \
            if _without_fp8(fp8_format, q_descale, k_descale, v_descale, out_dtype) else None
    if sinks is not None and key is not None:
        key = key + (_Same(sinks),)  # the sinks' address is in the parameter block
    variants = None if no_variants(window_size, softcap) else validate_variants(window_size, softcap, causal)
    if variants is not None and key is not None:
        key = key + variants
    if key is not None and (score_mod is not None or mask_mod is not None or block_mask is not None):
        # A call with mods has a plan when its mods trace to graphs kept for their function and
        # captured values (the same graphs, arrays and block mask: the same kernel argument).
        score_mod, score_kept = _modset.traced_kept(score_mod, "score")
        mask_mod, mask_kept = _modset.traced_kept(mask_mod, "mask")
        key = key + (_Same(score_mod), _Same(mask_mod), _Same(block_mask)) if score_kept and mask_kept else None
    if key is not None:
        plan = _plans.get(key)
        result = _launch_planned(cupy, plan, key, q, k, v, outputs, return_lse) if plan is not None else None
        if result is not None:
            if keep is not None:
                keep.append(plan)
            return result
    if fp8_format is None:
        for name, value in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                            ("out_dtype", out_dtype)):
            if value is not None:
                raise ValueError(f"{name} applies to FP8 inputs only; pass fp8_format='e4m3' or 'e5m2'")
    else:  # int8 views of the codes are read as the same bytes
        q, k, v = (x.view(cupy.uint8) if isinstance(x, cupy.ndarray) and x.dtype == cupy.int8 else x
                   for x in (q, k, v))
    prepared_v = v if isinstance(v, _fp8.PreparedV) else None
    if prepared_v is not None:  # V^T made once by cuflash.prepare_v; validated through a stand-in
        if fp8_format is None:
            raise TypeError("v is a cuflash.PreparedV (FP8 codes); pass fp8_format='e4m3' or 'e5m2'")
        if prepared_v.layout != layout:
            raise ValueError(f"v was prepared for layout={prepared_v.layout!r}; this call has layout={layout!r}")
        v = prepared_v.stand_in()

    def checked(q, k, v, scale):
        return validate(q, k, v, causal=causal, scale=scale, layout=layout, fp8_format=fp8_format)

    problem = checked(q, k, v, scale)
    scales = None
    if fp8_format is not None:
        scales = validate_fp8_scales(problem, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                     out_dtype=out_dtype)
    out_tag = scales.out_dtype.tag if scales else None
    window = _NO_WINDOW  # a window the Hopper kernel bounds itself (spec.local)
    selected = None  # the spec select_spec gave for that decision, reused below
    if variants is not None and not problem.empty and problem.seqlen_k:
        if spec is None:  # the Hopper kernel's own bounds (spec.local), 16-bit and FP8
            bounds = variant_mods(variants, causal, score_mod, block_mask if mask_mod is None else mask_mod)[1]
            if bounds is not None:
                with _on_device(problem.device_id):
                    # out_tag: the spec is reused below, so FP8 selects it for the call's output dtype
                    selected = select_spec(problem, family, out_tag, return_lse)
                    if selected.warp_specialized:
                        window, variants = bounds, (_NO_WINDOW, variants[1])
        score_mod, mask_mod, block_mask = _sparsity.flash_mods(problem, *variants, score_mod, mask_mod, block_mask)
    if sinks is not None:
        checked_sinks = validate_sinks(sinks, problem.heads, problem.device_id)
        if checked_sinks is not sinks:
            key = None  # a float32 copy: the next call copies again
        sinks = checked_sinks
    mask_mod = _sparsity.mask_mod_of(block_mask, mask_mod, problem)
    mods = _modset.prepare(score_mod, mask_mod, problem.device_id, _modset.extents_of(problem))
    sparse = b""  # the block mask's visit lists, after the mods' arrays in the kernel's last argument
    with _on_device(problem.device_id):
        spec = ((selected or select_spec(problem, family, out_tag, return_lse)) if spec is None
                else _check_forced_spec(spec, problem, out_tag, return_lse))
        if mods is not None:
            spec = _with_mods(spec, mods, problem, out_tag)
            # The Hopper kernel visits only the mask's non-empty tiles; the portable one masks every tile.
            if block_mask is not None and spec.warp_specialized:
                spec = spec.replace(block_sparse=True)
                sparse = _sparsity.kernel_tables(block_mask, spec.block_m, spec.block_n, problem.causal)[2]
        spec = _with_sinks(spec, sinks)
        if window != _NO_WINDOW:
            spec = spec.replace(local=True)
        if prepared_v is not None and not (spec.fp8 and spec.warp_specialized):
            raise ValueError(f"a prepared V is read by the Hopper FP8 kernel only (sm90a, head dims that are multiples "
                             f"of 16 from {FP8_WGMMA_MIN_HEAD_DIM}); "
                             f"this call runs {spec.name}: pass V itself")
        out, lse = outputs or (cupy.empty(problem.out_shape, dtype=scales.out_dtype.numpy if scales else q.dtype),
                               cupy.empty((problem.batch, problem.heads, problem.seqlen_q), dtype=cupy.float32))
        if problem.empty:
            pass
        elif problem.seqlen_k == 0:
            out.fill(0)
            lse[...] = -cupy.inf if sinks is None else sinks[None, :, None]
        else:
            if problem.scale <= 0:
                q, k, scale = _positive_scale(q, k, problem.scale)
                problem = checked(q, k, v, scale)
                key = None  # the plan would run on the rewritten q or k
            if not (_readable(spec, q, False) and _readable(spec, k, False) and _readable(spec, v, True)):
                # A view the kernel's copies cannot read is copied once.
                q, k, v = (x if _readable(spec, x, is_v) else aligned_copy(x)
                           for x, is_v in ((q, False), (k, False), (v, True)))
                problem = checked(q, k, v, scale)
                key = None  # the next call with this key copies again
            kernel = _compile.get_kernel(spec, problem.device_id)
            # The Hopper FP8 kernel reads V as V^T (fp8.v_operand); every other kernel reads V as it is.
            if prepared_v is not None:
                v_operand = prepared_v.data
            else:
                v_operand = _fp8.v_operand(v, layout) if spec.fp8 and spec.warp_specialized else v
            if key is not None and problem.scale > 0 and not spec.fp8:
                plan = LaunchPlan(kernel, spec, problem, q, k, v, out, lse, _out_strides(out, layout), None,
                                  _modset.kernel_argument(mods, sparse), sinks=sinks, window=window)
                plan.launch(q, k, v, out, lse)
                _keep_outputs(cupy, plan, q.dtype, key[_STREAM])
                if len(_plans) >= _MAX_PLANS:
                    _plans.clear()
                _plans[key] = plan
                if keep is not None:
                    keep.append(plan)
            else:
                launch(kernel, spec, problem, q, k, v_operand, out, lse, _out_strides(out, layout), scales,
                       _modset.kernel_argument(mods, sparse), sinks=sinks, window=window)
    return (out, lse) if return_lse else out


def _with_sinks(spec: KernelSpec, sinks) -> KernelSpec:
    """The spec that adds the call's sinks to its rows' sums (its exact-LSE form), or the spec
    without them; a forced spec with sinks needs the call's."""
    if sinks is None:
        if spec.sinks:
            raise ValueError(f"spec={spec.name} adds attention sinks; pass sinks= (one logit per query head)")
        return spec
    return spec.replace(sinks=True, lse=True)


def _with_mods(spec: KernelSpec, mods, problem: Problem, out_tag) -> KernelSpec:
    """The spec with the call's mods: its own where its family takes them (the portable mma and
    the warp-specialized wgmma kernels), else the portable kernel's for the problem."""
    if not (spec.family == "mma" or spec.warp_specialized):
        if problem.dtype.tag == "fp32":
            raise ValueError("score_mod and mask_mod run on fp16, bf16 and FP8 inputs; this call has float32 "
                             "(convert q, k and v, or apply the mod with cuflash.reference)")
        spec = _default(problem.head_dim, problem.dtype.tag, problem.causal, problem.device_id, "mma", out_tag,
                        SHORT_SEQLEN + 1, spec.lse)
    return spec.replace(score_mod=mods.score_digest, mask_mod=mods.mask_digest)


#: Launch plans by everything a call's validation and specialization depend on but the arrays'
#: addresses (:func:`_plan_key`): a repeated call skips straight to its launch.
_plans: dict = {}
_MAX_PLANS = 256
_STREAM = 16  # the stream handle's place in a plan's key
_cupy = None


def _import_cupy():
    global _cupy
    import cupy
    _cupy = cupy
    return cupy


def _keep_outputs(cupy, plan: LaunchPlan, dtype, stream: int) -> None:
    """How a kept plan's calls allocate: the output and the LSE in one block of CuPy's allocator
    (the LSE 256-byte aligned after the output), and the stream's LSE scratch for calls that do
    not return it."""
    problem = plan.problem
    lse_shape = (problem.batch, problem.heads, problem.seqlen_q)
    out_bytes = -(-math.prod(problem.out_shape) * dtype.itemsize // 256) * 256
    plan.outputs = (problem.out_shape, dtype, out_bytes, lse_shape, out_bytes + 4 * math.prod(lse_shape),
                    cupy.float32)
    plan.lse_scratch = lse_scratch(problem, stream)


def _launch_planned(cupy, plan: LaunchPlan, key: tuple, q, k, v, outputs, return_lse: bool):
    """A call launched from its plan: its result, or None where the addresses are off the
    16-byte grid (the full path copies such a view)."""
    qp, kp, vp = q.data.ptr, k.data.ptr, v.data.ptr
    if (qp | kp | vp) % 16:
        return None
    if outputs is None:
        out, lse, op, lp = _new_outputs(cupy, plan, return_lse)
    else:
        out, lse = outputs
        op, lp = out.data.ptr, lse.data.ptr
    driver = plan._driver
    if driver:
        plan._driver_launch(driver, qp, kp, vp, op, lp, key[_STREAM])
    else:
        plan.launch(q, k, v, out, lse, key[_STREAM], (qp, kp, vp, op, lp))
    return (out, lse) if return_lse else out


def _new_outputs(cupy, plan: LaunchPlan, return_lse: bool):
    """A planned call's (out, lse, their addresses): the plan's last ones again where nothing
    uses them any more (launch.outputs_unused), else new ones; the LSE returned shares the
    output's allocation; one not returned is the stream's scratch, which the kernels only write."""
    spare = plan.spare
    shape, dtype, lse_at, lse_shape, nbytes, float32 = plan.outputs
    if spare:
        try:
            entry = spare.pop()  # atomic: threads sharing the plan never take the same entry
        except IndexError:
            pass
        else:
            if outputs_unused(entry, shape, lse_shape if return_lse else None):
                spare.append(entry)
                return entry
            del entry
    if not return_lse:
        out, lse = cupy.ndarray(shape, dtype), plan.lse_scratch
    else:
        memory = cupy.cuda.alloc(nbytes)
        out, lse = cupy.ndarray(shape, dtype, memory), cupy.ndarray(lse_shape, float32, memory + lse_at)
    entry = (out, lse, out.data.ptr, lse.data.ptr)
    if not spare:
        spare.append(entry)
    return entry


class _Same:
    """A plan key's part that matches the very same object (a graph, a block mask) and keeps it
    alive while the plan is kept."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj


def _without_fp8(fp8_format, q_descale, k_descale, v_descale, out_dtype) -> bool:
    """Whether a call takes none of the FP8 arguments: only such calls have plans."""
    return fp8_format is None and q_descale is None and k_descale is None and v_descale is None and out_dtype is None


def _plan_key(cupy, q, k, v, causal, scale, return_lse, layout, family, spec):
    """The key of a 16-bit or float32 call's plan, or None for a call that always takes the full
    path (other array types, a scale that is not a plain number, a device other than the current)."""
    if type(q) is not cupy.ndarray or type(k) is not cupy.ndarray or type(v) is not cupy.ndarray:
        return None
    if not (scale is None or type(scale) is float or type(scale) is int) or type(causal) is not bool:
        return None
    device = q.data.device_id
    if k.data.device_id != device or v.data.device_id != device or cupy.cuda.runtime.getDevice() != device:
        return None
    key = (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype, v.dtype, causal, scale,
           bool(return_lse), layout, family, spec, device, cupy.cuda.get_current_stream().ptr)
    if type(layout) is not str or not (family is None or type(family) is str) or spec is not None:
        try:  # only these can be unhashable; the common call's key is hashed once, by the lookup
            hash(key)
        except TypeError:  # an unhashable family, layout or spec: the full path names it
            return None
    return key


def _readable(spec: KernelSpec, x, is_v: bool) -> bool:
    """Whether the kernel's copies can read x in place: TMA (the warp-specialized kernels; the
    Hopper FP8 kernel reads a rearranged copy of V instead), or cp.async copies of
    ``spec.copy_alignment`` bytes (16, or 8 for FP8 rows of 8 mod 16 codes)."""
    if spec.warp_specialized:
        return (spec.fp8 and is_v) or readable_by_tma(x)
    return not spec.async_copies or aligned_for_async_copy(x, spec.copy_alignment)


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
