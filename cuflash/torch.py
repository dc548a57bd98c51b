"""cuflash for PyTorch: CUDA torch tensors in, torch tensors out, differentiable, traceable.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)     # q, k, v: CUDA tensors, bhsd or bshd
    out.sum().backward()                                    # cuflash's backward

The calls are registered as custom operators (``torch.ops.cuflash.attention`` and
``torch.ops.cuflash.attention_backward``) with shape functions and an autograd formula, so
``torch.compile(fullgraph=True)`` traces a module that calls them without a graph break. Tensors
cross to CuPy through DLPack without a copy; cuflash runs on torch's current device and stream,
and while torch captures a CUDA graph (``torch.cuda.graph``) every buffer cuflash allocates comes
from torch's caching allocator, so the graph's memory pool holds it (:mod:`cuflash.torch_interop`).
PyTorch is imported by the cuflash.torch* modules only: ``import cuflash`` never imports it.
"""
from __future__ import annotations

import math
import warnings

try:
    import torch
except ImportError as exc:  # torch is optional: only this module needs it
    raise ImportError("cuflash.torch needs PyTorch with CUDA (pip install torch); cuflash itself does not") from exc

from .backward import _attention_backward
from .core.validate import no_variants, validate_softcap, validate_window
from .forward import _attention
from .torch_interop import (_DTYPES, _current_stream_ptr, _on_torch_stream, _readable, _rows, _to_cupy,  # noqa: F401
                            _to_torch)
from .torch_mods import _attention_with_mods
from .torch_kvcache import append_kv, attention_with_kvcache
from .torch_varlen import attention_varlen

LAYOUTS = ("bhsd", "bshd")
#: The name ``register_transformers`` registers: it must not contain "flash", which transformers
#: reserves for its hub flash-attention kernels.
TRANSFORMERS_NAME = "cuattn"
_is_compiling = torch.compiler.is_compiling


# -- the operators --------------------------------------------------------------------------------------

def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, layout: str,
                  deterministic: bool, window_left: int = -1, window_right: int = -1,
                  softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    key = _plan_key(q, k, v, causal, scale, layout, (window_left, window_right, softcap))
    planned = _planned(key, q, k, v, True)
    if planned is not None:
        return planned
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_rows(q, layout), dtype=torch.float32, device=q.device)
    kept = []
    with _on_torch_stream(q.device) as stream:
        _attention(_to_cupy(q), _to_cupy(k), _to_cupy(v), (_to_cupy(out), _to_cupy(lse)), causal=causal, scale=scale,
                   return_lse=True, layout=layout, family=None, spec=None, fp8_format=None, q_descale=None,
                   k_descale=None, v_descale=None, out_dtype=None, keep=kept, window_size=(window_left, window_right),
                   softcap=softcap)
    if kept and key is not None:
        _keep(key, kept[0], stream)
    return out, lse


# -- launch plans of repeated calls ----------------------------------------------------------------------

#: cuflash's launch plans (forward.LaunchPlan) by the torch side of a call (:func:`_plan_key`: the
#: tensors' shapes, strides and dtypes, the flags, the device and stream), each kept as (plan, the
#: stream's handle). A repeated call launches its plan on the tensors' addresses, with no CuPy
#: arrays and no autograd node where none is needed.
_plans: dict = {}
_MAX_PLANS = 256
_Tensor = torch.Tensor
_NO_VARIANTS = (-1, -1, 0.0)  # (window left, window right, softcap) of a call without them
_CONTIGUOUS = torch.contiguous_format


def _device_getter():
    try:
        return torch._C._cuda_getDevice  # the cheap form of torch.cuda.current_device()
    except AttributeError:
        return torch.cuda.current_device


_current_device = _device_getter()


