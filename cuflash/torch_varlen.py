"""Packed sequences for PyTorch: :func:`cuflash.attention_varlen` on CUDA torch tensors,
differentiable (FlashAttention's ``flash_attn_varlen_func``). :mod:`cuflash.torch` exports it."""
from __future__ import annotations

import torch

from .torch_interop import _on_torch_stream, _to_cupy, _to_torch


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks):
    named = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__}")
    for name, x in named:
        if x.device != q.device or x.device.type != "cuda":
            raise ValueError(f"{name} is on {x.device}; every tensor must be on q's CUDA device ({q.device})")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x.dtype != torch.int32 or x.dim() != 1:
            raise TypeError(f"{name} must be a 1-d torch.int32 tensor of offsets, got {x.dtype} {tuple(x.shape)}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.device != q.device):
        raise TypeError(f"sinks must be a torch.Tensor on {q.device}, got {type(sinks).__name__}"
                        + (f" on {sinks.device}" if isinstance(sinks, torch.Tensor) else ""))


def _forward(q, k, v, cu_q, cu_k, sinks, options):
    from .varlen import attention_varlen as _varlen

    max_seqlen_q, causal, scale, window_size, softcap = options
    with _on_torch_stream(q.device):
        out, lse = _varlen(_to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(cu_q), _to_cupy(cu_k),
                           max_seqlen_q=max_seqlen_q, causal=causal, scale=scale, window_size=window_size,
                           softcap=softcap, return_lse=True, sinks=None if sinks is None else _to_cupy(sinks))
    return _to_torch(out), _to_torch(lse)


class _AttentionVarlen(torch.autograd.Function):
    """The forward, and cuflash's varlen backward for q, k, v and the sinks."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, sinks, options, deterministic):
        out, lse = _forward(q, k, v, cu_q, cu_k, sinks, options)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, *(() if sinks is None else (sinks,)))
        ctx.options, ctx.deterministic = options, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from .varlen import attention_varlen_backward as _backward

        q, k, v, cu_q, cu_k, out, lse, *sinks = ctx.saved_tensors
        _, causal, scale, _, _ = ctx.options
        dout = dout.to(out.dtype).contiguous()
        with _on_torch_stream(q.device):
            grads = _backward(_to_cupy(dout), _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(out), _to_cupy(lse),
                              _to_cupy(cu_q), _to_cupy(cu_k), causal=causal, scale=scale,
                              deterministic=ctx.deterministic, sinks=_to_cupy(sinks[0]) if sinks else None)
        grads = [_to_torch(g) for g in grads]
        return grads[0], grads[1], grads[2], None, None, grads[3] if sinks else None, None, None


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, causal: bool = False,
                     scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                     return_lse: bool = False, deterministic: bool = False, sinks=None):
    """:func:`cuflash.attention_varlen` on CUDA torch tensors, differentiable in q, k, v and the
    sinks (not the LSE), as FlashAttention's ``flash_attn_varlen_func``.

    Args:
        q: [total_q, heads, head_dim], float16 or bfloat16, the sequences' queries one after another.
        k, v: [total_k, heads_k, head_dim], packed the same way.
        cu_seqlens_q, cu_seqlens_k: torch.int32 [batch + 1] offsets on q's device.
        max_seqlen_q: the most queries of one sequence; None reads the offsets on the host once.
        causal, scale, window_size, softcap, sinks: as for :func:`cuflash.attention_varlen`. A
            window or softcap runs forward only: a call that needs a gradient with them raises.
        return_lse: also return the LSE, float32 [heads, total_q].
        deterministic: the backward adds dQ in a fixed order.

    Returns:
        The output [total_q, heads, head_dim] (and the LSE), on torch's current stream.
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks)
    options = (max_seqlen_q, causal, scale, tuple(window_size), softcap)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    if grad:
        if tuple(window_size) != (-1, -1) or softcap:
            raise ValueError(f"window_size={tuple(window_size)} and softcap={softcap}: the varlen backward takes "
                             f"neither; call under torch.no_grad() for inference")
        out, lse = _AttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, options, deterministic)
    else:
        out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, options)
    return (out, lse) if return_lse else out


__all__ = ["attention_varlen"]
