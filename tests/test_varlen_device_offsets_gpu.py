"""The one-launch varlen backward given max_seqlen_q and max_seqlen_k: no host read of the offsets,
the same gradients as with them read, and offsets the kernels must refuse giving NaN gradients
for their sequence only; repeated forward calls from their launch plan."""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.testing import assert_gradients_close, to_numpy

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_kvcache_kernels")]


def _hopper():
    from cuflash.core.compile import device_arch
    return device_arch() == "sm90a"


def _inputs(rng, lens_q, lens_k, head_dim=128, heads=8, heads_k=2):
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q = rng.standard_normal((int(sum(lens_q)), heads, head_dim)).astype(bf16)
    k, v = (rng.standard_normal((int(sum(lens_k)), heads_k, head_dim)).astype(bf16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(bf16)
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k)]
    return q, k, v, dout, cu[0], cu[1]


def _check_sequence(grads, q, k, v, dout, qs, ks, causal):
    dq, dk, dv = grads
    args = (dout[None, qs], q[None, qs], k[None, ks], v[None, ks])
    want = reference.attention_backward_reference(*args, layout="bshd", causal=causal)
    naive = reference.attention_backward_naive(*args, layout="bshd", causal=causal)
    assert_gradients_close((dq[None, qs], dk[None, ks], dv[None, ks]), want, "bf16", baselines=naive)


@pytest.mark.parametrize("causal,head_dim", [(True, 128), (False, 64), (True, 256)])
def test_given_maxima_the_offsets_stay_on_the_device(causal, head_dim, monkeypatch):
    if not _hopper():
        pytest.skip("the one-launch varlen backward runs on sm90a")
    from cuflash import varlen
    rng = np.random.default_rng(head_dim + causal)
    lens_q, lens_k = np.array([0, 1, 17, 239, 300, 40]), np.array([5, 1, 40, 100, 300, 0])
    q, k, v, dout, cu_q, cu_k = _inputs(rng, lens_q, lens_k, head_dim)
    dev = [cupy.asarray(x) for x in (q, k, v, dout, cu_q, cu_k)]
    out, lse = cuflash.attention_varlen(*dev[:3], dev[4], dev[5], max_seqlen_q=300, causal=causal, return_lse=True)

    def no_host_read(*args):
        raise AssertionError("the offsets were read on the host")
    with monkeypatch.context() as m:
        m.setattr(varlen, "_host_offsets", no_host_read)
        grads = [to_numpy(g) for g in cuflash.attention_varlen_backward(
            dev[3], *dev[:3], out, lse, dev[4], dev[5], max_seqlen_q=300, max_seqlen_k=300, causal=causal)]
    read = [to_numpy(g) for g in cuflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, dev[4], dev[5],
                                                                   causal=causal)]
    for got, want in zip(grads[1:], read[1:]):  # dK and dV in a fixed order: the same bits
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start:
            assert not np.any(grads[1][ks].astype(np.float32)) and not np.any(grads[2][ks].astype(np.float32))
        elif ks.stop == ks.start:
            assert not np.any(grads[0][qs].astype(np.float32))
        else:
            _check_sequence(grads, q, k, v, dout, qs, ks, causal)


@pytest.mark.parametrize("case", ["longer than max_seqlen_k", "longer than max_seqlen_q", "decreasing",
                                  "past the rows"])
def test_offsets_the_kernels_refuse_give_nan_gradients_for_their_sequence(case):
    if not _hopper():
        pytest.skip("the one-launch varlen backward runs on sm90a")
    rng = np.random.default_rng(7)
    lens = np.array([130, 17, 200, 64])
    q, k, v, dout, cu_q, cu_k = _inputs(rng, lens, lens)
    dev = [cupy.asarray(x) for x in (q, k, v, dout)]
    out, lse = cuflash.attention_varlen(*dev[:3], cupy.asarray(cu_q), cupy.asarray(cu_k), max_seqlen_q=200,
                                        causal=True, return_lse=True)
    maxima, bad_q, bad_k = dict(max_seqlen_q=200, max_seqlen_k=200), cu_q.copy(), cu_k.copy()
    if case == "longer than max_seqlen_k":
        maxima["max_seqlen_k"] = 150  # sequence 2 has 200 keys
    elif case == "longer than max_seqlen_q":
        maxima["max_seqlen_q"] = 150
    elif case == "decreasing":
        bad_k[3] = bad_k[2] - 1  # sequence 2 ends before it starts (and 3 starts late)
    else:
        bad_q[3] = bad_q[4] + 1000  # sequence 2 runs past the packed rows, sequence 3 starts past them
    grads = [to_numpy(g).astype(np.float32) for g in cuflash.attention_varlen_backward(
        dev[3], *dev[:3], out, lse, cupy.asarray(bad_q), cupy.asarray(bad_k), causal=True, **maxima)]
    cupy.cuda.Device().synchronize()
    for b in (0, 1):  # the sequences before the refused one are right
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        _check_sequence([g.astype(q.dtype) for g in grads], q, k, v, dout, qs, ks, True)
    qs, ks = slice(cu_q[2], cu_q[3]), slice(cu_k[2], cu_k[3])
    assert np.isnan(grads[1][ks]).all() and np.isnan(grads[2][ks]).all()
    assert np.isnan(grads[0][qs]).all()


def test_negative_maxima_are_refused():
    with pytest.raises(ValueError, match="max_seqlen_k=-1"):
        x = cupy.zeros((4, 2, 64), dtype=cupy.float16)
        lse = cupy.zeros((2, 4), dtype=cupy.float32)
        cu = cupy.asarray(np.array([0, 4], dtype=np.int32))
        cuflash.attention_varlen_backward(x, x, x, x, x, lse, cu, cu, max_seqlen_q=4, max_seqlen_k=-1)


def test_repeated_forward_calls_launch_from_their_plan():
    if not _hopper():
        pytest.skip("forward launch plans of packed sequences are the Hopper kernel's")
    from cuflash import varlen
    rng = np.random.default_rng(3)
    lens = np.array([1, 300, 17, 129])
    q, k, v, _, cu_q, cu_k = _inputs(rng, lens, lens)
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    varlen._plans.clear()
    first = to_numpy(cuflash.attention_varlen(*dev, max_seqlen_q=300, causal=True))
    assert len(varlen._plans) == 1
    dev[3][2] = dev[3][3]  # sequence 1 now has more queries than max_seqlen_q: the plan reads the new offsets
    again = to_numpy(cuflash.attention_varlen(*dev, max_seqlen_q=300, causal=True))
    assert len(varlen._plans) == 1
    assert np.array_equal(again[:1].view(np.uint16), first[:1].view(np.uint16))
    assert np.isnan(again[1:cu_q[2]].astype(np.float32)).all()  # rows no sequence covers now
    assert np.array_equal(again[cu_q[3]:].view(np.uint16), first[cu_q[3]:].view(np.uint16))
