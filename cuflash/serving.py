"""Serving helpers: combining partial attention results.

Attention over a union of key sets is a weighted combination of the attentions over its parts,
each weighted by its share of the softmax's denominator: with ``(O_i, LSE_i)`` the output and
natural-log LSE of part i,

    LSE = log(sum_i exp(LSE_i)),    O = sum_i exp(LSE_i - LSE) * O_i.

:func:`merge_states` computes that for a shared prefix attended once and each request's own
suffix, for a cascade, or for the pieces of a key range split across calls. It works on NumPy and
CuPy arrays alike (with the arrays' own module), in float32.
"""
from __future__ import annotations

from collections.abc import Sequence

from .fp8 import _xp

LAYOUTS = ("bhsd", "bshd")


def merge_states(outs: Sequence, lses: Sequence, *, layout: str = "bhsd"):
    """Merge partial attention results over disjoint key sets into the attention over their union.

    Args:
        outs: two or more outputs of the same query rows, each [batch, heads, seqlen_q, head_dim]
            (``layout="bshd"``: [batch, seqlen_q, heads, head_dim]), all of one dtype (float16,
            bfloat16 or float32), as :func:`cuflash.attention` returns them.
        lses: their natural-log LSEs, float32 [batch, heads, seqlen_q] (``return_lse=True``);
            ``-inf`` for a row that attended nothing in that part.
        layout: the outputs' layout.

    Returns:
        ``(out, lse)``: the output in the inputs' dtype and layout, and the float32 LSE. A row that
        attends nothing in every part gives 0 and ``-inf``; a NaN in one part's row stays in that row.
    """
    if isinstance(outs, (str, bytes)) or not isinstance(outs, Sequence) or not isinstance(lses, Sequence):
        raise TypeError(f"outs and lses must be sequences of arrays, got {type(outs).__name__} and "
                        f"{type(lses).__name__}")
    if len(outs) != len(lses) or len(outs) < 2:
        raise ValueError(f"merge_states takes two or more (out, lse) pairs; got {len(outs)} outputs and "
                         f"{len(lses)} LSEs")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use 'bhsd' or 'bshd'")
    xp = _xp(outs[0])
    first = outs[0]
    if getattr(first, "ndim", None) != 4:
        raise ValueError(f"outs[0] must be 4-d ({layout}), got shape {getattr(first, 'shape', None)}")
    b, s1, s2, _ = first.shape
    rows = (b, s1, s2) if layout == "bhsd" else (b, s2, s1)
    for i, (out, lse) in enumerate(zip(outs, lses)):
        if _xp(out) is not xp or _xp(lse) is not xp:
            raise TypeError(f"outs[{i}] and lses[{i}] must be arrays of the same module as outs[0] ({xp.__name__})")
        if out.shape != first.shape or out.dtype != first.dtype:
            raise ValueError(f"outs[{i}] is {out.dtype} {out.shape}; outs[0] is {first.dtype} {first.shape}")
        if lse.shape != rows or lse.dtype != xp.float32:
            raise ValueError(f"lses[{i}] must be float32 {rows} (batch, heads, seqlen_q); got {lse.dtype} {lse.shape}")
    if str(first.dtype) not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"outs have dtype {first.dtype}; merge_states takes float16, bfloat16 or float32 outputs")

    f32 = xp.float32
    stacked = xp.stack(list(lses))                                   # [parts, batch, heads, seqlen_q]
    top = stacked.max(axis=0)
    # Rows with no key in any part keep a finite pivot, so that exp(-inf - pivot) is exactly 0.
    pivot = xp.where(top == -xp.inf, f32(0), top)
    weights = xp.exp(stacked - pivot)
    total = weights.sum(axis=0)
    empty = total == 0
    lse = xp.where(empty, f32(-xp.inf), pivot + xp.log(xp.where(empty, f32(1), total))).astype(f32)
    shares = xp.where(empty, f32(0), weights / xp.where(empty, f32(1), total)).astype(f32)
    if layout == "bshd":
        shares = shares.transpose(0, 1, 3, 2)                        # [parts, batch, seqlen_q, heads]
    out = xp.zeros(first.shape, dtype=f32)
    for part, share in zip(outs, shares):
        # A part with no weight in a row adds nothing there (never 0 * NaN of a row it did not attend).
        contribution = share[..., None] * part.astype(f32)
        out += xp.where(share[..., None] == 0, f32(0), contribution)
    return out.astype(first.dtype), lse


__all__ = ["merge_states"]
