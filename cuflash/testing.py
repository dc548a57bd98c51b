"""Test helpers for cuflash users: problems, Hypothesis strategies, and the accuracy rule.

Importing this module needs neither CuPy, nor a GPU, nor Hypothesis: CuPy is imported only by
functions handed CuPy arrays or asked for them, Hypothesis by the strategies and the profiles.

The accuracy rule (FlashAttention's): an output passes when

    max |out - ref| <= 2 * max |baseline - ref| + atol

where ``ref`` is the float64 :func:`~cuflash.reference.attention_reference` and ``baseline`` is
:func:`~cuflash.reference.attention_naive`, the same computation written plainly in the input
precision. Non-finite values (NaN, +-inf) must sit at exactly the same positions in both.

FP8 inputs (:class:`Fp8AttentionProblem`, :func:`fp8_attention_problems`) follow the same rule
with ``ref`` the float64 attention of the dequantized inputs
(:func:`~cuflash.reference.attention_fp8_reference`) and ``baseline``
:func:`~cuflash.reference.attention_fp8_naive`, under the tolerance rows ``"e4m3"`` / ``"e5m2"``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .core import dtypes, policy, spec
# The problems live in cuflash.problems; this module's names for them stay.
from .problems import (FP8_FORMATS, FP8_GRANULARITIES, FP8_OUT_DTYPES, AttentionProblem,  # noqa: F401
                       Fp8AttentionProblem, Fp8Inputs, to_numpy)

#: Sequence lengths that do not fall on tile boundaries; the strategies favour them.
AWKWARD_SEQLENS = (1, 17, 113, 239, 1023)

#: The head dims the FP8 strategy draws by default: those with Hopper FP8 tiles of their own
#: (policy.HOPPER_TILES: 64, 128, 256). FP8 runs at every head dim of spec.HEAD_DIMS; pass
#: ``head_dims=`` to draw others.
FP8_HEAD_DIMS = policy.HOPPER_TILES["fp8"]

#: Upper bound on ``batch * heads * seqlen_q * seqlen_k * head_dim`` of drawn problems, so the
#: float64 reference of one example stays well under a second on a laptop core.
MAX_PROBLEM_WORK = 1 << 26


@dataclass(frozen=True)
class Tolerance:
    atol: float       # added to 2x the baseline error; also the fallback's absolute part
    rtol: float       # fallback relative part, used when no baseline is given
    lse_atol: float   # |lse - ref_lse| <= lse_atol + lse_rtol * |ref_lse|
    lse_rtol: float


#: Per-dtype tolerances. ``out`` is a convex combination of value rows drawn from N(0, 1), so
#: |out| is at most a few units. ``atol`` is about two output ulps at |out| ~ 1 (fp16: ulp
#: 2^-10 ~ 9.8e-4; bf16: ulp 2^-7 ~ 7.8e-3; fp32: about eighty ulps of 2^-23, since float32
#: accumulation over thousands of keys and ex2.approx add more than the final rounding): it covers
#: the last rounding of ``out`` when the baseline happens to be exact (seqlen_k = 1, say). The
#: fallback ``rtol`` is about four unit roundoffs of the dtype (fp16 u = 2^-11, bf16 u = 2^-8).
#: ``lse`` comes from float32 scores of the (already rounded) inputs in every kernel, so its
#: tolerance reflects float32 accumulation over head_dim plus the approximate exp2/log2 of the
#: hardware, not the input dtype.
TOLERANCES: dict[str, Tolerance] = {
    "fp16": Tolerance(atol=2e-3, rtol=2e-3, lse_atol=1e-4, lse_rtol=1e-5),
    "bf16": Tolerance(atol=1.6e-2, rtol=1.6e-2, lse_atol=1e-4, lse_rtol=1e-5),
    "fp32": Tolerance(atol=1e-5, rtol=1e-5, lse_atol=1e-5, lse_rtol=1e-5),
    # FP8 inputs, keyed by format (bf16 or fp16 output). The error of ``out`` is dominated by P
    # rounded to e4m3 for P V (relative 2^-4 per probability), which the baseline carries too;
    # atol is the bf16 one, the coarser of the two outputs. The fallback rtol is that 2^-4. The
    # LSE comes from FP8 tensor-core scores: Hopper's FP8 wgmma is reported to keep about 14
    # bits while it sums a k-step, so the LSE is allowed about 2^-10 of its magnitude.
    "e4m3": Tolerance(atol=1.6e-2, rtol=6.25e-2, lse_atol=1e-3, lse_rtol=1e-3),
    "e5m2": Tolerance(atol=1.6e-2, rtol=6.25e-2, lse_atol=1e-3, lse_rtol=1e-3),
}


def _tolerance_tag(dtype) -> str:
    """The :data:`TOLERANCES` row of ``dtype``: a row name ("bf16", "e4m3", ...), an alias
    ("bfloat16"), a NumPy dtype or a :class:`cuflash.dtypes.DType`."""
    if isinstance(dtype, str) and dtype in TOLERANCES:
        return dtype
    tag = _dtype_entry(dtype).tag
    if tag not in TOLERANCES:
        raise ValueError(f"dtype {tag!r} has no tolerance row; choose one of {sorted(TOLERANCES)}")
    return tag


def _dtype_entry(dtype) -> dtypes.DType:
    if isinstance(dtype, dtypes.DType):
        return dtype
    if isinstance(dtype, str):
        return dtypes.from_tag(dtype)
    return dtypes.from_numpy(dtype)


# -- accuracy rule --------------------------------------------------------------------------------

def _as_float64(x) -> np.ndarray:
    return to_numpy(x).astype(np.float64)


def _nonfinite_mismatch(what: str, got: np.ndarray, want: np.ndarray) -> str | None:
    """A message if NaN / +inf / -inf do not sit at the same positions in ``got`` and ``want``."""
    checks = (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf))
    for label, test in checks:
        bad = test(got) != test(want)
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            return (f"{what}: {label} positions differ at {int(bad.sum())} of {bad.size} elements; "
                    f"first at index {index}: got {got[index]!r}, reference {want[index]!r}")
    return None


def _max_error(got: np.ndarray, want: np.ndarray):
    """``(max |got - want|, index)`` over positions where both are finite; ``(0.0, None)`` if none."""
    finite = np.isfinite(got) & np.isfinite(want)
    if not finite.any():
        return 0.0, None
    with np.errstate(invalid="ignore"):
        error = np.where(finite, np.abs(got - want), 0.0)
    index = np.unravel_index(int(np.argmax(error)), error.shape)
    return float(error[index]), tuple(int(i) for i in index)


def assert_attention_close(out, ref, dtype, *, baseline=None, lse=None, ref_lse=None,
                           baseline_lse=None, atol: float | None = None) -> None:
    """Check a kernel's output against the float64 reference; raise AssertionError if it fails.

    Args:
        out: the kernel's output (NumPy or CuPy array, any float dtype).
        ref: float64 reference output of the same shape.
        dtype: the input dtype: tag (``"bf16"``), NumPy dtype, or :class:`cuflash.dtypes.DType`;
            for FP8 inputs their format, ``"e4m3"`` or ``"e5m2"`` (a row of :data:`TOLERANCES`).
        baseline: :func:`~cuflash.reference.attention_naive` output for the same inputs. The rule is
            ``max|out - ref| <= 2 * max|baseline - ref| + atol``. Without a baseline each element
            must satisfy ``|out - ref| <= atol + rtol * |ref|`` with the table's ``rtol``.
        lse, ref_lse: the kernel's LSE and the reference LSE, checked when both are given:
            ``2 * max|baseline_lse - ref_lse| + lse_atol`` with ``baseline_lse``, else element-wise
            ``lse_atol + lse_rtol * |ref_lse|``.
        atol: overrides the table's ``atol`` for ``out``.

    NaN, +inf and -inf must sit at exactly the same positions as in the reference (so a fully
    masked row's ``lse = -inf`` must match exactly, and a NaN never passes by accident); only the
    finite positions are compared numerically.
    """
    tag = _tolerance_tag(dtype)
    tol = TOLERANCES[tag]
    _check_one("out", _as_float64(out), _as_float64(ref), tag,
               None if baseline is None else _as_float64(baseline),
               tol.atol if atol is None else atol, tol.rtol)
    if lse is not None and ref_lse is not None:
        _check_one("lse", _as_float64(lse), _as_float64(ref_lse), tag,
                   None if baseline_lse is None else _as_float64(baseline_lse),
                   tol.lse_atol, tol.lse_rtol)
    elif (lse is None) != (ref_lse is None):
        raise ValueError("pass both lse and ref_lse, or neither")


def assert_gradients_close(grads, ref_grads, dtype, *, baselines, atol: float | None = None) -> None:
    """The accuracy rule for ``(dq, dk, dv)``: each against its float64 reference, within twice
    the error of :func:`~cuflash.reference.attention_backward_naive`'s plus ``atol``, non-finite
    values at the same positions. Gradients are not bounded by 1 as the output is: the default
    ``atol`` is the dtype's times ``max(1, max |reference|)`` and ``sqrt(head_dim / 64)`` from
    64 (dS = P (dP - delta) cancels, the sums in another order than the baseline's)."""
    entry = _dtype_entry(dtype)
    tol = TOLERANCES[entry.tag]
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref_grads, baselines):
        want = _as_float64(want)
        finite = want[np.isfinite(want)]
        magnitude = (max(1.0, float(np.abs(finite).max())) if finite.size else 1.0) \
            * math.sqrt(max(1.0, want.shape[-1] / 64 if want.ndim else 1.0))
        _check_one(name, _as_float64(got), want, entry.tag, _as_float64(base),
                   tol.atol * magnitude if atol is None else atol, tol.rtol)


def _check_one(what, got, want, tag, baseline, atol, rtol) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape} differs from the reference's {want.shape}")
    message = _nonfinite_mismatch(what, got, want)
    if message:
        raise AssertionError(f"{message} ({tag})")
    error, index = _max_error(got, want)
    if index is None:
        return
    if baseline is not None:
        if baseline.shape != want.shape:
            raise ValueError(f"baseline shape {baseline.shape} differs from the reference's {want.shape}")
        baseline_error, _ = _max_error(baseline, want)
        bound = 2 * baseline_error + atol
        if error > bound:
            raise AssertionError(
                f"{what} ({tag}): max |out - ref| = {error:.3e} at index {index} "
                f"(out={got[index]!r}, ref={want[index]!r}) exceeds the allowed {bound:.3e} "
                f"= 2 x baseline error {baseline_error:.3e} + atol {atol:.1e}")
        return
    finite = np.isfinite(got) & np.isfinite(want)
    with np.errstate(invalid="ignore"):
        excess = np.where(finite, np.abs(got - want) - (atol + rtol * np.abs(want)), -np.inf)
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    if excess[worst] > 0:
        worst = tuple(int(i) for i in worst)
        raise AssertionError(
            f"{what} ({tag}): |out - ref| = {abs(got[worst] - want[worst]):.3e} at index {worst} "
            f"(out={got[worst]!r}, ref={want[worst]!r}) exceeds the allowed "
            f"{atol + rtol * abs(want[worst]):.3e} = atol {atol:.1e} + rtol {rtol:.1e} x |ref| "
            f"(no baseline given; max |out - ref| = {error:.3e} at index {index})")


