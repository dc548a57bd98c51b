"""NumPy references for the attention kernels (no CuPy, no GPU).

Numerical contract, shared by every function here and by the CUDA kernels:

* Layout ``"bhsd"``: q is ``[batch, heads_q, seqlen_q, head_dim]``, k and v are
  ``[batch, heads_k, seqlen_k, head_dim]``. Layout ``"bshd"``: ``[batch, seqlen, heads, head_dim]``.
* ``heads_q`` is a multiple of ``heads_k`` (grouped-query attention): query head ``h`` reads kv
  head ``h // (heads_q // heads_k)``.
* ``scale`` defaults to ``1 / sqrt(head_dim)``; the scores are ``S = scale * Q K^T``.
* Causal masking is aligned bottom-right: query ``i`` may attend key ``j`` iff
  ``j <= i + seqlen_k - seqlen_q``. With ``seqlen_q > seqlen_k`` the first
  ``seqlen_q - seqlen_k`` rows attend nothing.
* ``lse`` is the natural-log log-sum-exp of the scaled, masked scores of each query row,
  ``[batch, heads_q, seqlen_q]`` in both layouts.
* A row that attends nothing (fully masked, or ``seqlen_k == 0``) has ``out = 0`` and
  ``lse = -inf``, never NaN.

Functions:

* :func:`attention_reference` -- the float64 ground truth.
* :func:`attention_naive` -- softmax(QK^T)V written plainly in the input precision; its error
  against the reference is the yardstick of the accuracy rule in :mod:`cuflash.testing`.
* :func:`attention_backward_reference` -- float64 gradients (dq, dk, dv) of the output.
* :func:`attention_backward_naive` -- the same gradients in the input precision (the baseline of
  the backward's accuracy rule).
* :func:`attention_flops`, :func:`attention_backward_flops` -- causal-aware FLOP counts.
* :func:`attention_fp8_reference` -- the float64 ground truth of FP8 inputs (their dequantized
  values); :func:`attention_fp8_naive` -- the same computation in the inputs' precision, modelling
  the FP8 kernel's roundings (the baseline of FP8's accuracy rule).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from . import fp8
from .core import dtypes

LAYOUTS = ("bhsd", "bshd")

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2


# -- validation and layout ------------------------------------------------------------------------

def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; choose one of {LAYOUTS}")


def _to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _from_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def _prepare(q, k, v, scale, layout, compute_dtype):
    """Validate the inputs, convert them to ``compute_dtype`` and to the bhsd layout.

    Returns ``(q, k, v, scale)`` with k and v still holding ``heads_k`` heads.
    """
    _check_layout(layout)
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}.shape={x.shape} must have 4 dims ({layout})")
        if np.dtype(compute_dtype) != np.uint8 and x.dtype.name not in _FLOAT_NAMES:  # uint8: FP8 codes
            raise TypeError(f"{name}.dtype={x.dtype} is not a float dtype ({', '.join(_FLOAT_NAMES)})")
    if isinstance(scale, bool) or not (scale is None or isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"scale={scale} must be finite")
    if q.shape[-1] == 0:
        raise ValueError(f"q.shape={q.shape}: head_dim must be at least 1")
    qb, kb, vb = (_to_bhsd(x, layout) for x in (q, k, v))
    if kb.shape != vb.shape:
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be equal")
    if qb.shape[0] != kb.shape[0] or qb.shape[3] != kb.shape[3]:
        raise ValueError(f"q.shape={q.shape} and k.shape={k.shape} must agree on batch and head_dim "
                         f"(layout {layout!r})")
    heads_q, heads_k = qb.shape[1], kb.shape[1]
    if heads_k == 0 or heads_q % heads_k:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_k={heads_k} "
                         f"(q.shape={q.shape}, k.shape={k.shape}, layout {layout!r})")
    if scale is None:
        scale = 1.0 / math.sqrt(qb.shape[3])
    return (qb.astype(compute_dtype), kb.astype(compute_dtype), vb.astype(compute_dtype),
            float(scale))


def _expand_kv_heads(x: np.ndarray, heads_q: int) -> np.ndarray:
    """Repeat each kv head ``heads_q // heads_k`` times so query head h meets kv head h // group."""
    group = heads_q // x.shape[1]
    return x if group == 1 else np.repeat(x, group, axis=1)


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """``bool[seqlen_q, seqlen_k]``, True where query i may attend key j (bottom-right aligned)."""
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def _allowed(seqlen_q: int, seqlen_k: int, causal: bool, window=None) -> np.ndarray:
    """The pairs causal and the sliding window ``(left, right)`` (None: none) allow."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    allowed = causal_mask(seqlen_q, seqlen_k) if causal else np.ones((seqlen_q, seqlen_k), dtype=bool)
    if window is not None:
        rows = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
        cols = np.arange(seqlen_k)[None, :]
        left, right = window
        if left >= 0:
            allowed = allowed & (cols >= rows - left)
        if right >= 0:
            allowed = allowed & (cols <= rows + right)
    return allowed


def _variants(window_size, softcap, causal, score_mod, mask_mod):
    """(score_mod, window or None) of a call's ``window_size`` and ``softcap``, checked as
    :func:`cuflash.attention` checks them (a cap with a score_mod, or a window with a mask_mod, is
    refused)."""
    from .core.validate import no_variants, validate_variants, variant_mods

    if no_variants(window_size, softcap):
        return score_mod, None
    from .mods import softcap as _softcap

    variants = validate_variants(window_size, softcap, causal)
    if variants is None:
        return score_mod, None
    cap, window = variant_mods(variants, causal, score_mod, mask_mod)
    return (_softcap(cap) if cap else score_mod), window


# -- shared softmax pieces ------------------------------------------------------------------------

def _sink_logits(sinks, heads: int, dtype):
    """Attention sinks (one logit per query head) shaped to broadcast over [batch, heads, rows]."""
    sinks = np.asarray(sinks).astype(dtype)
    if sinks.shape != (heads,):
        raise ValueError(f"sinks.shape={sinks.shape} must be (heads,) = ({heads},)")
    return sinks.reshape(1, heads, 1)


def _masked_softmax_parts(scores: np.ndarray, allowed: np.ndarray, sinks=None):
    """Unnormalized softmax of ``scores`` over the last axis, masked by selection.

    Returns ``(p, row_max, row_sum, empty)`` where ``empty`` marks rows that attend nothing.
    Selection (not ``scores + (-inf)``) keeps a NaN score at a masked position out of the row.
    The row maximum of an empty row is -inf; it is replaced by 0 before subtracting so that
    ``exp(-inf - (-inf))`` never makes a NaN. A NaN anywhere in an allowed position makes the
    maximum NaN and so the whole row NaN. ``sinks`` (:func:`_sink_logits`): each row's sum also
    holds ``exp(sink - row_max)``, the row max being at least the sink.
    """
    masked = np.where(allowed, scores, -np.inf)
    row_max = masked.max(axis=-1, initial=-np.inf)
    if sinks is not None:
        row_max = np.maximum(row_max, sinks)
    row_max = np.where(row_max == -np.inf, 0.0, row_max).astype(scores.dtype)
    p = np.exp(masked - row_max[..., None])
    row_sum = p.sum(axis=-1)
    if sinks is not None:
        row_sum = row_sum + np.exp(sinks - row_max).astype(scores.dtype)
    empty = row_sum == 0   # False for NaN rows, so NaN survives the epilogue selections
    return p, row_max, row_sum, empty


def _weighted_values(p: np.ndarray, v: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``p @ v`` where a NaN value row j reaches only the query rows allowed to attend key j.

    A masked weight is exactly 0 and ``0 * NaN`` would otherwise spread the NaN to every row.
    """
    nan_values = np.isnan(v)
    if not nan_values.any():
        return p @ v
    out = p @ np.where(nan_values, 0, v).astype(v.dtype)
    reached = (allowed.astype(np.float32) @ nan_values.astype(np.float32)) > 0
    return np.where(reached, np.nan, out).astype(p.dtype)


