"""The backward pass: validate -> spec -> (render, compile: cached) -> launch, as for the forward.

Gradients are recomputed tile by tile from the forward's output and log-sum-exp; nothing of
size seqlen_q x seqlen_k is ever stored. Extra device memory is O(seqlen * head_dim): two float32
vectors per query row (delta and the base-2 LSE) and, where the K/V-outer kernel accumulates dQ
(not ``deterministic``, or deterministic on the Hopper kernel up to head dim 128), a float32 dQ
accumulator shaped like q (on the Hopper kernel up to head dim 128, padded to its computed
head dim and kept in fragment order within each query tile).
"""
from __future__ import annotations

import functools

from . import sparsity as _sparsity
from .core import compile as _compile
from .core import mod_grad
from .core import modset as _modset
from .core.bwd_spec import BwdSpec
from .core.launch import launch_backward, rows_padded
from .core.policy import default_bwd_spec
from .core.validate import (aligned_copy, aligned_for_async_copy, no_variants, readable_by_tma, validate_backward,
                            validate_sinks, validate_variants, variant_mods)
from .forward import _arch, _on_device, _out_strides, attention


@functools.lru_cache(maxsize=1024)
def _default(head_dim: int, dtype: str, causal: bool, device_id: int, deterministic: bool) -> BwdSpec:
    return default_bwd_spec(head_dim, dtype, causal, _arch(device_id), deterministic)


def select_bwd_spec(bp) -> BwdSpec:
    """The backward specialization cuflash runs for a validated backward problem."""
    p = bp.forward
    return _default(p.head_dim, p.dtype.tag, p.causal, p.device_id, bp.deterministic)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, layout="bhsd", deterministic=False,
                       spec=None, score_mod=None, mask_mod=None, block_mask=None, sinks=None, window_size=(-1, -1),
                       softcap=0.0):
    """Gradients ``(dq, dk, dv)`` of :func:`cuflash.attention` with respect to q, k and v.

    Args:
        dout: gradient of the loss with respect to the output; shaped like ``out``.
        q, k, v, causal, scale, layout, score_mod, mask_mod, window_size, softcap: exactly as
            passed to the forward
            (a score_mod's derivative with respect to the score is traced with it; the arrays
            mods capture are constants, with no gradient).
        block_mask: the forward's :class:`cuflash.BlockMask`, whose mask_mod it carries.
        out, lse: the forward's output and its ``return_lse`` log-sum-exp (float32).
        deterministic: sum dQ in a fixed order instead of in whatever order the thread blocks
            reach it, so that two runs give identical bits. float32 inputs are always
            deterministic.
        spec: force a :class:`cuflash.BwdSpec` (for tuning and comparisons); it must match the
            problem's head_dim, dtype, causality and ``deterministic``, and the device's target.
        sinks: the forward's attention sinks (whose LSE includes them); their gradient is
            returned too.

    Returns:
        ``(dq, dk, dv)`` with the shapes, dtype and layout of q, k and v (contiguous); with
        ``sinks``, ``(dq, dk, dv, dsinks)``, dsinks in the sinks' dtype. With grouped-query
        attention dk and dv sum the query heads that share a kv head. Rows that attend nothing
        contribute no gradient (zeros, never NaN). Runs on the current CuPy stream.
    """
    return _attention_backward(dout, q, k, v, out, lse, None, causal=causal, scale=scale, layout=layout,
                               deterministic=deterministic, spec=spec, score_mod=score_mod, mask_mod=mask_mod,
                               block_mask=block_mask, sinks=sinks, window_size=window_size, softcap=softcap)


def loadable(spec: BwdSpec, q, k, v, dout, view=lambda x: x):
    """(spec, (q, k, v, dout), copied): the arrays as the spec's kernels can load them. 16-byte
    copies need aligned rows, so a misaligned view is copied once (copied: strides to read again);
    strides the copy engine cannot take drop the TMA loads for cp.async. ``view`` gives the
    batched view the checks read (packed sequences: x[None])."""
    arrays, copied = (q, k, v, dout), False
    if spec.async_copies and not all(aligned_for_async_copy(view(x)) for x in arrays):
        arrays, copied = tuple(x if aligned_for_async_copy(view(x)) else aligned_copy(x) for x in arrays), True
    if spec.tma_loads and not all(readable_by_tma(view(x)) for x in arrays):
        spec = spec.replace(tma_loads=False)
    return spec, arrays, copied