def _plan_key(q, k, v, causal, scale, layout, variants=_NO_VARIANTS):
    """The key of a call's plan (``scale`` a float), or None for one that always takes the full path
    (another type than a plain tensor, a tensor off CUDA, tensors off one device or off the current
    one: a plan launches on the tensors' own device, which must be current)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor or type(causal) is not bool \
            or type(layout) is not str:  # a layout of another type: the full path names it
        return None
    device = q.get_device()
    if device < 0 or k.get_device() != device or v.get_device() != device or _current_device() != device:
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, causal, scale,
            layout, device, _current_stream_ptr(device), variants)


def _keep(key, plan, stream: int) -> None:
    """Keep the plan of a call that took the full path on ``stream`` (its handle, the one in the
    key), for the repeated calls."""
    if not plan.driver_ready():
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = (plan, stream)


def _planned(key, q, k, v, lse_needed: bool):
    """(out, lse) of a repeated call launched from its plan (lse None where not needed: the plan's
    scratch takes it), or None for the full path (no plan; an address off the 16-byte grid)."""
    kept = _plans.get(key) if key is not None else None
    if kept is None:
        return None
    plan, stream = kept
    q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (q_ptr | k_ptr | v_ptr) % 16:
        return None
    out = torch.empty_like(q, memory_format=_CONTIGUOUS)
    if lse_needed:
        lse = q.new_empty(plan.outputs[3], dtype=torch.float32)
        plan.launch_pointers(q_ptr, k_ptr, v_ptr, out.data_ptr(), lse.data_ptr(), stream)
        return out, lse
    plan.launch_pointers(q_ptr, k_ptr, v_ptr, out.data_ptr(), plan.lse_scratch.data.ptr, stream)
    return out, None


_attention_op = torch.library.custom_op("cuflash::attention", mutates_args=())(_forward_impl)


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, scale, layout, deterministic, window_left=-1, window_right=-1, softcap=0.0):
    return q.new_empty(q.shape), q.new_empty(_rows(q, layout), dtype=torch.float32)


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, layout: str, deterministic: bool, window_left: int = -1,
                 window_right: int = -1, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    with _on_torch_stream(q.device):
        _attention_backward(*(_to_cupy(x) for x in (dout, q, k, v, out, lse)), tuple(_to_cupy(g) for g in grads),
                            causal=causal, scale=scale, layout=layout, deterministic=deterministic, spec=None,
                            window_size=(window_left, window_right), softcap=softcap)
    return grads


_backward_op = torch.library.custom_op("cuflash::attention_backward", mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, causal, scale, layout, deterministic, window_left=-1, window_right=-1,
                   softcap=0.0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = tuple(options)


def _differentiate(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # The LSE is not differentiated through (as FlashAttention's): its gradient is ignored.
    dout = _readable(dout.to(out.dtype))
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


torch.library.register_autograd("cuflash::attention", _differentiate, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The same forward and backward as the operators, for eager calls (no dispatcher on the way)."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse = _forward_impl(q, k, v, *options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = _readable(dout.to(out.dtype))
        dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + (None,) * len(ctx.options)


# -- attention sinks: operators of their own (a sink logit per query head, differentiable) -------------

def _sinks_forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, causal: bool,
                        scale: float, layout: str, deterministic: bool, window_left: int = -1, window_right: int = -1,
                        softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_rows(q, layout), dtype=torch.float32, device=q.device)
    with _on_torch_stream(q.device):
        _attention(_to_cupy(q), _to_cupy(k), _to_cupy(v), (_to_cupy(out), _to_cupy(lse)), causal=causal, scale=scale,
                   return_lse=True, layout=layout, family=None, spec=None, fp8_format=None, q_descale=None,
                   k_descale=None, v_descale=None, out_dtype=None, key=None, sinks=_to_cupy(sinks),
                   window_size=(window_left, window_right), softcap=softcap)
    return out, lse


_sinks_op = torch.library.custom_op("cuflash::attention_sinks", mutates_args=())(_sinks_forward_impl)


@_sinks_op.register_fake
def _sinks_fake(q, k, v, sinks, causal, scale, layout, deterministic, window_left=-1, window_right=-1, softcap=0.0):
    return q.new_empty(q.shape), q.new_empty(_rows(q, layout), dtype=torch.float32)


def _sinks_backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, sinks: torch.Tensor, causal: bool, scale: float, layout: str,
                         deterministic: bool, window_left: int = -1, window_right: int = -1,
                         softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dsinks = torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    with _on_torch_stream(q.device):
        result = _attention_backward(*(_to_cupy(x) for x in (dout, q, k, v, out, lse)),
                                     tuple(_to_cupy(g) for g in grads), causal=causal, scale=scale, layout=layout,
                                     deterministic=deterministic, spec=None, sinks=_to_cupy(sinks),
                                     window_size=(window_left, window_right), softcap=softcap)
        _to_cupy(dsinks)[...] = result[3]
    return (*grads, dsinks)


_sinks_backward_op = torch.library.custom_op("cuflash::attention_sinks_backward", mutates_args=())(
    _sinks_backward_impl)


@_sinks_backward_op.register_fake
def _sinks_backward_fake(dout, q, k, v, out, lse, sinks, causal, scale, layout, deterministic, window_left=-1,
                         window_right=-1, softcap=0.0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), sinks.new_empty(sinks.shape)


def _sinks_setup_context(ctx, inputs, output):
    q, k, v, sinks, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse)
    ctx.options = tuple(options)


def _sinks_differentiate(ctx, dout, dlse):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dout = _readable(dout.to(out.dtype))
    dq, dk, dv, dsinks = _sinks_backward_op(dout, q, k, v, out, lse, sinks, *ctx.options)
    return (dq, dk, dv, dsinks) + (None,) * len(ctx.options)


torch.library.register_autograd("cuflash::attention_sinks", _sinks_differentiate, setup_context=_sinks_setup_context)


class _AttentionSinks(torch.autograd.Function):
    """The sinks' forward and backward for eager calls (no dispatcher on the way)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, *options):
        out, lse = _sinks_forward_impl(q, k, v, sinks, *options)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dout = _readable(dout.to(out.dtype))
        dq, dk, dv, dsinks = _sinks_backward_impl(dout, q, k, v, out, lse, sinks, *ctx.options)
        return (dq, dk, dv, dsinks) + (None,) * len(ctx.options)


