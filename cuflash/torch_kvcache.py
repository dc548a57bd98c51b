"""KV-cache attention for PyTorch: :func:`cuflash.attention_with_kvcache` on CUDA torch tensors
(inference, not differentiable). :mod:`cuflash.torch` exports it. Eager calls go straight to
cuflash; traced ones (torch.compile, meta tensors) to the operator
``torch.ops.cuflash.attention_with_kvcache``, which appends to the caches in place."""
from __future__ import annotations

import numbers

import torch

from .torch_interop import _on_torch_stream, _to_cupy, _to_torch


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, page_table=None,
                           causal=True, scale=None, window_size=(-1, -1), softcap=0.0, num_splits=None,
                           return_lse=False, fp8_format=None, k_descale=None, v_descale=None, sinks=None,
                           score_mod=None, mask_mod=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                           cache_batch_idx=None, cu_seqlens_q=None, max_seqlen_q=None, cache_leftpad=None):
    """:func:`cuflash.attention_with_kvcache` on CUDA torch tensors (inference: not differentiable),
    on torch's current device and stream: the caches are read, and appended to, in place; an FP8
    cache is a torch.uint8 tensor of codes, lengths, offsets and page tables torch.int32. Under
    torch.compile (``fullgraph=True`` too) the call is one operator that mutates the caches;
    calls with mods run eagerly (they may capture torch tensors), a graph break there."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor) or x.device.type not in ("cuda", "meta"):
            raise TypeError(f"{name} must be a CUDA torch tensor, got {type(x).__name__}"
                            + (f" on {x.device}" if isinstance(x, torch.Tensor) else ""))
    arrays = dict(k_new=k_new, v_new=v_new, page_table=page_table, sinks=sinks, rotary_cos=rotary_cos,
                  rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx, cu_seqlens_q=cu_seqlens_q,
                  cache_leftpad=cache_leftpad)
    options = dict(causal=causal, scale=scale, window_size=window_size, softcap=softcap, num_splits=num_splits,
                   fp8_format=fp8_format, rotary_interleaved=rotary_interleaved, max_seqlen_q=max_seqlen_q)
    if score_mod is not None or mask_mod is not None:
        out, lse = _with_mods(q, k_cache, v_cache, cache_seqlens, k_descale, v_descale, arrays,
                              dict(options, score_mod=score_mod, mask_mod=mask_mod))
    elif torch.compiler.is_compiling() or q.device.type == "meta":
        out, lse = _op(q, k_cache, v_cache, *_lengths(cache_seqlens), *_descale(k_descale, "k_descale"),
                       *_descale(v_descale, "v_descale"), *(arrays[name] for name in _ARRAYS),
                       *_op_options(options))
    else:
        out, lse = _eager(q, k_cache, v_cache, cache_seqlens, k_descale, v_descale, arrays, options)
    return (out, lse) if return_lse else out


#: The optional tensors of a call, in the operator's order.
_ARRAYS = ("k_new", "v_new", "page_table", "sinks", "rotary_cos", "rotary_sin", "cache_batch_idx", "cu_seqlens_q",
           "cache_leftpad")


def append_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """:func:`cuflash.append_kv` on CUDA torch tensors (slot_mapping torch.int32), in place, on
    torch's current stream; under torch.compile the operator ``torch.ops.cuflash.append_kv``."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if not isinstance(x, torch.Tensor) or x.device.type not in ("cuda", "meta"):
            raise TypeError(f"{name} must be a CUDA torch tensor, got {type(x).__name__}"
                            + (f" on {x.device}" if isinstance(x, torch.Tensor) else ""))
    if torch.compiler.is_compiling() or k_cache.device.type == "meta":
        _append_op(k_cache, v_cache, k, v, slot_mapping)
    else:
        _append_impl(k_cache, v_cache, k, v, slot_mapping)