# -- Hypothesis -----------------------------------------------------------------------------------

def seqlens(*, min_value: int = 1, max_value: int = 1023):
    """Sequence lengths in ``[min_value, max_value]``, biased towards :data:`AWKWARD_SEQLENS`."""
    from hypothesis import strategies as st
    awkward = [s for s in AWKWARD_SEQLENS if min_value <= s <= max_value]
    anything = st.integers(min_value, max_value)
    return st.one_of(st.sampled_from(awkward), anything) if awkward else anything


def seqlen_pairs(*, min_value: int = 1, max_value: int = 1023):
    """``(seqlen_q, seqlen_k)``: equal half the time, else drawn independently (so unequal both ways)."""
    from hypothesis import strategies as st

    lengths = seqlens(min_value=min_value, max_value=max_value)

    @st.composite
    def pairs(draw):
        seqlen_q = draw(lengths)
        seqlen_k = seqlen_q if draw(st.booleans()) else draw(lengths)
        return seqlen_q, seqlen_k

    return pairs()


def _draw_sizes(draw, pairs, head_dim, max_work, max_batch, max_heads, allow_gqa):
    """``(batch, heads, heads_k, seqlen_q, seqlen_k)`` drawn within ``max_work``: the longer
    sequence is shrunk first, then batch and heads take the room left."""
    from hypothesis import strategies as st

    seqlen_q, seqlen_k = draw(pairs)
    while seqlen_q * seqlen_k * head_dim > max_work and max(seqlen_q, seqlen_k) > 1:
        if seqlen_q >= seqlen_k:
            seqlen_q = max(1, max_work // (seqlen_k * head_dim))
        else:
            seqlen_k = max(1, max_work // (seqlen_q * head_dim))
    room = max(1, max_work // (seqlen_q * seqlen_k * head_dim))
    batch = draw(st.integers(1, max(1, min(max_batch, room))))
    heads = draw(st.integers(1, max(1, min(max_heads, room // batch))))
    if allow_gqa:
        heads_k = draw(st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0]))
    else:
        heads_k = heads
    return batch, heads, heads_k, seqlen_q, seqlen_k


def attention_problems(*, head_dims=None, dtypes=None, causal=None, layouts=("bhsd", "bshd"),
                       max_seqlen: int = 1023, max_batch: int = 2, max_heads: int = 4,
                       allow_gqa: bool = True, allow_strided: bool = True,
                       max_work: int = MAX_PROBLEM_WORK, variants: bool = False):
    """A Hypothesis strategy of :class:`AttentionProblem`.

    Head dims come from ``head_dims`` (default :data:`cuflash.core.spec.HEAD_DIMS`) and dtypes from
    ``dtypes`` (default every tag) through ``sampled_from``, so the set of kernels a test compiles
    stays bounded. ``causal`` is a bool to fix it or None to draw it. Sequence lengths favour
    :data:`AWKWARD_SEQLENS`. Problems whose ``work`` would exceed ``max_work`` are shrunk,
    batch and heads first, then the longer sequence, so the float64 reference stays fast.
    ``variants``: 16-bit problems also draw a ``window_size`` and a ``softcap`` (each compiles
    kernels of its own: keep the examples few).
    """
    from hypothesis import strategies as st

    head_dim_choices = tuple(spec.HEAD_DIMS if head_dims is None else head_dims)
    dtype_choices = tuple(_dtype_entry(t).tag for t in (dtypes or ("fp16", "bf16", "fp32")))
    causal_strategy = st.booleans() if causal is None else st.just(bool(causal))
    pairs = seqlen_pairs(max_value=max_seqlen)

    @st.composite
    def problems(draw):
        head_dim = draw(st.sampled_from(head_dim_choices))
        dtype = draw(st.sampled_from(dtype_choices))
        batch, heads, heads_k, seqlen_q, seqlen_k = _draw_sizes(draw, pairs, head_dim, max_work, max_batch,
                                                                max_heads, allow_gqa)
        causal_ = draw(causal_strategy)
        window, cap = (-1, -1), 0.0
        if variants and dtype != "fp32":
            bound = st.one_of(st.just(-1), st.integers(0, max(seqlen_q, seqlen_k)))
            window = (draw(bound), 0 if causal_ else draw(bound))
            cap = draw(st.sampled_from((0.0, 5.0, 30.0)))
        return AttentionProblem(
            batch=batch, heads=heads, heads_k=heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            head_dim=head_dim, dtype=dtype, causal=causal_,
            layout=draw(st.sampled_from(tuple(layouts))),
            strided=draw(st.booleans()) if allow_strided else False,
            scale=draw(st.one_of(st.none(), st.sampled_from((0.5, 0.0625, 1.0)))),
            window_size=window, softcap=cap)

    return problems()


def fp8_attention_problems(*, head_dims=FP8_HEAD_DIMS, formats=FP8_FORMATS, granularities=FP8_GRANULARITIES,
                           out_dtypes=FP8_OUT_DTYPES, causal=None, layouts=("bhsd", "bshd"),
                           max_seqlen: int = 1023, max_batch: int = 2, max_heads: int = 4,
                           allow_gqa: bool = True, outliers: bool = False,
                           max_work: int = MAX_PROBLEM_WORK):
    """A Hypothesis strategy of :class:`Fp8AttentionProblem`.

    Head dims, formats, granularities and output dtypes are ``sampled_from`` their arguments (by
    default every format, granularity and output dtype, and the head dims of
    :data:`FP8_HEAD_DIMS`), so the kernels a test compiles stay bounded.
    ``causal`` is a bool to fix it or None to draw it. Sequence lengths favour
    :data:`AWKWARD_SEQLENS` and are shrunk to ``max_work`` as in :func:`attention_problems`.
    With ``outliers`` half the problems get 4 outlier channels 50x larger in q and k, with the
    softmax scale divided by 50 to keep their scores in range, and are rotated half the time.
    """
    from hypothesis import strategies as st

    causal_strategy = st.booleans() if causal is None else st.just(bool(causal))
    pairs = seqlen_pairs(max_value=max_seqlen)

    @st.composite
    def problems(draw):
        head_dim = draw(st.sampled_from(tuple(head_dims)))
        fmt = draw(st.sampled_from(tuple(formats)))
        granularity = draw(st.sampled_from(tuple(granularities)))
        out_dtype = draw(st.sampled_from(tuple(out_dtypes)))
        batch, heads, heads_k, seqlen_q, seqlen_k = _draw_sizes(draw, pairs, head_dim, max_work, max_batch,
                                                                max_heads, allow_gqa)
        scale = draw(st.one_of(st.none(), st.sampled_from((0.5, 0.0625))))
        outlier_channels, rotate = 0, False
        if outliers and draw(st.booleans()):
            outlier_channels = min(4, head_dim)
            scale = (1.0 / math.sqrt(head_dim) if scale is None else scale) / 50
            rotate = draw(st.booleans())
        return Fp8AttentionProblem(
            batch=batch, heads=heads, heads_k=heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
            fp8_format=fmt, granularity=granularity, out_dtype=out_dtype, causal=draw(causal_strategy),
            layout=draw(st.sampled_from(tuple(layouts))), scale=scale, outliers=outlier_channels, rotate=rotate)

    return problems()


def kvcache_problems(*, head_dims=(64, 128), dtypes=("fp16", "bf16"), page_sizes=(None, 1, 16, 256),
                     packed=None, max_batch: int = 4, max_seqlen_q: int = 16, max_length: int = 1023,
                     max_heads: int = 8, allow_gqa: bool = True, variants: bool = False, fp8_formats=(None,)):
    """A Hypothesis strategy of :class:`~cuflash.serving.KVCacheAttentionProblem`: decode steps,
    speculative verification and chunked prefill over contiguous or paged caches.

    Head dims, dtypes and page sizes are ``sampled_from`` their arguments (None: a contiguous
    cache), so the kernels a test compiles stay bounded. Each sequence's length is drawn on its
    own, empty and full caches among them; half the contiguous ones are left-padded. Half the
    problems append new keys; ``packed`` (None:
    drawn) packs the queries by ``cu_seqlens_q``, each sequence its own count, some with none and
    some with more queries than keys. ``variants`` also draws a sliding window and a softcap.
    ``fp8_formats`` (None: a 16-bit cache) draws FP8 caches of codes too, with a descale.
    """
    from hypothesis import strategies as st

    from .serving import KVCacheAttentionProblem

    packed_strategy = st.booleans() if packed is None else st.just(bool(packed))

    @st.composite
    def problems(draw):
        head_dim = draw(st.sampled_from(tuple(head_dims)))
        dtype = draw(st.sampled_from(tuple(_dtype_entry(t).tag for t in dtypes)))
        page_size = draw(st.sampled_from(tuple(page_sizes)))
        batch = draw(st.integers(1, max_batch))
        heads_k = draw(st.sampled_from((1, 2))) if allow_gqa else 1
        heads = heads_k * (draw(st.sampled_from(tuple(g for g in (1, 2, 4, 8) if heads_k * g <= max_heads)))
                           if allow_gqa else 1)
        if not allow_gqa:
            heads = heads_k = draw(st.integers(1, max_heads))
        is_packed = draw(packed_strategy)
        seqlen_q = draw(st.integers(1, max_seqlen_q))
        seqlen_new = 0 if is_packed or not draw(st.booleans()) else draw(st.integers(1, max_seqlen_q))
        unit = page_size or 1
        capacity = -(-max(draw(seqlens(max_value=max_length)), seqlen_new + 1) // unit) * unit
        room = capacity - seqlen_new
        length = st.one_of(st.just(0), st.just(room), st.integers(0, room))
        lengths = tuple(draw(length) for _ in range(batch))
        counts = tuple(draw(st.integers(0, max_seqlen_q)) for _ in range(batch)) if is_packed else None
        causal = draw(st.booleans())
        window, cap = (-1, -1), 0.0
        if variants:
            bound = st.one_of(st.just(-1), st.integers(0, capacity))
            window = (draw(bound), 0 if causal else draw(bound))
            cap = draw(st.sampled_from((0.0, 5.0, 30.0)))
        splits = draw(st.sampled_from((None, 1, 3)))
        fp8_format = draw(st.sampled_from(tuple(fp8_formats))) if head_dim % 16 == 0 else None
        pads = None
        if page_size is None and draw(st.booleans()):  # left-padded contiguous caches
            pads = tuple(draw(st.integers(0, n)) for n in lengths)
        return KVCacheAttentionProblem(batch=batch, heads=heads, heads_k=heads_k, head_dim=head_dim, dtype=dtype,
                                       lengths=lengths, capacity=capacity, seqlen_q=seqlen_q, seqlen_new=seqlen_new,
                                       page_size=page_size, causal=causal, window_size=window, softcap=cap,
                                       num_splits=splits, packed_counts=counts, leftpads=pads, fp8_format=fp8_format,
                                       descale=draw(st.sampled_from((1.0, 0.25))) if fp8_format else 1.0)

    return problems()


def varlen_problems(*, head_dims=(64, 128), dtypes=("fp16", "bf16"), causal=None, max_batch: int = 5,
                    max_seqlen: int = 1023, max_heads: int = 8, allow_gqa: bool = True, variants: bool = False,
                    max_work: int = MAX_PROBLEM_WORK):
    """A Hypothesis strategy of :class:`~cuflash.serving.VarlenAttentionProblem`: packed sequences
    whose query and key counts are drawn per sequence (empty and one-token sequences among them,
    equal counts half the time), shrunk to ``max_work`` over all sequences.

    Head dims and dtypes are ``sampled_from`` their arguments, so the kernels a test compiles stay
    bounded; ``causal`` is a bool to fix it or None to draw it; ``variants`` also draws a sliding
    window and a softcap.
    """
    from hypothesis import strategies as st

    from .serving import VarlenAttentionProblem

    causal_strategy = st.booleans() if causal is None else st.just(bool(causal))
    length = st.one_of(st.just(0), seqlens(max_value=max_seqlen))

    @st.composite
    def problems(draw):
        head_dim = draw(st.sampled_from(tuple(head_dims)))
        dtype = draw(st.sampled_from(tuple(_dtype_entry(t).tag for t in dtypes)))
        heads_k = draw(st.sampled_from((1, 2))) if allow_gqa else 1
        heads = heads_k * draw(st.sampled_from(tuple(g for g in (1, 2, 4, 8) if heads_k * g <= max_heads)))
        batch = draw(st.integers(1, max_batch))
        lengths_q, lengths_k = [], []
        for _ in range(batch):
            n = draw(length)
            lengths_q.append(n)
            lengths_k.append(n if draw(st.booleans()) else draw(length))
        while sum(a * b for a, b in zip(lengths_q, lengths_k)) * heads * head_dim > max_work:
            longest = max(range(batch), key=lambda i: lengths_q[i] * lengths_k[i])
            lengths_q[longest], lengths_k[longest] = lengths_q[longest] // 2, lengths_k[longest] // 2
        causal_ = draw(causal_strategy)
        window, cap = (-1, -1), 0.0
        if variants:
            bound = st.one_of(st.just(-1), st.integers(0, max(max(lengths_q), max(lengths_k))))
            window = (draw(bound), 0 if causal_ else draw(bound))
            cap = draw(st.sampled_from((0.0, 5.0, 30.0)))
        return VarlenAttentionProblem(heads=heads, heads_k=heads_k, head_dim=head_dim, dtype=dtype,
                                      lengths_q=tuple(lengths_q), lengths_k=tuple(lengths_k), causal=causal_,
                                      window_size=window, softcap=cap)

    return problems()


def register_hypothesis_profiles(load: str | None = None) -> tuple[str, ...]:
    """Register the ``"ci"`` and ``"dev"`` Hypothesis profiles; load ``load`` if given.

    ``ci`` is derandomized (the same examples every run, so a red build reproduces) with a bounded
    example count. Both profiles have no deadline: the first call of each specialization compiles
    a kernel, which takes far longer than any later call.
    """
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30,
                              print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", deadline=None, max_examples=10,
                              suppress_health_check=[HealthCheck.too_slow])
    if load is not None:
        settings.load_profile(load)
    return ("ci", "dev")


__all__ = ["AWKWARD_SEQLENS", "MAX_PROBLEM_WORK", "Tolerance", "TOLERANCES", "AttentionProblem",
           "FP8_FORMATS", "FP8_GRANULARITIES", "FP8_OUT_DTYPES", "FP8_HEAD_DIMS", "Fp8Inputs",
           "Fp8AttentionProblem", "fp8_attention_problems",
           "assert_gradients_close",
           "assert_attention_close", "to_numpy", "seqlens", "seqlen_pairs", "attention_problems", "kvcache_problems", "varlen_problems",
           "register_hypothesis_profiles"]