# -- the call ---------------------------------------------------------------------------------------------

def _check(q, k, v, layout):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__}")
        if x.device.type != "cuda" and x.device.type != "meta":
            raise ValueError(f"{name} is on {x.device}; cuflash.torch.attention takes CUDA tensors")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name}.dtype={x.dtype} is not supported; use torch.float16, torch.bfloat16 or "
                            f"torch.float32")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use 'bhsd' ([batch, heads, seqlen, head_dim]) or "
                         f"'bshd' ([batch, seqlen, heads, head_dim])")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-d ({layout}), got q.shape={tuple(q.shape)}")


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, deterministic: bool = False, sinks=None, window_size=(-1, -1),
              softcap: float = 0.0, score_mod=None, mask_mod=None, block_mask=None):
    """:func:`cuflash.attention` on CUDA torch tensors, differentiable with respect to q, k and v.

    Args:
        q: [batch, heads, seqlen_q, head_dim] (``layout="bshd"``: [batch, seqlen_q, heads, head_dim]),
            float16, bfloat16 or float32, on a CUDA device; any strides (a last dim that is not
            contiguous is copied).
        k, v: [batch, heads_k, seqlen_k, head_dim] in the same layout and dtype; heads a multiple of
            heads_k (grouped-query attention).
        causal, scale, layout: as for :func:`cuflash.attention` (causal aligned bottom-right).
        return_lse: also return the natural-log LSE, float32 [batch, heads, seqlen_q]; it is not
            differentiated through.
        deterministic: the backward accumulates dQ in a fixed order (bit-identical runs).
        sinks: attention sinks (gpt-oss), a float tensor [heads] on q's device: one logit per query
            head added to its rows' softmax sums (see :func:`cuflash.attention`); differentiable.
        window_size, softcap: FlashAttention's sliding window ``(left, right)`` (-1: unbounded)
            and logit cap (0: none), as for :func:`cuflash.attention`.
        score_mod, mask_mod, block_mask: as for :func:`cuflash.attention`; the mods may capture
            torch tensors (read in place, constants without a gradient) as well as CuPy arrays.
            Calls with them run eagerly: under torch.compile they break the graph.

    Returns:
        The output, contiguous in ``layout`` and q's dtype (and the LSE with ``return_lse``), on
        torch's current stream.
    """
    variants = _NO_VARIANTS if no_variants(window_size, softcap) else _variants(window_size, softcap, causal)
    modded = score_mod is not None or mask_mod is not None or block_mask is not None
    if not _is_compiling() and type(q) is _Tensor and type(deterministic) is bool and sinks is None and not modded:
        # A repeated call that needs no gradient: straight to its plan.
        if scale is None:
            call_scale = 1.0 / math.sqrt(q.shape[-1])
        else:
            call_scale = float(scale) if type(scale) is float or type(scale) is int else None
        key = _plan_key(q, k, v, causal, call_scale, layout, variants) if call_scale is not None else None
        if key is not None and not ((q.requires_grad or k.requires_grad or v.requires_grad)
                                    and torch.is_grad_enabled()):
            planned = _planned(key, q, k, v, return_lse)
            if planned is not None:
                return planned if return_lse else planned[0]
    _check(q, k, v, layout)
    if isinstance(causal, torch.Tensor) or not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if sinks is not None:
        _check_sinks(q, sinks, layout)
    if modded:
        return _attention_with_mods(q, k, v, sinks, (score_mod, mask_mod, block_mask, causal, float(scale), layout,
                                                     deterministic, variants), return_lse)
    if sinks is not None:
        return _attention_with_sinks(q, k, v, sinks, causal, float(scale), layout, return_lse, deterministic, variants)
    args = (_readable(q), _readable(k), _readable(v), causal, float(scale), layout, deterministic, *variants)
    # Traced (torch.compile, meta tensors), the operator; eager, the same functions without the
    # dispatcher's per-call cost.
    traced = _is_compiling() or q.device.type != "cuda"
    if traced:
        out, lse = _attention_op(*args)
    elif q.requires_grad or k.requires_grad or v.requires_grad:
        out, lse = _Attention.apply(*args)
    else:  # nothing to differentiate: no autograd node
        out, lse = _forward_impl(*args)
    return (out, lse) if return_lse else out