def _finish(weighted, row_max, row_sum, empty):
    """Epilogue: normalize by the row sum and form the natural-log LSE; empty rows give 0 / -inf."""
    safe_sum = np.where(empty, 1, row_sum).astype(row_sum.dtype)
    out = np.where(empty[..., None], 0, weighted / safe_sum[..., None]).astype(weighted.dtype)
    lse = np.where(empty, -np.inf, row_max + np.log(safe_sum)).astype(row_sum.dtype)
    return out, lse


# -- float64 reference ----------------------------------------------------------------------------

def attention_reference(q, k, v, *, causal: bool = False, scale: float | None = None,
                        layout: str = "bhsd", score_mod=None, mask_mod=None, sinks=None, window_size=(-1, -1),
                        softcap: float = 0.0):
    """Scaled dot-product attention computed in float64.

    Args:
        q: ``[batch, heads_q, seqlen_q, head_dim]`` (``"bhsd"``) or
            ``[batch, seqlen_q, heads_q, head_dim]`` (``"bshd"``), any float dtype including
            ml_dtypes bfloat16; upcast to float64.
        k, v: ``[batch, heads_k, seqlen_k, head_dim]`` or ``[batch, seqlen_k, heads_k, head_dim]``;
            ``heads_q`` must be a multiple of ``heads_k``.
        causal: bottom-right aligned causal mask (see the module docstring).
        scale: score scale; ``1 / sqrt(head_dim)`` when None.
        layout: ``"bhsd"`` or ``"bshd"``.
        score_mod, mask_mod: a mod of :mod:`cuflash.mods` (or its traced graph), evaluated in
            float64 on the scaled scores and on the index grids; the mask is and-ed with causal.
        sinks: attention sinks, one logit per query head added to each row's softmax sum as
            ``exp(sinks[h])`` (no value); the LSE includes them.
        window_size, softcap: FlashAttention's sliding window ``(left, right)`` (query i sees
            keys i + d - left to i + d + right, d = seqlen_k - seqlen_q; -1: unbounded) and logit
            cap ``softcap * tanh(s / softcap)``, as :func:`cuflash.attention` takes them.

    Returns:
        ``(out, lse)``: ``out`` float64 with q's shape and layout; ``lse`` float64
        ``[batch, heads_q, seqlen_q]`` (natural log). Rows that attend nothing give 0 and -inf
        (with sinks: 0 and the sink).

    NaN stays where it belongs: a NaN in q row i makes only output row i NaN (unless row i attends
    nothing); a NaN in k or v row j makes NaN only the rows allowed to attend key j.
    """
    qb, kb, vb, scale = _prepare(q, k, v, scale, layout, np.float64)
    heads_q, seqlen_q, seqlen_k = qb.shape[1], qb.shape[2], kb.shape[2]
    kb, vb = _expand_kv_heads(kb, heads_q), _expand_kv_heads(vb, heads_q)
    score_mod, window = _variants(window_size, softcap, causal, score_mod, mask_mod)
    allowed = _allowed(seqlen_q, seqlen_k, causal, window)
    with np.errstate(invalid="ignore", over="ignore"):
        scores = (qb @ kb.swapaxes(-1, -2)) * scale
        scores, allowed = _with_mods(scores, allowed, score_mod, mask_mod)
        sink_logits = None if sinks is None else _sink_logits(sinks, heads_q, np.float64)
        p, row_max, row_sum, empty = _masked_softmax_parts(scores, allowed, sink_logits)
        out, lse = _finish(_weighted_values(p, vb, allowed), row_max, row_sum, empty)
    return _from_bhsd(out, layout), lse


