"""Attention sinks in the float64 reference: the sum they join, their limits and their gradient."""
import numpy as np
import pytest

from cuflash import reference


def _inputs(seed=0, batch=2, heads=4, heads_k=2, seqlen_q=5, seqlen_k=7, head_dim=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim))
    k = rng.standard_normal((batch, heads_k, seqlen_k, head_dim))
    v = rng.standard_normal((batch, heads_k, seqlen_k, head_dim))
    sinks = rng.standard_normal(heads)
    return q, k, v, sinks


@pytest.mark.parametrize("causal", [False, True])
def test_a_sink_is_one_more_term_of_each_rows_sum(causal):
    q, k, v, sinks = _inputs()
    out, lse = reference.attention_reference(q, k, v, causal=causal)
    out_s, lse_s = reference.attention_reference(q, k, v, causal=causal, sinks=sinks)
    s = sinks[None, :, None]
    np.testing.assert_allclose(lse_s, np.logaddexp(lse, s), rtol=1e-12)
    np.testing.assert_allclose(out_s, out * np.exp(lse - lse_s)[..., None], rtol=1e-12, atol=1e-15)


def test_sinks_of_minus_infinity_change_nothing():
    q, k, v, _ = _inputs(1)
    sinks = np.full(4, -np.inf)
    for a, b in zip(reference.attention_reference(q, k, v, causal=True),
                    reference.attention_reference(q, k, v, causal=True, sinks=sinks)):
        np.testing.assert_array_equal(a, b)
    dout = np.random.default_rng(2).standard_normal(q.shape)
    plain = reference.attention_backward_reference(dout, q, k, v, causal=True)
    with_sinks = reference.attention_backward_reference(dout, q, k, v, causal=True, sinks=sinks)
    for a, b in zip(plain, with_sinks):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(with_sinks[3], np.zeros(4))


def test_rows_with_no_key_give_zero_and_their_sink():
    # causal with more queries than keys: the first rows see no key
    q, k, v, sinks = _inputs(3, seqlen_q=9, seqlen_k=4)
    out, lse = reference.attention_reference(q, k, v, causal=True, sinks=sinks)
    np.testing.assert_array_equal(out[:, :, :5], 0)
    np.testing.assert_array_equal(lse[:, :, :5], np.broadcast_to(sinks[None, :, None], (2, 4, 5)))
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    huge = np.full(4, 1e4)  # a sink far above every score takes all the probability
    out, lse = reference.attention_reference(q, k, v, sinks=huge)
    np.testing.assert_allclose(out, 0, atol=1e-300)
    np.testing.assert_array_equal(lse, 1e4)


def test_gradients_match_finite_differences():
    q, k, v, sinks = _inputs(4, batch=1, heads=2, heads_k=1, seqlen_q=3, seqlen_k=5, head_dim=4)
    dout = np.random.default_rng(5).standard_normal(q.shape)

    def loss(q=q, k=k, v=v, sinks=sinks):
        return float((reference.attention_reference(q, k, v, causal=True, sinks=sinks)[0] * dout).sum())

    dq, dk, dv, dsinks = reference.attention_backward_reference(dout, q, k, v, causal=True, sinks=sinks)
    eps = 1e-6
    for name, x, grad in (("q", q, dq), ("k", k, dk), ("v", v, dv), ("sinks", sinks, dsinks)):
        for index in [(0,) * x.ndim, tuple(s - 1 for s in x.shape)]:
            up, down = x.copy(), x.copy()
            up[index] += eps
            down[index] -= eps
            numeric = (loss(**{name: up}) - loss(**{name: down})) / (2 * eps)
            assert abs(numeric - grad[index]) < 1e-6 * max(1.0, abs(numeric)), (name, index, numeric, grad[index])


def test_the_naive_forms_take_sinks():
    import ml_dtypes

    q, k, v, sinks = _inputs(6)
    qb, kb, vb = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    out, lse = reference.attention_naive(qb, kb, vb, causal=True, sinks=sinks)
    ref, ref_lse = reference.attention_reference(qb, kb, vb, causal=True, sinks=sinks)
    assert out.dtype == qb.dtype
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=3e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=3e-2)
    dout = np.random.default_rng(7).standard_normal(q.shape).astype(ml_dtypes.bfloat16)
    naive = reference.attention_backward_naive(dout, qb, kb, vb, causal=True, sinks=sinks)
    exact = reference.attention_backward_reference(dout, qb, kb, vb, causal=True, sinks=sinks)
    assert len(naive) == len(exact) == 4 and naive[3].dtype == np.float32
    np.testing.assert_allclose(naive[3], exact[3], atol=5e-2)


def test_sinks_must_have_one_logit_per_query_head():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"sinks.shape=\(3,\) must be \(heads,\) = \(4,\)"):
        reference.attention_reference(q, k, v, sinks=np.zeros(3))
