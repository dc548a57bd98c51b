"""attention_varlen_backward's per-sequence walk on the CPU: the packed gradients are each
sequence's own (a NumPy stand-in for the dense backward computes them), keys of sequences with no
queries get zeros, and offsets are checked."""
import numpy as np
import pytest

import cuflash
import cuflash.backward
from cuflash import reference


def _fake_backward(calls):
    def fake(dout, q, k, v, out, lse, grads, *, causal, scale, layout, deterministic, spec, window_size=(-1, -1),
             softcap=0.0):
        assert layout == "bshd" and q.shape[0] == 1 and lse.shape == (1, q.shape[2], q.shape[1])
        assert lse.flags.c_contiguous and all(g.flags.c_contiguous for g in grads)
        calls.append((q.shape[1], k.shape[1], float(lse.sum())))
        for g, want in zip(grads, reference.attention_backward_reference(
                dout, q, k, v, causal=causal, scale=scale, layout=layout, window_size=window_size, softcap=softcap)):
            g[...] = want
        return grads
    return fake


@pytest.mark.parametrize("variants", [{}, dict(window_size=(2, 1), softcap=4.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_gradients_are_each_sequences_own(monkeypatch, causal, variants):
    """Each sequence's gradients, with a window (bottom-right per sequence) and softcap too."""
    if causal and variants:
        variants = dict(variants, window_size=(2, 0))
    calls = []
    monkeypatch.setattr(cuflash.backward, "_attention_backward", _fake_backward(calls))
    rng = np.random.default_rng(3)
    lens_q, lens_k = np.array([3, 0, 7, 1, 12]), np.array([5, 4, 7, 0, 9])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    q = rng.standard_normal((lens_q.sum(), 4, 8))
    k, v = (rng.standard_normal((lens_k.sum(), 2, 8)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    lse = rng.standard_normal((4, lens_q.sum()))
    out = rng.standard_normal(q.shape)
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, scale=0.3,
                                                   **variants)
    assert [c[:2] for c in calls] == [(3, 5), (7, 7), (1, 0), (12, 9)]   # the empty-query sequence is skipped
    for b in range(5):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            assert np.all(dk[ks] == 0) and np.all(dv[ks] == 0)
            continue
        want = reference.attention_backward_reference(dout[None, qs], q[None, qs], k[None, ks], v[None, ks],
                                                      causal=causal, scale=0.3, layout="bshd", **variants)
        for got, w in zip((dq[qs], dk[ks], dv[ks]), want):
            assert np.allclose(got, w[0])
    assert np.isclose(calls[1][2], lse[:, 3:10].sum())


def test_offsets_are_checked(monkeypatch):
    monkeypatch.setattr(cuflash.backward, "_attention_backward", _fake_backward([]))
    q = np.zeros((10, 2, 8))
    lse = np.zeros((2, 10))
    good = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match="rise from 0 to 10"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, np.array([0, 6, 4, 10], np.int32), good)
    with pytest.raises(ValueError, match="rise from 0 to 10"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, np.array([0, 4, 9], np.int32), good)
    with pytest.raises(TypeError, match="int32"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, good.astype(np.int64), good)
    with pytest.raises(ValueError, match="lse has shape"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse.T, good, good)


def test_the_one_launch_backward_refuses_what_it_does_not_run():
    q = np.zeros((10, 4, 64), dtype=np.float16)
    lse = np.zeros((4, 10), dtype=np.float32)
    cu = np.array([0, 4, 10], dtype=np.int32)
    with pytest.raises(ValueError, match="not deterministic"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, family="wgmma", deterministic=True)
    with pytest.raises(ValueError, match="family='mma'"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, family="mma")
    with pytest.raises(TypeError, match="CuPy arrays"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, family="wgmma")
    with pytest.raises(ValueError, match="family='sequences'"):  # its calls would see b = 0
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, family="sequences",
                                          score_mod=lambda score, b, h, q_idx, kv_idx: score + b)
    with pytest.raises(ValueError, match="window_size"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, causal=True, window_size=(4, 2))


@pytest.mark.parametrize("maxima", [{}, dict(max_seqlen_q=7), dict(max_seqlen_q=7, max_seqlen_k=9)])
def test_the_one_launch_reads_the_offsets_on_the_host_unless_given_both_maxima(monkeypatch, maxima):
    """On the CPU stand-in device: with both maxima the one launch gets no host offsets and the
    maxima as given; otherwise the offsets are read, checked, and the maxima taken from them."""
    cupy = pytest.importorskip("cupy")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import fake_device
    from cuflash import varlen

    fake_device.install(monkeypatch, cupy)
    try:
        launched, reads = [], []
        monkeypatch.setattr(varlen, "_hopper_backward", lambda *args: launched.append(args) or (None, None, None))

        def host_offsets(name, x, total):
            reads.append(name)
            return np.array([0, 3, 10, 10] if name == "cu_seqlens_q" else [0, 5, 5, 14], dtype=np.int32)
        monkeypatch.setattr(varlen, "_host_offsets", host_offsets)
        bf16 = np.dtype(ml_dtypes.bfloat16)
        q, dout, out = (fake_device.fake_array(cupy, (10, 4, 64), bf16, 0x1000_0000 * (i + 1)) for i in range(3))
        k, v = (fake_device.fake_array(cupy, (14, 2, 64), bf16, 0x5000_0000 + i * 0x100_0000) for i in range(2))
        lse = fake_device.fake_array(cupy, (4, 10), np.float32, 0x7000_0000)
        cu_q, cu_k = (fake_device.fake_array(cupy, (4,), np.int32, base) for base in (0x900, 0xA00))
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, **maxima)
        offsets_q, offsets_k, got = launched[0][8:11]
        if len(maxima) == 2:
            assert not reads and offsets_q is None and offsets_k is None and got == (7, 9)
        else:
            assert reads == ["cu_seqlens_q", "cu_seqlens_k"] and got == (7, 9)
            assert offsets_q.tolist() == [0, 3, 10, 10] and offsets_k.tolist() == [0, 5, 5, 14]
    finally:
        fake_device.uninstall(cupy)