def _with_mods(scores, allowed, score_mod, mask_mod):
    if score_mod is None and mask_mod is None:
        return scores, allowed
    from .mods import apply_to_scores
    return apply_to_scores(scores, allowed, score_mod, mask_mod)


# -- same-precision baseline ----------------------------------------------------------------------

def attention_naive(q, k, v, *, causal: bool = False, scale: float | None = None,
                    layout: str = "bhsd", score_mod=None, mask_mod=None, sinks=None, window_size=(-1, -1),
                    softcap: float = 0.0):
    """softmax(scale * Q K^T) V written plainly in the input precision.

    This is what a user gets without a fused kernel, and its error against
    :func:`attention_reference` is the baseline of the accuracy rule. Steps, for a 16-bit input
    dtype ``T``:

    1. ``S = Q K^T`` as a float32 matmul of the inputs, rounded to ``T``;
    2. ``S = S * scale`` with ``scale`` rounded to ``T``, the product rounded to ``T``;
    3. the masked softmax of ``S`` in float32, its probabilities rounded to ``T``;
    4. ``O = P V`` accumulated in float32, rounded to ``T``.

    Mods (``score_mod``, ``mask_mod``) apply in float32 between steps 2 and 3; ``sinks`` join
    step 3's sums in float32.

    For float32 inputs every rounding is a no-op, so the whole computation is float32.

    Shapes and layouts as in :func:`attention_reference`. Returns ``(out, lse)``: ``out`` in the
    input dtype and layout, ``lse`` float32 ``[batch, heads_q, seqlen_q]``.
    """
    entry = dtypes.from_numpy(np.asarray(q).dtype)
    for name, x in (("k", k), ("v", v)):
        if np.asarray(x).dtype != entry.numpy:
            raise TypeError(f"q.dtype={entry.numpy} and {name}.dtype={np.asarray(x).dtype} must be equal")
    io = entry.numpy
    f32 = np.float32
    qb, kb, vb, scale = _prepare(q, k, v, scale, layout, f32)
    heads_q, seqlen_q, seqlen_k = qb.shape[1], qb.shape[2], kb.shape[2]
    kb, vb = _expand_kv_heads(kb, heads_q), _expand_kv_heads(vb, heads_q)
    score_mod, window = _variants(window_size, softcap, causal, score_mod, mask_mod)
    allowed = _allowed(seqlen_q, seqlen_k, causal, window)
    scale_io = np.asarray(scale, dtype=f32).astype(io).astype(f32)
    with np.errstate(invalid="ignore", over="ignore"):
        # A product of two 16-bit floats is exact in float32, so rounding it once to T is the
        # correctly rounded multiply in T.
        scores = (qb @ kb.swapaxes(-1, -2)).astype(io).astype(f32)
        scores = (scores * scale_io).astype(io).astype(f32)
        scores, allowed = _with_mods(scores, allowed, score_mod, mask_mod)
        sink_logits = None if sinks is None else _sink_logits(sinks, heads_q, f32)
        p, row_max, row_sum, empty = _masked_softmax_parts(scores, allowed, sink_logits)
        safe_sum = np.where(empty, 1, row_sum).astype(f32)
        probs = (p / safe_sum[..., None]).astype(io).astype(f32)
        out = _weighted_values(probs, vb, allowed)
        out = np.where(empty[..., None], 0, out).astype(f32).astype(io)
        lse = np.where(empty, -np.inf, row_max + np.log(safe_sum)).astype(f32)
    return _from_bhsd(out, layout), lse


