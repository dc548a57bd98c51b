"""cuflash.torch.attention with a score_mod, mask_mod or block_mask (sinks too): the mods (which
may capture torch tensors, registered with the tracer by :mod:`cuflash.torch_interop`) traced
once for the forward and the backward, an autograd node of its own, run eagerly (no operator
schema takes a Python function)."""
from __future__ import annotations

import torch

from .backward import _attention_backward
from .forward import _attention
from .torch_interop import _on_torch_stream, _readable, _rows, _to_cupy


@torch.compiler.disable  # the mods are Python functions, which no operator schema takes
def _attention_with_mods(q, k, v, sinks, options, return_lse):
    """attention() with a score_mod, mask_mod or block_mask: the mods traced once for both passes,
    an autograd node of its own where a gradient is needed."""
    from .core import modset

    score_mod, mask_mod, block_mask, causal, scale, layout, deterministic, variants = options
    if q.device.type == "meta":
        raise ValueError("score_mod, mask_mod and block_mask run on CUDA tensors, not on meta tensors")
    if block_mask is not None and mask_mod is None:
        mask_mod = block_mask.graph
    traced = modset.prepare(score_mod, mask_mod, q.get_device())
    options = (traced and traced.score, traced and traced.mask, block_mask, causal, scale, layout, deterministic,
               (variants[0], variants[1]), variants[2])
    q, k, v = _readable(q), _readable(k), _readable(v)
    grad = any(x is not None and x.requires_grad for x in (q, k, v, sinks)) and torch.is_grad_enabled()
    out, lse = _ModsAttention.apply(q, k, v, sinks, options) if grad else _mods_forward(q, k, v, sinks, options)
    return (out, lse) if return_lse else out


def _mods_forward(q, k, v, sinks, options):
    score_mod, mask_mod, block_mask, causal, scale, layout, _, window, softcap = options
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_rows(q, layout), dtype=torch.float32, device=q.device)
    with _on_torch_stream(q.device):
        _attention(_to_cupy(q), _to_cupy(k), _to_cupy(v), (_to_cupy(out), _to_cupy(lse)), causal=causal, scale=scale,
                   return_lse=True, layout=layout, family=None, spec=None, fp8_format=None, q_descale=None,
                   k_descale=None, v_descale=None, out_dtype=None, score_mod=score_mod, mask_mod=mask_mod,
                   block_mask=block_mask, window_size=window, softcap=softcap,
                   # a view of the sinks is a new array each call: no launch plan to keep
                   **({} if sinks is None else dict(sinks=_to_cupy(sinks), key=None)))
    return out, lse


def _mods_backward(dout, q, k, v, out, lse, sinks, options):
    """(dq, dk, dv, dsinks or None)."""
    score_mod, mask_mod, block_mask, causal, scale, layout, deterministic, window, softcap = options
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dsinks = None if sinks is None else torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    with _on_torch_stream(q.device):
        result = _attention_backward(*(_to_cupy(x) for x in (dout, q, k, v, out, lse)),
                                     tuple(_to_cupy(g) for g in grads), causal=causal, scale=scale, layout=layout,
                                     deterministic=deterministic, spec=None, score_mod=score_mod, mask_mod=mask_mod,
                                     block_mask=block_mask, window_size=window, softcap=softcap,
                                     sinks=None if sinks is None else _to_cupy(sinks))
        if sinks is not None:
            _to_cupy(dsinks)[...] = result[3]
    return (*grads, dsinks)


class _ModsAttention(torch.autograd.Function):
    """The forward and backward with the call's traced mods (``options`` as _mods_forward takes)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        out, lse = _mods_forward(q, k, v, sinks, options)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        return (*_mods_backward(_readable(dout.to(out.dtype)), q, k, v, out, lse, sinks, ctx.options), None)
