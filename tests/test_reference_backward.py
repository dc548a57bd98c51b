"""The float64 gradient reference against central finite differences (CPU only)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash.reference import attention_backward_reference, attention_reference


def _loss(q, k, v, dout, **kw):
    out, _ = attention_reference(q, k, v, **kw)
    return float((out * dout).sum())


def _finite_difference(x, f, eps=1e-6):
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        up = f()
        flat[i] = keep - eps
        down = f()
        flat[i] = keep
        gflat[i] = (up - down) / (2 * eps)
    return grad


@settings(max_examples=25, deadline=None)
@given(seqlen_q=st.sampled_from([1, 3, 5]), seqlen_k=st.sampled_from([1, 4, 6]),
       heads=st.sampled_from([(2, 1), (2, 2)]), head_dim=st.sampled_from([2, 4]),
       causal=st.booleans(), layout=st.sampled_from(["bhsd", "bshd"]), seed=st.integers(0, 2**31))
def test_gradients_match_finite_differences(seqlen_q, seqlen_k, heads, head_dim, causal, layout, seed):
    rng = np.random.default_rng(seed)
    hq, hk = heads
    qs = (1, hq, seqlen_q, head_dim) if layout == "bhsd" else (1, seqlen_q, hq, head_dim)
    ks = (1, hk, seqlen_k, head_dim) if layout == "bhsd" else (1, seqlen_k, hk, head_dim)
    q, k, v = rng.standard_normal(qs), rng.standard_normal(ks), rng.standard_normal(ks)
    dout = rng.standard_normal(qs)
    kw = dict(causal=causal, scale=0.7, layout=layout)
    dq, dk, dv = attention_backward_reference(dout, q, k, v, **kw)
    for x, g in ((q, dq), (k, dk), (v, dv)):
        numeric = _finite_difference(x, lambda: _loss(q, k, v, dout, **kw))
        np.testing.assert_allclose(g, numeric, rtol=1e-5, atol=1e-7)


def test_fully_masked_rows_get_zero_gradients():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 1, 2, 4)), rng.standard_normal((1, 1, 2, 4))
    dout = rng.standard_normal((1, 1, 5, 4))
    dq, dk, dv = attention_backward_reference(dout, q, k, v, causal=True)
    assert np.all(dq[0, 0, :3] == 0) and np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    # rows 0..2 see nothing, so their dout must not reach k or v
    dout2 = dout.copy()
    dout2[0, 0, :3] = 1e6
    _, dk2, dv2 = attention_backward_reference(dout2, q, k, v, causal=True)
    np.testing.assert_allclose(dk2, dk)
    np.testing.assert_allclose(dv2, dv)


def test_rejects_dout_of_the_wrong_shape():
    x = np.zeros((1, 1, 3, 4))
    with pytest.raises(ValueError, match="dout.shape"):
        attention_backward_reference(np.zeros((1, 1, 2, 4)), x, x, x)
