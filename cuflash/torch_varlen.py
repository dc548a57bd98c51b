"""Packed sequences for PyTorch: :func:`cuflash.attention_varlen` on CUDA torch tensors,
differentiable (FlashAttention's ``flash_attn_varlen_func``). :mod:`cuflash.torch` exports it.
Eager calls go straight to cuflash; traced ones (torch.compile, meta tensors) to the operators
``torch.ops.cuflash.attention_varlen`` and ``attention_varlen_backward``."""
from __future__ import annotations

import torch

from .torch_interop import _on_torch_stream, _to_cupy, _to_torch


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks):
    named = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__}")
    for name, x in named:
        if x.device != q.device or x.device.type not in ("cuda", "meta"):
            raise ValueError(f"{name} is on {x.device}; every tensor must be on q's CUDA device ({q.device})")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x.dtype != torch.int32 or x.dim() != 1:
            raise TypeError(f"{name} must be a 1-d torch.int32 tensor of offsets, got {x.dtype} {tuple(x.shape)}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.device != q.device):
        raise TypeError(f"sinks must be a torch.Tensor on {q.device}, got {type(sinks).__name__}"
                        + (f" on {sinks.device}" if isinstance(sinks, torch.Tensor) else ""))


def _forward(q, k, v, cu_q, cu_k, sinks, options):
    from .varlen import attention_varlen as _varlen

    max_seqlen_q, causal, scale, window_size, softcap, *mods = options  # mods: traced (score, mask), if any
    score_mod, mask_mod = mods or (None, None)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # rows read as they lie
    with _on_torch_stream(q.device):
        out, lse = _varlen(_to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(cu_q), _to_cupy(cu_k),
                           max_seqlen_q=max_seqlen_q, causal=causal, scale=scale, window_size=window_size,
                           softcap=softcap, return_lse=True, sinks=None if sinks is None else _to_cupy(sinks),
                           score_mod=score_mod, mask_mod=mask_mod)
    return _to_torch(out), _to_torch(lse)


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, sinks, causal, scale, deterministic, window_size=(-1, -1),
              softcap=0.0, maxima=(None, None), mods=(None, None)):
    from .varlen import attention_varlen_backward as _varlen_backward

    dout = dout.to(out.dtype).contiguous()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    with _on_torch_stream(q.device):
        grads = _varlen_backward(_to_cupy(dout), _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(out),
                                 _to_cupy(lse), _to_cupy(cu_q), _to_cupy(cu_k), causal=causal, scale=scale,
                                 deterministic=deterministic, sinks=None if sinks is None else _to_cupy(sinks),
                                 window_size=window_size, softcap=softcap, max_seqlen_q=maxima[0],
                                 max_seqlen_k=maxima[1], score_mod=mods[0], mask_mod=mods[1])
    return [_to_torch(g) for g in grads]


# -- the operators (traced calls) ------------------------------------------------------------------------

def _op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
             cu_seqlens_k: torch.Tensor, sinks: torch.Tensor | None, max_seqlen_q: int | None, causal: bool,
             scale: float | None, window_left: int, window_right: int,
             softcap: float, max_seqlen_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks,
                    (max_seqlen_q, causal, scale, (window_left, window_right), softcap))


_op = torch.library.custom_op("cuflash::attention_varlen", mutates_args=())(_op_impl)


@_op.register_fake
def _op_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, max_seqlen_q, causal, scale, window_left, window_right,
             softcap, max_seqlen_k=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _backward_op_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      sinks: torch.Tensor | None, causal: bool, scale: float | None, deterministic: bool,
                      window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                      max_seqlen_q: int | None = None,
                      max_seqlen_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, causal, scale, deterministic,
                      (window_left, window_right), softcap, (max_seqlen_q, max_seqlen_k))
    dsinks = grads[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return grads[0], grads[1], grads[2], dsinks


_backward_op = torch.library.custom_op("cuflash::attention_varlen_backward", mutates_args=())(_backward_op_impl)


@_backward_op.register_fake
def _backward_op_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, causal, scale, deterministic,
                      window_left=-1, window_right=-1, softcap=0.0, max_seqlen_q=None, max_seqlen_k=None):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _op_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, sinks, max_seqlen_q, causal, scale, window_left, window_right, softcap, max_seqlen_k = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output, *(() if sinks is None else (sinks,)))
    ctx.options = (causal, scale, False, window_left, window_right, softcap, max_seqlen_q, max_seqlen_k)