def _sinks_grad(sinks, lse, delta):
    """d loss / d sinks[h] = -sum over (batch, row) of P_sink * rowsum(dO * O), where P_sink =
    exp(sinks[h] - lse) is the share of a row's probability its sink took: float32 [heads] from
    float32 sinks [heads] and lse, delta [batch, heads, rows]."""
    import cupy

    s = sinks[None, :, None]
    share = cupy.where(cupy.isneginf(s) & cupy.isneginf(lse), 0, cupy.exp(s - lse))
    return -(share * delta).sum(axis=(0, 2))


def _attention_backward(dout, q, k, v, out, lse, grads, *, causal, scale, layout, deterministic, spec,
                        score_mod=None, mask_mod=None, block_mask=None, sinks=None, window_size=(-1, -1),
                        softcap=0.0):
    """:func:`attention_backward`, writing into ``grads`` = (dq, dk, dv) when given: C-contiguous
    arrays shaped and typed like q, k and v (the torch bridge's)."""
    import cupy

    bp = validate_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, layout=layout,
                           deterministic=deterministic)
    problem = bp.forward
    variants = None if no_variants(window_size, softcap) else validate_variants(window_size, softcap, causal)
    sinks32 = None if sinks is None else validate_sinks(sinks, problem.heads, problem.device_id)
    with _on_device(problem.device_id):
        dq, dk, dv = grads or (cupy.empty(q.shape, dtype=q.dtype), cupy.empty(k.shape, dtype=k.dtype),
                               cupy.empty(v.shape, dtype=v.dtype))
        if problem.empty or problem.seqlen_k == 0 or problem.heads_k == 0:
            for x in (dq, dk, dv):
                x.fill(0)
            # with no key every row's output is 0, so rowsum(dO * O) and the sinks' gradient are too
            return (dq, dk, dv) if sinks is None else (dq, dk, dv, cupy.zeros(sinks.shape, dtype=sinks.dtype))
        forced = spec is not None
        spec = select_bwd_spec(bp) if spec is None else _check_forced_spec(spec, bp)
        window = (-1, -1)  # a window the Hopper kernel bounds itself (spec.local)
        if variants is not None:
            if not forced:
                window = _local_window(spec, variants, causal, score_mod, mask_mod, block_mask)
                if window != (-1, -1):
                    variants = ((-1, -1), variants[1])
            score_mod, mask_mod, block_mask = _sparsity.flash_mods(problem, *variants, score_mod, mask_mod, block_mask)
        mods = _modset.prepare(score_mod, _sparsity.mask_mod_of(block_mask, mask_mod, problem), problem.device_id,
                               _modset.extents_of(problem))
        sparse = b""
        if mods is not None:
            spec = _with_mods(spec, mods, bp)
            # The Hopper kernel walks each key tile's non-empty query tiles, one list for the query
            # heads of a kv head (a mask that does not read h); others mask every tile.
            if block_mask is not None and spec.family == "wgmma" and block_mask.kind.shape[1] == 1:
                spec = spec.replace(block_sparse=True)
                sparse = _sparsity.kernel_tables(block_mask, spec.block_m, spec.block_n, problem.causal,
                                                 by_key=True)[2]
        if window != (-1, -1):
            spec = spec.replace(local=True)
        spec, (q, k, v, dout), copied = loadable(spec, q, k, v, dout)
        if copied:
            bp = validate_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, layout=layout,
                                   deterministic=deterministic)
            problem = bp.forward
        if not lse.flags.c_contiguous:
            lse = cupy.ascontiguousarray(lse)
        padded = rows_padded(spec, problem.seqlen_q)
        stats = cupy.empty((2, problem.batch * problem.heads * padded), dtype=cupy.float32)
        accum = (cupy.empty((problem.batch, problem.heads, padded, spec.accum_head_dim), dtype=cupy.float32)
                 if spec.accum_dq else stats)
        tensors = dict(q=q, k=k, v=v, o=out, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv,
                       dq_accum=accum, lse2=stats[0], delta=stats[1])
        if spec.ordered_dq:  # each dQ tile's turn counter, zeroed by the preprocess
            tensors["dq_sem"] = cupy.empty(problem.batch * problem.heads * (padded // spec.block_m), dtype=cupy.int32)
        strides = dict(q=problem.q_strides, k=problem.k_strides, v=problem.v_strides,
                       o=bp.o_strides, do=bp.do_strides, dq=_out_strides(dq, layout), dk=_out_strides(dk, layout),
                       dv=_out_strides(dv, layout))
        kernels = _compile.get_kernel(spec, problem.device_id)
        launch_backward(kernels, spec, bp, tensors, strides, _modset.kernel_argument(mods, sparse), window=window)
        if sinks is not None:  # the preprocess left each row's rowsum(dO * O) in stats[1]
            delta = stats[1].reshape(problem.batch, problem.heads, padded)[:, :, :problem.seqlen_q]
            return dq, dk, dv, _sinks_grad(sinks32, lse, delta).astype(sinks.dtype, copy=False)
    return dq, dk, dv


def _local_window(spec: BwdSpec, variants, causal: bool, score_mod, mask_mod, block_mask) -> tuple:
    """The bounds of a call's window where the Hopper backward takes them as arguments (not
    deterministic; a split head dim only with no score_mod, which could move the call to the portable
    kernel), else (-1, -1)."""
    if spec.family != "wgmma" or spec.deterministic or (spec.split_head_dim and (variants[1] or score_mod)):
        return (-1, -1)
    bounds = variant_mods(variants, causal, score_mod, block_mask if mask_mod is None else mask_mod)[1]
    return (-1, -1) if bounds is None else bounds


def _with_mods(spec: BwdSpec, mods, bp) -> BwdSpec:
    """The spec with the call's mods. The Hopper backward that splits the head dim between its
    warpgroups takes only score_mods whose derivative is 1; others run on the portable kernel."""
    p = bp.forward
    if spec.family == "simt":
        raise ValueError("score_mod and mask_mod run on fp16 and bf16 inputs; this call has float32 (convert q, k "
                         "and v, or apply the mod with cuflash.reference)")
    if spec.family == "wgmma" and spec.split_head_dim and mods.score is not None and \
            not mod_grad.adds_only(mods.score):
        spec = default_bwd_spec(p.head_dim, p.dtype.tag, p.causal, spec.arch, spec.deterministic, family="mma")
    return spec.replace(score_mod=mods.score_digest, mask_mod=mods.mask_digest)


def _check_forced_spec(spec, bp) -> BwdSpec:
    if not isinstance(spec, BwdSpec):
        raise TypeError(f"spec must be a cuflash.BwdSpec, got {type(spec).__name__}")
    p = bp.forward
    wanted = (p.head_dim, p.dtype.tag, p.causal, bp.deterministic or p.dtype.tag == "fp32")
    if (spec.head_dim, spec.dtype, spec.causal, spec.deterministic) != wanted:
        raise ValueError(f"spec {spec.name} does not match the problem (head_dim={p.head_dim}, dtype={p.dtype.tag}, "
                         f"causal={p.causal}, deterministic={bp.deterministic})")
    if spec.arch != _arch(p.device_id):
        raise ValueError(f"spec {spec.name} targets {spec.arch} but device {p.device_id} is {_arch(p.device_id)}")
    return spec


def attention_with_grad(q, k, v, *, causal=False, scale=None, layout="bhsd", deterministic=False, family=None,
                        score_mod=None, mask_mod=None, block_mask=None, sinks=None, window_size=(-1, -1), softcap=0.0):
    """The forward output and a function mapping ``dout`` to ``(dq, dk, dv)`` (with ``sinks``:
    ``(dq, dk, dv, dsinks)``), for training without a framework::

        out, backward = cuflash.attention_with_grad(q, k, v, causal=True)
        dq, dk, dv = backward(dout)

    The function keeps q, k, v, the output and its LSE alive until it is dropped.
    """
    out, lse = attention(q, k, v, causal=causal, scale=scale, return_lse=True, layout=layout, family=family,
                         score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, sinks=sinks,
                         window_size=window_size, softcap=softcap)
    if block_mask is not None and mask_mod is None:
        mask_mod = block_mask.graph
    traced = (_modset.prepare(score_mod, mask_mod, q.data.device_id)
              if score_mod is not None or mask_mod is not None else None)  # traced once for both passes

    def backward(dout):
        return attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, layout=layout,
                                  deterministic=deterministic, score_mod=traced and traced.score,
                                  mask_mod=traced and traced.mask, block_mask=block_mask, sinks=sinks,
                                  window_size=window_size, softcap=softcap)

    return out, backward