def _append_impl(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    from .kvcache import append_kv as _append

    with _on_torch_stream(k_cache.device):
        _append(*(_to_cupy(x) for x in (k_cache, v_cache, k, v, slot_mapping)))


_append_op = torch.library.custom_op("cuflash::append_kv", mutates_args=("k_cache", "v_cache"))(_append_impl)


@_append_op.register_fake
def _append_fake(k_cache, v_cache, k, v, slot_mapping):
    return None


def _eager(q, k_cache, v_cache, cache_seqlens, k_descale, v_descale, arrays, options):
    """(out, lse) of the CuPy call on views of the tensors."""
    from .kvcache import attention_with_kvcache as _kvcache

    def view(x):
        return _to_cupy(x) if isinstance(x, torch.Tensor) else x

    with _on_torch_stream(q.device):
        out, lse = _kvcache(view(q), view(k_cache), view(v_cache), cache_seqlens=view(cache_seqlens),
                            k_descale=view(k_descale), v_descale=view(v_descale), return_lse=True,
                            **{name: view(x) for name, x in arrays.items()}, **options)
    return _to_torch(out), _to_torch(lse)


@torch.compiler.disable  # the mods are Python functions, which no operator schema takes
def _with_mods(q, k_cache, v_cache, cache_seqlens, k_descale, v_descale, arrays, options):
    if q.device.type == "meta":
        raise ValueError("score_mod and mask_mod run on CUDA tensors, not on meta tensors")
    return _eager(q, k_cache, v_cache, cache_seqlens, k_descale, v_descale, arrays, options)


def _lengths(cache_seqlens):
    """(tensor or None, int) of cache_seqlens for the operator (an int is passed as a number)."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens, 0
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        return None, int(cache_seqlens)
    raise TypeError(f"cache_seqlens must be a torch.int32 tensor [batch] or an int, got {cache_seqlens!r}")


def _descale(value, name):
    """(tensor or None, factor) of an FP8 descale for the operator."""
    if value is None or isinstance(value, torch.Tensor):
        return value, 1.0
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return None, float(value)
    raise TypeError(f"{name} must be a positive number or a torch.float32 tensor, got {value!r}")


def _op_options(options):
    left, right = options["window_size"]
    scale = options["scale"]
    return (bool(options["causal"]), None if scale is None else float(scale), int(left), int(right),
            float(options["softcap"]), options["num_splits"], options["fp8_format"],
            bool(options["rotary_interleaved"]), options["max_seqlen_q"])


# -- the operator (traced calls) -------------------------------------------------------------------------

def _op_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None,
             cache_seqlens_int: int, k_descale: torch.Tensor | None, k_descale_factor: float,
             v_descale: torch.Tensor | None, v_descale_factor: float, k_new: torch.Tensor | None,
             v_new: torch.Tensor | None, page_table: torch.Tensor | None, sinks: torch.Tensor | None,
             rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
             cache_batch_idx: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
             cache_leftpad: torch.Tensor | None, causal: bool,
             scale: float | None, window_left: int, window_right: int, softcap: float, num_splits: int | None,
             fp8_format: str | None, rotary_interleaved: bool,
             max_seqlen_q: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    arrays = dict(k_new=k_new, v_new=v_new, page_table=page_table, sinks=sinks, rotary_cos=rotary_cos,
                  rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx, cu_seqlens_q=cu_seqlens_q,
                  cache_leftpad=cache_leftpad)
    options = dict(causal=causal, scale=scale, window_size=(window_left, window_right), softcap=softcap,
                   num_splits=num_splits, fp8_format=fp8_format, rotary_interleaved=rotary_interleaved,
                   max_seqlen_q=max_seqlen_q)
    lengths = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    k_scale = k_descale if k_descale is not None else (None if k_descale_factor == 1.0 else k_descale_factor)
    v_scale = v_descale if v_descale is not None else (None if v_descale_factor == 1.0 else v_descale_factor)
    return _eager(q, k_cache, v_cache, lengths, k_scale, v_scale, arrays, options)


_op = torch.library.custom_op("cuflash::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))(_op_impl)


@_op.register_fake
def _op_fake(q, k_cache, v_cache, cache_seqlens, cache_seqlens_int, k_descale, k_descale_factor, v_descale,
             v_descale_factor, k_new, v_new, page_table, sinks, rotary_cos, rotary_sin, cache_batch_idx, cu_seqlens_q,
             cache_leftpad, causal, scale, window_left, window_right, softcap, num_splits, fp8_format, rotary_interleaved,
             max_seqlen_q):
    if cu_seqlens_q is not None:  # packed [total_q, heads, head_dim]: LSE [heads, total_q]
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-d [batch, seqlen_q, heads, head_dim], got {tuple(q.shape)}")
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


__all__ = ["attention_with_kvcache", "append_kv"]