def _op_differentiate(ctx, dout, dlse):
    q, k, v, cu_q, cu_k, out, lse, *sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _backward_op(dout, q, k, v, out, lse, cu_q, cu_k, sinks[0] if sinks else None,
                                      *ctx.options)
    return dq, dk, dv, None, None, dsinks if sinks else None, None, None, None, None, None, None, None


torch.library.register_autograd("cuflash::attention_varlen", _op_differentiate, setup_context=_op_setup_context)


# -- eager calls ----------------------------------------------------------------------------------------------

class _AttentionVarlen(torch.autograd.Function):
    """The forward, and cuflash's varlen backward for q, k, v and the sinks."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, sinks, options, deterministic, max_seqlen_k):
        out, lse = _forward(q, k, v, cu_q, cu_k, sinks, options)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, *(() if sinks is None else (sinks,)))
        ctx.options, ctx.deterministic, ctx.max_seqlen_k = options, deterministic, max_seqlen_k
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, cu_q, cu_k, out, lse, *sinks = ctx.saved_tensors
        max_seqlen_q, causal, scale, window_size, softcap, *mods = ctx.options
        grads = _backward(dout, q, k, v, out, lse, cu_q, cu_k, sinks[0] if sinks else None, causal, scale,
                          ctx.deterministic, window_size, softcap, (max_seqlen_q, ctx.max_seqlen_k),
                          tuple(mods) or (None, None))
        return grads[0], grads[1], grads[2], None, None, grads[3] if sinks else None, None, None, None


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal: bool = False,
                     scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                     return_lse: bool = False, deterministic: bool = False, sinks=None, score_mod=None,
                     mask_mod=None):
    """:func:`cuflash.attention_varlen` on CUDA torch tensors, differentiable in q, k, v and the
    sinks (not the LSE), as FlashAttention's ``flash_attn_varlen_func``.

    Args:
        q: [total_q, heads, head_dim], float16 or bfloat16, the sequences' queries one after another.
        k, v: [total_k, heads_k, head_dim], packed the same way.
        cu_seqlens_q, cu_seqlens_k: torch.int32 [batch + 1] offsets on q's device.
        max_seqlen_q: the most queries of one sequence; None reads the offsets on the host once.
        max_seqlen_k: the most keys of one sequence: with max_seqlen_q, the one-launch backward
            reads the offsets on the device only (:func:`cuflash.attention_varlen_backward`).
        causal, scale, window_size, softcap, sinks: as for :func:`cuflash.attention_varlen`.
        return_lse: also return the LSE, float32 [heads, total_q].
        deterministic: the backward adds dQ in a fixed order.
        score_mod, mask_mod: as for :func:`cuflash.attention_varlen` (they may capture torch
            tensors); such calls run eagerly, a graph break under torch.compile.

    Returns:
        The output [total_q, heads, head_dim] (and the LSE), on torch's current stream.
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks)
    window_size = tuple(window_size)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    if score_mod is not None or mask_mod is not None:
        out, lse = _with_mods(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, (max_seqlen_q, causal, scale, window_size,
                                                                           softcap, score_mod, mask_mod),
                              deterministic, max_seqlen_k, grad)
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling() or q.device.type == "meta":
        if deterministic:
            raise ValueError("deterministic=True is for eager calls; the traced backward adds dQ as it comes")
        out, lse = _op(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, max_seqlen_q, causal,
                       None if scale is None else float(scale), *window_size, float(softcap), max_seqlen_k)
    elif grad:
        options = (max_seqlen_q, causal, scale, window_size, softcap)
        out, lse = _AttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, options, deterministic,
                                          max_seqlen_k)
    else:
        out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, (max_seqlen_q, causal, scale, window_size,
                                                                          softcap))
    return (out, lse) if return_lse else out


@torch.compiler.disable  # the mods are Python functions, which no operator schema takes
def _with_mods(q, k, v, cu_q, cu_k, sinks, options, deterministic, max_seqlen_k, grad):
    """The eager call with the mods traced once for both passes (options end with them)."""
    from .core import modset

    if q.device.type == "meta":
        raise ValueError("score_mod and mask_mod run on CUDA tensors, not on meta tensors")
    traced = modset.prepare(options[5], options[6], q.get_device())
    options = options[:5] + (traced and traced.score, traced and traced.mask)
    if grad:
        return _AttentionVarlen.apply(q, k, v, cu_q, cu_k, sinks, options, deterministic, max_seqlen_k)
    return _forward(q, k, v, cu_q, cu_k, sinks, options)


__all__ = ["attention_varlen"]