# -- FP8 inputs -----------------------------------------------------------------------------------

#: Output dtypes of FP8 attention.
FP8_OUT_DTYPES = ("bf16", "fp16")

#: The FP8 kernel multiplies the probabilities (in [0, 1]) by this before rounding them to e4m3
#: for P V: 256 P keeps e4m3's normal range (down to 2^-6) for every P >= 2^-14.
FP8_P_SCALE = 256.0


def _fp8_codes(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
        raise TypeError(f"{name}.dtype={x.dtype} must be uint8 (or int8) FP8 codes")
    return x.view(np.uint8)


def _fp8_descale(descale, name: str, batch: int, heads: int) -> np.ndarray:
    """A descale (None, a number, or float32 ``()`` / ``(batch, heads)``) as float32, shaped to
    broadcast over bhsd: ``(1, 1, 1, 1)`` or ``(batch, heads, 1, 1)``."""
    value = np.asarray(1.0 if descale is None else descale, dtype=np.float32)
    if value.shape == ():
        value = value.reshape(1, 1, 1, 1)
    elif value.shape == (batch, heads):
        value = value.reshape(batch, heads, 1, 1)
    else:
        raise ValueError(f"{name}.shape={value.shape} must be () (per tensor) or (batch, heads)="
                         f"{(batch, heads)} (per head)")
    if not np.all(np.isfinite(value)) or np.any(value < 0):
        raise ValueError(f"{name} must be finite and non-negative, got {descale!r}")
    return value


def _fp8_prepare(q, k, v, scale, layout, fp8_format, descales, compute_dtype):
    """Validate FP8 inputs and dequantize them in bhsd: ``value(code) * descale`` computed in
    ``compute_dtype`` (exact in float64; rounded once in float32). Returns ``(q, k, v, scale)``."""
    fmt = fp8.fp8_format(fp8_format).name
    codes = [_fp8_codes(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    qb, kb, vb, scale = _prepare(*codes, scale, layout, np.uint8)
    batch, heads_q, heads_k = qb.shape[0], qb.shape[1], kb.shape[1]
    out = []
    for x, heads, descale, name in ((qb, heads_q, descales[0], "q_descale"), (kb, heads_k, descales[1], "k_descale"),
                                    (vb, heads_k, descales[2], "v_descale")):
        factor = _fp8_descale(descale, name, batch, heads).astype(compute_dtype)
        out.append(fp8.from_fp8_bits(x, fmt).astype(compute_dtype) * factor)
    return (*out, scale)


def _out_dtype(out_dtype: str) -> np.dtype:
    if out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype!r} is not supported for FP8 inputs; choose one of {FP8_OUT_DTYPES}")
    return dtypes.from_tag(out_dtype).numpy


def attention_fp8_reference(q, k, v, *, causal: bool = False, scale: float | None = None, layout: str = "bhsd",
                            fp8_format: str = "e4m3", q_descale=None, k_descale=None, v_descale=None,
                            score_mod=None, mask_mod=None, sinks=None, window_size=(-1, -1), softcap: float = 0.0):
    """float64 attention of FP8 inputs: :func:`attention_reference` of their exact values
    ``value(code) * descale``.

    Args:
        q, k, v: uint8 (or int8) arrays of FP8 codes (:func:`cuflash.fp8.quantize_fp8`), shaped as
            for :func:`attention_reference`.
        fp8_format: ``"e4m3"`` or ``"e5m2"``.
        q_descale: None (1.0), a number, or float32 ``()`` / ``(batch, heads_q)``.
        k_descale, v_descale: None, a number, or float32 ``()`` / ``(batch, heads_k)``.
        score_mod, mask_mod: as for :func:`attention_reference`, on the descaled scores.
        sinks: as for :func:`attention_reference` (logits, not descaled).

    Returns float64 ``(out, lse)`` as :func:`attention_reference` does; the scores (and so the
    LSE) include the descales.
    """
    qb, kb, vb, scale = _fp8_prepare(q, k, v, scale, layout, fp8_format, (q_descale, k_descale, v_descale),
                                     np.float64)
    out, lse = attention_reference(qb, kb, vb, causal=causal, scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                                   sinks=sinks, window_size=window_size, softcap=softcap)
    return _from_bhsd(out, layout), lse


def attention_fp8_naive(q, k, v, *, causal: bool = False, scale: float | None = None, layout: str = "bhsd",
                        fp8_format: str = "e4m3", q_descale=None, k_descale=None, v_descale=None,
                        out_dtype: str = "bf16", score_mod=None, mask_mod=None, sinks=None, window_size=(-1, -1),
                        softcap: float = 0.0):
    """FP8 attention written plainly in the inputs' precision, with the FP8 kernel's roundings:
    the baseline of the accuracy rule for FP8 inputs. Steps:

    1. dequantize: ``value(code) * descale`` in float32;
    2. ``S = scale * Q K^T`` in float32 (the products of FP8 values are exact in float32);
    3. ``P = exp(S - rowmax)`` in float32 (masked), the row sum ``l`` from this unrounded P;
    4. ``P`` rounded for the product: ``round_e4m3(256 P) / 256`` (nearest even; 256 P <= 256
       never saturates, P < 2^-18 becomes 0);
    5. ``O = (P V) / l`` accumulated in float32, rounded to ``out_dtype``.

    Arguments as for :func:`attention_fp8_reference`, plus ``out_dtype`` ("bf16" or "fp16"). Mods
    apply in float32 between steps 2 and 3; ``sinks`` join step 3's sums in float32.
    Returns ``(out, lse)``: ``out`` in ``out_dtype`` and ``layout``, ``lse`` float32
    ``[batch, heads_q, seqlen_q]`` (natural log, from the float32 scores). Rows that attend
    nothing give 0 and -inf.

    With P's rounding error at most 2^-4 P (2^-18 below P = 2^-14) and ``sum P / l = 1``, the
    output differs from :func:`attention_fp8_reference` by at most about
    ``max|v| * (2^-4 + seqlen_k * 2^-18)`` plus the rounding to ``out_dtype``.
    """
    io = _out_dtype(out_dtype)
    f32 = np.float32
    qb, kb, vb, scale = _fp8_prepare(q, k, v, scale, layout, fp8_format, (q_descale, k_descale, v_descale), f32)
    heads_q, seqlen_q, seqlen_k = qb.shape[1], qb.shape[2], kb.shape[2]
    kb, vb = _expand_kv_heads(kb, heads_q), _expand_kv_heads(vb, heads_q)
    score_mod, window = _variants(window_size, softcap, causal, score_mod, mask_mod)
    allowed = _allowed(seqlen_q, seqlen_k, causal, window)
    with np.errstate(invalid="ignore", over="ignore"):
        scores = (qb @ kb.swapaxes(-1, -2)) * f32(scale)
        scores, allowed = _with_mods(scores, allowed, score_mod, mask_mod)
        scores = scores.astype(f32)
        sink_logits = None if sinks is None else _sink_logits(sinks, heads_q, f32)
        p, row_max, row_sum, empty = _masked_softmax_parts(scores, allowed, sink_logits)
        p_scaled = fp8.from_fp8_bits(fp8.to_fp8_bits(p * f32(FP8_P_SCALE), "e4m3"), "e4m3")
        weighted = _weighted_values(p_scaled / f32(FP8_P_SCALE), vb, allowed).astype(f32)
        out, lse = _finish(weighted, row_max, row_sum, empty)
    return _from_bhsd(out.astype(io), layout), lse.astype(f32)


# -- cost model -----------------------------------------------------------------------------------

def attention_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of (query, key) pairs that attend each other.

    Under the bottom-right causal rule row i attends ``max(0, i + seqlen_k - seqlen_q + 1)`` keys
    (never more than seqlen_k), so the counts of the last ``n = min(seqlen_q, seqlen_k)`` rows run
    ``seqlen_k - n + 1, ..., seqlen_k`` and every earlier row attends nothing.
    """
    if seqlen_q < 0 or seqlen_k < 0:
        raise ValueError(f"seqlen_q={seqlen_q} and seqlen_k={seqlen_k} must be non-negative")
    if not causal:
        return seqlen_q * seqlen_k
    n = min(seqlen_q, seqlen_k)
    return n * (2 * seqlen_k - n + 1) // 2


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> int:
    """Forward FLOPs: two matmuls (QK^T and PV) of 2 FLOPs per multiply-add over allowed pairs,
    ``4 * batch * heads * head_dim * pairs``; ``heads`` counts query heads."""
    return 4 * batch * heads * head_dim * attention_pairs(seqlen_q, seqlen_k, causal)


# -- float64 gradients ----------------------------------------------------------------------------

def attention_backward_reference(dout, q, k, v, *, causal: bool = False, scale: float | None = None,
                                 layout: str = "bhsd", score_mod=None, mask_mod=None, sinks=None,
                                 window_size=(-1, -1), softcap: float = 0.0):
    """Gradients of :func:`attention_reference`'s output, in float64.

    Args:
        dout: gradient of the loss with respect to ``out``; q's shape and layout.
        q, k, v, causal, scale, layout, score_mod, mask_mod, window_size, softcap: as for
            :func:`attention_reference`
            (a score_mod's derivative with respect to the score, traced as the mod is, scales dS).

        sinks: the forward's attention sinks.

    Returns:
        ``(dq, dk, dv)``, float64, shaped like q, k and v in ``layout`` (with ``sinks``: and
        dsinks, ``-sum over (batch, row) of P_sink * D``, P_sink the row's share of its sink).
        With grouped-query attention the gradients of the query heads that share a kv head are
        summed into it.

    With ``P = softmax(S)`` (masked entries exactly 0, rows that attend nothing all 0):
    ``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(dO * O)``, ``dS = P * (dP - D)``,
    ``dQ = scale * dS K`` and ``dK = scale * dS^T Q``. A row that attends nothing contributes no
    gradient anywhere.
    """
    qb, kb, vb, scale = _prepare(q, k, v, scale, layout, np.float64)
    dob = _to_bhsd(np.asarray(dout), layout).astype(np.float64)
    if dob.shape != qb.shape:
        raise ValueError(f"dout.shape={np.shape(dout)} must equal q.shape={np.shape(q)}")
    heads_q, heads_k, seqlen_q, seqlen_k = qb.shape[1], kb.shape[1], qb.shape[2], kb.shape[2]
    ke, ve = _expand_kv_heads(kb, heads_q), _expand_kv_heads(vb, heads_q)
    score_mod, window = _variants(window_size, softcap, causal, score_mod, mask_mod)
    allowed = _allowed(seqlen_q, seqlen_k, causal, window)
    with np.errstate(invalid="ignore", over="ignore"):
        raw = (qb @ ke.swapaxes(-1, -2)) * scale
        scores, allowed = _with_mods(raw, allowed, score_mod, mask_mod)
        sink_logits = None if sinks is None else _sink_logits(sinks, heads_q, np.float64)
        p, row_max, row_sum, empty = _masked_softmax_parts(scores, allowed, sink_logits)
        p = np.where(empty[..., None], 0.0, p / np.where(empty, 1.0, row_sum)[..., None])
        out = p @ ve
        dv = p.swapaxes(-1, -2) @ dob
        dp = dob @ ve.swapaxes(-1, -2)
        row_dot = (dob * out).sum(axis=-1, keepdims=True)
        if sinks is not None:
            sink_share = np.where(empty, 0.0, np.exp(sink_logits - row_max) / np.where(empty, 1.0, row_sum))
            dsinks = -(sink_share * row_dot[..., 0]).sum(axis=(0, 2))
        ds = p * (dp - row_dot)
        if score_mod is not None:
            from .mods import score_derivative
            ds = ds * np.where(allowed, score_derivative(raw, score_mod), 0.0)
        dq = scale * (ds @ ke)
        dk = scale * (ds.swapaxes(-1, -2) @ qb)
    group = heads_q // heads_k
    b, _, _, d = kb.shape
    dk = dk.reshape(b, heads_k, group, seqlen_k, d).sum(axis=2)
    dv = dv.reshape(b, heads_k, group, seqlen_k, d).sum(axis=2)
    grads = _from_bhsd(dq, layout), _from_bhsd(dk, layout), _from_bhsd(dv, layout)
    return grads if sinks is None else grads + (dsinks,)


def attention_backward_naive(dout, q, k, v, *, causal: bool = False, scale: float | None = None,
                             layout: str = "bhsd", score_mod=None, mask_mod=None, sinks=None,
                             window_size=(-1, -1), softcap: float = 0.0):
    """The gradients written plainly in the input precision: the baseline of the accuracy rule
    for the backward. For a 16-bit input dtype ``T``, every matmul accumulates in float32 and
    rounds its result to ``T``:

    1. ``P`` and ``O`` as in :func:`attention_naive` (``P`` rounded to ``T``);
    2. ``dV = P^T dO``, ``dP = dO V^T`` and ``D = rowsum(dO * O)`` (float32);
    3. ``dS = P * (dP - D)`` (times the score_mod's derivative) rounded to ``T``;
    4. ``dQ = scale * (dS K)`` and ``dK = scale * (dS^T Q)``, the products rounded to ``T`` before
       the scale and after it; grouped-query sums of dK and dV in float32, then rounded.

    For float32 inputs every rounding is a no-op. Returns ``(dq, dk, dv)`` in the input dtype,
    shaped like q, k and v in ``layout`` (with ``sinks``: and dsinks, float32, from the sinks'
    shares of the rounded P's sums).
    """
    entry = dtypes.from_numpy(np.asarray(q).dtype)
    io, f32 = entry.numpy, np.float32
    qb, kb, vb, scale = _prepare(q, k, v, scale, layout, f32)
    dob = _to_bhsd(np.asarray(dout), layout).astype(f32)
    if dob.shape != qb.shape:
        raise ValueError(f"dout.shape={np.shape(dout)} must equal q.shape={np.shape(q)}")
    heads_q, heads_k, seqlen_q, seqlen_k = qb.shape[1], kb.shape[1], qb.shape[2], kb.shape[2]
    ke, ve = _expand_kv_heads(kb, heads_q), _expand_kv_heads(vb, heads_q)
    score_mod, window = _variants(window_size, softcap, causal, score_mod, mask_mod)
    allowed = _allowed(seqlen_q, seqlen_k, causal, window)
    scale_io = np.asarray(scale, dtype=f32).astype(io).astype(f32)

    def rounded(x):
        return x.astype(f32).astype(io).astype(f32)

    with np.errstate(invalid="ignore", over="ignore"):
        raw = rounded(rounded(qb @ ke.swapaxes(-1, -2)) * scale_io)
        scores, allowed = _with_mods(raw, allowed, score_mod, mask_mod)
        sink_logits = None if sinks is None else _sink_logits(sinks, heads_q, f32)
        p, row_max, row_sum, empty = _masked_softmax_parts(scores, allowed, sink_logits)
        p = rounded(np.where(empty[..., None], 0, p / np.where(empty, 1, row_sum)[..., None]))
        out = rounded(p @ ve)
        dv = p.swapaxes(-1, -2) @ dob
        dp = rounded(dob @ ve.swapaxes(-1, -2))
        row_dot = (dob * out).sum(axis=-1, keepdims=True, dtype=f32)
        if sinks is not None:
            sink_share = np.where(empty, 0, np.exp(sink_logits - row_max) / np.where(empty, 1, row_sum)).astype(f32)
            dsinks = -(sink_share * row_dot[..., 0]).sum(axis=(0, 2), dtype=f32)
        ds = p * (dp - row_dot)
        if score_mod is not None:
            from .mods import score_derivative
            ds = ds * np.where(allowed, score_derivative(raw, score_mod), 0.0).astype(f32)
        ds = rounded(ds)
        dq = rounded(rounded(ds @ ke) * scale_io)
        dk = ds.swapaxes(-1, -2) @ qb
    group = heads_q // heads_k
    b, _, _, d = kb.shape
    dk = rounded(rounded(dk).reshape(b, heads_k, group, seqlen_k, d).sum(axis=2) * scale_io)
    dv = rounded(rounded(dv).reshape(b, heads_k, group, seqlen_k, d).sum(axis=2))
    grads = tuple(_from_bhsd(x.astype(io), layout) for x in (dq, dk, dv))
    return grads if sinks is None else grads + (dsinks,)


def attention_backward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                             causal: bool) -> int:
    """Backward FLOPs by the FlashAttention papers' convention: 2.5 times the forward."""
    return 5 * attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) // 2


__all__ = ["LAYOUTS", "attention_reference", "attention_naive", "attention_backward_reference",
           "attention_backward_naive",
           "causal_mask", "simulate_tiled", "tile_schedule", "attention_pairs", "attention_flops",
           "attention_backward_flops", "attention_fp8_reference", "attention_fp8_naive", "FP8_OUT_DTYPES",
           "FP8_P_SCALE"]