def _variants(window_size, softcap, causal):
    """(window left, window right, softcap) of a call, checked as :func:`cuflash.attention` does."""
    left, right = validate_window(window_size, causal is True)
    return left, right, validate_softcap(softcap)


def _check_sinks(q, sinks, layout) -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor (one logit per query head), got "
                        f"{type(sinks).__module__}.{type(sinks).__name__}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device}, q on {q.device}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks.dtype={sinks.dtype} must be a floating-point dtype")
    heads = _rows(q, layout)[1]
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks.shape={tuple(sinks.shape)} must be (heads,) = ({heads},): one logit per query head")


def _attention_with_sinks(q, k, v, sinks, causal, scale, layout, return_lse, deterministic, variants):
    q, k, v = _readable(q), _readable(k), _readable(v)
    if _is_compiling() or q.device.type != "cuda":
        out, lse = _sinks_op(q, k, v, sinks, causal, scale, layout, deterministic, *variants)
    elif (q.requires_grad or k.requires_grad or v.requires_grad or sinks.requires_grad) and torch.is_grad_enabled():
        out, lse = _AttentionSinks.apply(q, k, v, sinks, causal, scale, layout, deterministic, *variants)
    else:
        out, lse = _sinks_forward_impl(q, k, v, sinks, causal, scale, layout, deterministic, *variants)
    return (out, lse) if return_lse else out


# -- transformers ---------------------------------------------------------------------------------------------

_warned: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def transformers_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    """An attention function for transformers' ``AttentionInterface``: query, key and value come
    as [batch, heads, seqlen, head_dim]; the output goes back as [batch, seqlen, heads, head_dim].
    Causal or full attention without a mask runs on cuflash, with the sliding window
    (``sliding_window``: W keys up to the query's own), the logit cap (``softcap``, Gemma 2) and the
    attention sinks (``s_aux``, gpt-oss) where given; a call with an explicit mask (padding, or
    one :func:`transformers_mask` leaves to SDPA's) or dropout runs on torch SDPA (with sinks, on
    :func:`_eager_attention`), with a warning once."""
    sinks = kwargs.pop("s_aux", None)
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    unsupported = [name for name, value_ in (("an attention mask", attention_mask is not None),
                                             ("dropout", bool(dropout) and module.training),
                                             ("float32 and a window or softcap", query.dtype == torch.float32
                                              and (window is not None or softcap is not None))) if value_]
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if unsupported:
        eager = sinks is not None or softcap is not None
        fallback = "torch (eager, with the sinks or the softcap)" if eager else "torch SDPA"
        _warn_once(",".join(unsupported), f"cuflash.torch: a call with {' and '.join(unsupported)} runs on "
                                          f"{fallback} (cuflash takes causal or full attention without a mask)")
        if attention_mask is None and window is not None:  # the mask transformers_mask left out
            attention_mask = _window_mask(query.shape[2], key.shape[2], window, causal, query.device)
        if eager:
            return _eager_attention(module, query, key, value, attention_mask, dropout, scaling, causal, sinks,
                                    softcap), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # One query row attends every key (decoding); otherwise the mask is causal, aligned as SDPA's
    # when transformers leaves it out (seqlen_q == seqlen_k).
    causal = causal and query.shape[2] > 1
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                    scale=scaling, layout="bshd", sinks=sinks,
                    window_size=(-1, -1) if window is None else (window - 1, 0),
                    softcap=0.0 if softcap is None else float(softcap))
    return out, None


