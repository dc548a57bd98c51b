"""The float64 reference, the naive baseline and the FLOP count against first principles (CPU only)."""
import itertools
import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from cuflash import reference
from cuflash.reference import (attention_flops, attention_naive, attention_pairs,
                               attention_reference, causal_mask)


def _inputs(batch, heads_q, heads_k, seqlen_q, seqlen_k, head_dim, seed=0, layout="bhsd"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads_q, seqlen_q, head_dim))
    k = rng.standard_normal((batch, heads_k, seqlen_k, head_dim))
    v = rng.standard_normal((batch, heads_k, seqlen_k, head_dim))
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3).copy() for x in (q, k, v))
    return q, k, v


def _textbook(q, k, v, causal, scale):
    """Row by row, straight from the definition (bhsd only)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    out = np.zeros(q.shape)
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b, h, i in itertools.product(range(batch), range(heads_q), range(seqlen_q)):
        keys = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
        if not keys:
            continue
        scores = np.array([scale * np.dot(q[b, h, i], k[b, h // group, j]) for j in keys])
        weights = np.exp(scores - scores.max())
        out[b, h, i] = sum(w * v[b, h // group, j] for w, j in zip(weights, keys)) / weights.sum()
        lse[b, h, i] = scores.max() + math.log(weights.sum())
    return out, lse


SHAPES = [  # batch, heads_q, heads_k, seqlen_q, seqlen_k, head_dim
    (1, 1, 1, 1, 1, 8),
    (2, 2, 2, 5, 5, 8),
    (1, 4, 2, 7, 3, 16),
    (2, 3, 1, 3, 9, 24),
    (1, 2, 1, 17, 17, 40),
    (1, 1, 1, 6, 1, 8),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_textbook(shape, causal):
    q, k, v = _inputs(*shape)
    scale = 0.3
    out, lse = attention_reference(q, k, v, causal=causal, scale=scale)
    want_out, want_lse = _textbook(q, k, v, causal, scale)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert lse.shape == shape[:2] + (shape[3],)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _inputs(1, 2, 2, 5, 6, 24)
    np.testing.assert_array_equal(attention_reference(q, k, v)[0],
                                  attention_reference(q, k, v, scale=1 / math.sqrt(24))[0])


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_rows_sum_to_one(causal):
    q, k, _ = _inputs(2, 2, 2, 9, 6, 8)
    ones = np.ones(k.shape)
    out, _ = attention_reference(q, k, ones, causal=causal)
    attends = causal_mask(9, 6).any(axis=1) if causal else np.ones(9, bool)
    want = np.where(attends[None, None, :, None], 1.0, 0.0)
    np.testing.assert_allclose(out, np.broadcast_to(want, out.shape), rtol=1e-14, atol=0)


def test_equal_lengths_causal_is_lower_triangle():
    for n in (1, 2, 17):
        np.testing.assert_array_equal(causal_mask(n, n), np.tril(np.ones((n, n), bool)))


def test_causal_mask_is_bottom_right_aligned():
    np.testing.assert_array_equal(causal_mask(2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(4, 2), [[0, 0], [0, 0], [1, 0], [1, 1]])


def test_causal_longer_queries_gives_empty_rows_without_nan_or_warnings():
    q, k, v = _inputs(2, 2, 1, 11, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            out, lse = attention_reference(q, k, v, causal=True)
            naive_out, naive_lse = attention_naive(q.astype(np.float32), k.astype(np.float32),
                                                   v.astype(np.float32), causal=True)
    for o, l in ((out, lse), (naive_out, naive_lse)):
        assert not np.isnan(o).any() and not np.isnan(l).any()
        assert (o[:, :, :7] == 0).all()
        assert np.isneginf(l[:, :, :7]).all()
        assert np.isfinite(l[:, :, 7:]).all()
        assert (o[:, :, 7:] != 0).all()


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(3, 10), (10, 3), (6, 6), (1, 7)])
def test_causal_row_equals_full_attention_over_its_prefix(seqlen_q, seqlen_k):
    q, k, v = _inputs(1, 2, 2, seqlen_q, seqlen_k, 16, seed=3)
    out, lse = attention_reference(q, k, v, causal=True)
    for i in range(seqlen_q):
        last = i + seqlen_k - seqlen_q
        if last < 0:
            continue
        row_out, row_lse = attention_reference(q[:, :, i:i + 1], k[:, :, :last + 1], v[:, :, :last + 1])
        np.testing.assert_allclose(out[:, :, i:i + 1], row_out, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(lse[:, :, i:i + 1], row_lse, rtol=1e-13, atol=1e-13)


def test_empty_keys_give_zero_and_minus_inf():
    q, k, v = _inputs(1, 2, 2, 5, 0, 8)
    for causal in (False, True):
        out, lse = attention_reference(q, k, v, causal=causal)
        assert out.shape == q.shape and (out == 0).all() and np.isneginf(lse).all()
        naive, naive_lse = attention_naive(q.astype(np.float16), k.astype(np.float16),
                                           v.astype(np.float16), causal=causal)
        assert (naive == 0).all() and np.isneginf(naive_lse).all()


@pytest.mark.parametrize("causal", [False, True])
def test_bshd_is_bhsd_transposed(causal):
    q, k, v = _inputs(2, 4, 2, 7, 13, 16)
    out, lse = attention_reference(q, k, v, causal=causal)
    t = lambda x: x.transpose(0, 2, 1, 3)
    out_bshd, lse_bshd = attention_reference(t(q), t(k), t(v), causal=causal, layout="bshd")
    assert out_bshd.shape == t(q).shape
    np.testing.assert_array_equal(t(out_bshd), out)
    np.testing.assert_array_equal(lse_bshd, lse)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_equals_repeated_kv_heads(causal):
    q, k, v = _inputs(2, 6, 2, 5, 8, 8)
    out, lse = attention_reference(q, k, v, causal=causal)
    out_rep, lse_rep = attention_reference(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1),
                                           causal=causal)
    np.testing.assert_array_equal(out, out_rep)
    np.testing.assert_array_equal(lse, lse_rep)
    # query head h reads kv head h // 3
    out_h4, _ = attention_reference(q[:, 4:5], k[:, 1:2], v[:, 1:2], causal=causal)
    np.testing.assert_array_equal(out[:, 4:5], out_h4)


def test_lse_is_log_sum_exp_of_scaled_scores():
    q, k, v = _inputs(1, 2, 2, 4, 6, 8)
    scale = 0.7
    _, lse = attention_reference(q, k, v, scale=scale)
    scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    np.testing.assert_allclose(lse, np.log(np.exp(scores).sum(-1)), rtol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_invariants(causal):
    q, k, v = _inputs(1, 2, 1, 6, 9, 16, seed=5)
    scale = 0.25
    out, lse = attention_reference(q, k, v, causal=causal, scale=scale)
    attends = causal_mask(6, 9).any(axis=1)[None, None] if causal else True
    # A common offset c on every key adds scale * q_i . c to every score of row i: the softmax
    # is unchanged and the LSE moves by exactly that amount.
    c = np.random.default_rng(9).standard_normal(16)
    out_c, lse_c = attention_reference(q, k + c, v, causal=causal, scale=scale)
    np.testing.assert_allclose(out_c, out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse_c, lse + scale * (q @ c), rtol=1e-12, atol=1e-12)
    # A common offset on every value row moves each attending row's output by it.
    out_v, _ = attention_reference(q, k, v + c, causal=causal, scale=scale)
    np.testing.assert_allclose(out_v, out + np.where(np.asarray(attends)[..., None], c, 0),
                               rtol=1e-12, atol=1e-12)
    # Scaling q by a and the softmax scale by 1/a changes nothing.
    out_a, lse_a = attention_reference(q * 4.0, k, v, causal=causal, scale=scale / 4.0)
    np.testing.assert_allclose(out_a, out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse_a, lse, rtol=1e-12, atol=1e-13)


def test_key_permutation_invariance_without_mask():
    q, k, v = _inputs(2, 2, 2, 5, 11, 8)
    perm = np.random.default_rng(1).permutation(11)
    out, lse = attention_reference(q, k, v)
    out_p, lse_p = attention_reference(q, k[:, :, perm], v[:, :, perm])
    np.testing.assert_allclose(out_p, out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse_p, lse, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_query_row_stays_in_that_row(causal):
    q, k, v = _inputs(1, 2, 2, 6, 4, 8)
    q[0, 1, 4, 3] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention_reference(q, k, v, causal=causal)
    bad = np.zeros(out.shape, bool)
    bad[0, 1, 4] = True
    np.testing.assert_array_equal(np.isnan(out), bad)
    np.testing.assert_array_equal(np.isnan(lse), bad[..., 0])
    if causal:
        # a row that attends nothing does not read q at all
        q[0, 0, 0, 0] = np.nan
        out, lse = attention_reference(q, k, v, causal=True)
        assert (out[0, 0, 0] == 0).all() and np.isneginf(lse[0, 0, 0])


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(5, 5), (7, 4), (3, 8)])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_nan_in_key_or_value_row_reaches_only_rows_that_attend_it(seqlen_q, seqlen_k, tensor):
    q, k, v = _inputs(1, 4, 2, seqlen_q, seqlen_k, 8)
    j = seqlen_k - 2
    (k if tensor == "k" else v)[0, 1, j, 5] = np.nan
    for causal in (False, True):
        out, lse = attention_reference(q, k, v, causal=causal)
        allowed = causal_mask(seqlen_q, seqlen_k) if causal else np.ones((seqlen_q, seqlen_k), bool)
        reaches = np.zeros(lse.shape, bool)
        reaches[0, 2:4] = allowed[:, j]   # query heads 2 and 3 read kv head 1
        np.testing.assert_array_equal(np.isnan(out).any(-1), reaches)
        if tensor == "k":
            np.testing.assert_array_equal(np.isnan(out).all(-1), reaches)
            np.testing.assert_array_equal(np.isnan(lse), reaches)
        else:
            assert not np.isnan(lse).any()
            np.testing.assert_array_equal(np.isnan(out[..., 5]), reaches)


def test_accepts_low_precision_inputs():
    q, k, v = _inputs(1, 2, 2, 5, 7, 16)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        args = [x.astype(dtype) for x in (q, k, v)]
        out, lse = attention_reference(*args)
        want, want_lse = attention_reference(*[x.astype(np.float64) for x in args])
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)


def test_validation_errors():
    q, k, v = _inputs(1, 3, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple of heads_k"):
        attention_reference(q, k, v)
    q, k, v = _inputs(1, 2, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="layout"):
        attention_reference(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match="head_dim"):
        attention_reference(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="must be equal"):
        attention_reference(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="4 dims"):
        attention_reference(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="must be equal"):
        attention_naive(q.astype(np.float16), k.astype(np.float32), v.astype(np.float16))
    with pytest.raises(TypeError, match="not supported"):
        attention_naive(q, k, v)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(a, b) for a in (0, 1, 2, 5, 17) for b in (0, 1, 3, 5, 17)])
def test_pair_count_matches_brute_force(seqlen_q, seqlen_k):
    assert attention_pairs(seqlen_q, seqlen_k, True) == int(causal_mask(seqlen_q, seqlen_k).sum())
    assert attention_pairs(seqlen_q, seqlen_k, False) == seqlen_q * seqlen_k


def test_flops():
    assert attention_flops(2, 3, 5, 7, 64, False) == 4 * 2 * 3 * 64 * 35
    assert attention_flops(2, 3, 5, 7, 64, True) == 4 * 2 * 3 * 64 * int(causal_mask(5, 7).sum())
    assert attention_flops(1, 1, 4096, 4096, 128, True) == 4 * 128 * 4096 * 4097 // 2
    assert isinstance(attention_flops(1, 1, 1 << 20, 1 << 20, 256, True), int)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,bound", [(np.float32, 1e-5), (np.float16, 1e-2),
                                         (ml_dtypes.bfloat16, 6e-2)])
def test_naive_is_close_to_reference(dtype, bound, causal):
    q, k, v = (x.astype(dtype) for x in _inputs(2, 4, 2, 37, 53, 64, seed=2))
    out, lse = attention_naive(q, k, v, causal=causal)
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    error = np.abs(out.astype(np.float64) - ref).max()
    assert error < bound
    if dtype is not np.float32:
        assert error > 0   # the roundings are really in the input precision
    np.testing.assert_allclose(lse, ref_lse, atol=20 * bound)


def test_naive_float32_layouts_agree():
    q, k, v = (x.astype(np.float32) for x in _inputs(1, 2, 1, 9, 5, 8))
    t = lambda x: x.transpose(0, 2, 1, 3)
    out, lse = attention_naive(q, k, v, causal=True)
    out_t, lse_t = attention_naive(t(q), t(k), t(v), causal=True, layout="bshd")
    np.testing.assert_array_equal(t(out_t), out)
    np.testing.assert_array_equal(lse_t, lse)


def test_module_does_not_import_cupy():
    assert "cupy" not in vars(reference)


# -- FP8 inputs ---------------------------------------------------------------------------------

def _fp8_inputs(fmt="e4m3", granularity="head", shape=(2, 4, 2, 37, 53, 64), seed=3):
    from cuflash.fp8 import quantize_fp8
    q, k, v = _inputs(*shape, seed=seed)
    return [quantize_fp8(x.astype(np.float32), fmt, granularity) for x in (q, k, v)]


def _fp8_kwargs(quantized, fmt="e4m3"):
    (_, qd), (_, kd), (_, vd) = quantized
    return dict(fp8_format=fmt, q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_reference_is_attention_of_the_dequantized_values(fmt):
    from cuflash.fp8 import dequantize_fp8
    quantized = _fp8_inputs(fmt)
    codes = [c for c, _ in quantized]
    out, lse = reference.attention_fp8_reference(*codes, causal=True, **_fp8_kwargs(quantized, fmt))
    values = [dequantize_fp8(c, d, fmt, "head").astype(np.float64) for c, d in quantized]
    want, want_lse = attention_reference(*values, causal=True)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)   # float32 vs float64 descale products
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_fp8_naive_layouts_int8_gqa_and_scalar_descales_agree():
    quantized = _fp8_inputs(granularity="tensor")
    codes = [c for c, _ in quantized]
    kwargs = _fp8_kwargs(quantized)
    out, lse = reference.attention_fp8_naive(*codes, causal=True, **kwargs)
    assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32 and out.shape == codes[0].shape
    t = lambda x: x.transpose(0, 2, 1, 3)
    out_t, lse_t = reference.attention_fp8_naive(*(t(c) for c in codes), causal=True, layout="bshd", **kwargs)
    np.testing.assert_array_equal(t(out_t), out)
    np.testing.assert_array_equal(lse_t, lse)
    signed = [c.view(np.int8) for c in codes]
    np.testing.assert_array_equal(reference.attention_fp8_naive(*signed, causal=True, **kwargs)[0], out)
    floats = {name: float(d) for name, d in kwargs.items() if name.endswith("descale")}
    np.testing.assert_array_equal(reference.attention_fp8_naive(*codes, causal=True, fp8_format="e4m3", **floats)[0],
                                  out)
    repeated = [codes[0]] + [np.repeat(c, 2, axis=1) for c in codes[1:]]
    np.testing.assert_array_equal(reference.attention_fp8_naive(*repeated, causal=True, **kwargs)[0], out)
    fp16, _ = reference.attention_fp8_naive(*codes, causal=True, out_dtype="fp16", **kwargs)
    assert fp16.dtype == np.float16
    assert np.abs(fp16.astype(np.float64) - out.astype(np.float64)).max() <= 2.0 ** -8 * 4


def test_fp8_naive_fully_masked_rows_and_no_keys():
    quantized = _fp8_inputs(shape=(1, 2, 1, 9, 4, 16))
    codes = [c for c, _ in quantized]
    out, lse = reference.attention_fp8_naive(*codes, causal=True, **_fp8_kwargs(quantized))
    out = out.astype(np.float32)
    assert np.all(out[:, :, :5] == 0) and np.all(lse[:, :, :5] == -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, 5:]).all()
    empty = np.zeros((1, 1, 0, 16), np.uint8)
    out, lse = reference.attention_fp8_naive(codes[0], empty, empty, fp8_format="e4m3")
    assert np.all(out.astype(np.float32) == 0) and np.all(lse == -np.inf)


def test_fp8_naive_equals_reference_when_p_is_exact():
    """A zero scale makes every score 0 and every probability exactly 1, representable in e4m3:
    the output is the mean of the value rows. With a power-of-two number of keys, a power-of-two
    descale and e4m3 values (multiples of 2^-9 below 448, so float32 sums of up to 64 are exact)
    the naive output is the reference rounded to the output dtype, bit for bit."""
    rng = np.random.default_rng(7)
    for seqlen_k in (1, 2, 16, 64):
        for out_dtype, np_out in (("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)):
            q = rng.integers(0, 0x7F, size=(1, 2, 5, 32)).astype(np.uint8)    # finite e4m3 codes
            k = rng.integers(0, 0x7F, size=(1, 2, seqlen_k, 32)).astype(np.uint8)
            v = rng.integers(0, 0x7F, size=(1, 2, seqlen_k, 32)).astype(np.uint8) | np.uint8(0x80) * \
                rng.integers(0, 2, size=(1, 2, seqlen_k, 32)).astype(np.uint8)
            kwargs = dict(fp8_format="e4m3", v_descale=np.float32(0.25), scale=0.0)
            out, lse = reference.attention_fp8_naive(q, k, v, out_dtype=out_dtype, **kwargs)
            want, want_lse = reference.attention_fp8_reference(q, k, v, **kwargs)
            np.testing.assert_array_equal(out, want.astype(np_out))
            np.testing.assert_allclose(lse, want_lse, rtol=1e-7)


def test_fp8_naive_row_sum_comes_from_unrounded_probabilities():
    """With every value 1 the reference output is exactly 1; the model's is
    sum(round_e4m3(256 P) / 256) / sum(P): P is rounded for P V, the row sum is not."""
    from cuflash.fp8 import from_fp8_bits, to_fp8_bits
    rng = np.random.default_rng(8)
    q, k = (rng.integers(0, 0x7F, size=(1, 1, 40, 64)).astype(np.uint8) | 0x80 * rng.integers(0, 2, (1, 1, 40, 64))
            .astype(np.uint8) for _ in range(2))
    v = np.full((1, 1, 40, 64), 0x38, np.uint8)   # e4m3 1.0
    kwargs = dict(fp8_format="e4m3", q_descale=np.float32(2.0 ** -7), k_descale=np.float32(2.0 ** -7))
    out, _ = reference.attention_fp8_naive(q, k, v, causal=True, out_dtype="fp16", **kwargs)
    ref, _ = reference.attention_fp8_reference(q, k, v, causal=True, **kwargs)
    np.testing.assert_allclose(ref, 1.0, rtol=1e-14)
    qf, kf = (from_fp8_bits(x, "e4m3").astype(np.float64) * 2.0 ** -7 for x in (q, k))
    scores = np.where(causal_mask(40, 40), (qf @ kf.swapaxes(-1, -2)) / 8, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    rounded = from_fp8_bits(to_fp8_bits(p * 256, "e4m3"), "e4m3") / 256
    model = rounded.sum(-1) / p.sum(-1)
    out = out.astype(np.float64)[..., 0]
    np.testing.assert_allclose(out, model, atol=2.0 ** -10)
    assert np.abs(out - 1).max() > 2.0 ** -10       # the rounding is really there
    assert np.abs(out - 1).max() <= 2.0 ** -4        # and bounded by e4m3's half step


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(fp8_format="e3m4"), ValueError, "fp8_format='e3m4'"),
    (dict(q_descale=np.ones((2, 3), np.float32)), ValueError, "q_descale.shape"),
    (dict(k_descale=np.ones((2, 4), np.float32)), ValueError, "k_descale.shape"),
    (dict(v_descale=np.ones((1, 1, 1), np.float32)), ValueError, "v_descale.shape"),
    (dict(v_descale=-1.0), ValueError, "v_descale must be finite and non-negative"),
    (dict(q_descale=float("nan")), ValueError, "q_descale must be finite"),
    (dict(k_descale=np.float32(np.inf)), ValueError, "k_descale must be finite"),
    (dict(out_dtype="fp32"), ValueError, "out_dtype='fp32'"),
])
def test_fp8_naive_rejects_bad_arguments(kwargs, error, match):
    quantized = _fp8_inputs(granularity="tensor")
    codes = [c for c, _ in quantized]
    with pytest.raises(error, match=match):
        reference.attention_fp8_naive(*codes, **{"fp8_format": "e4m3", **kwargs})
    with pytest.raises(TypeError, match="uint8"):
        reference.attention_fp8_naive(codes[0].astype(np.float16), *codes[1:], fp8_format="e4m3")