def transformers_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                      attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' mask function for cuflash: None where :func:`transformers_attention` applies
    the mask itself (the queries end with the keys, no visible key is padding, and the mask is
    the causal one or the config's sliding window), else SDPA's dense mask (the attention then
    runs on SDPA)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    config = kwargs.get("config")
    plain = mask_function is causal_mask_function and local_size is None
    sliding = (local_size is not None and local_size == getattr(config, "sliding_window", None)
               and getattr(config, "attention_chunk_size", None) is None)
    if allow_is_causal_skip and q_length is not None and (plain or sliding) and _ends_together(
            q_offset, q_length, kv_offset, kv_length) and _unpadded(attention_mask, kv_offset, kv_length):
        return None
    if q_length is None:  # transformers before 5 (cache_position): SDPA's own rule for leaving the mask out
        return sdpa_mask(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, local_size=local_size,
                         allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False, **kwargs)


def _ends_together(q_offset, q_length, kv_offset, kv_length) -> bool:
    """Whether the last query sits at the last key's position (causal and windows bottom-right)."""
    return all(isinstance(x, int) for x in (q_offset, q_length, kv_offset, kv_length)) \
        and q_offset + q_length == kv_offset + kv_length


def _unpadded(attention_mask, kv_offset, kv_length) -> bool:
    """Whether a 2-d padding mask [batch, keys] leaves every visible key in (no mask: yes)."""
    if attention_mask is None:
        return True
    if attention_mask.dim() != 2 or _is_compiling():
        return False
    return bool(attention_mask[:, kv_offset:kv_offset + kv_length].all())


def _window_mask(seqlen_q: int, seqlen_k: int, window: int, causal: bool, device):
    """Boolean [1, 1, seqlen_q, seqlen_k]: the last ``window`` keys up to each query's position,
    bottom-right aligned (and none after it where ``causal``)."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    allowed = (i - j < window) & ((j <= i) if causal else (j - i < window))
    return allowed[None, None]


def _eager_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, sinks, softcap):
    """Attention in plain torch operations, [batch, seqlen, heads, head_dim] out: the scores,
    capped, masked (a boolean mask attends where True, a float mask is added), then the softmax
    over the scores and, with ``sinks``, the head's sink logit, whose share is dropped."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        mask = attention_mask[..., :key.shape[2]]
        lowest = torch.finfo(torch.float32).min  # as transformers' masks: a row with no key is uniform, not NaN
        scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask
    elif (getattr(module, "is_causal", True) if is_causal is None else is_causal) and query.shape[2] > 1:
        sq, sk = query.shape[2], key.shape[2]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
    else:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(value.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def register_transformers(name: str = TRANSFORMERS_NAME) -> str:
    """Register cuflash with transformers' attention interface under ``name`` (default
    ``"cuattn"``), with :func:`transformers_mask` as its mask function, and return the name: a model built with
    ``attn_implementation=name`` (or ``model.set_attn_implementation(name)``) runs its attention
    through cuflash."""
    if "flash" in name.lower():
        raise ValueError(f"name={name!r}: transformers takes any name containing 'flash' for a hub "
                         f"flash-attention kernel; choose another")
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, transformers_attention)
    AttentionMaskInterface.register(name, transformers_mask)
    return name


__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "append_kv", "register_transformers",
           "transformers_attention", "transformers_mask", "TRANSFORMERS_NAME"]
