"""cuflash.attention_varlen on the GPU against the float64 reference, sequence by sequence: empty
and one-token sequences, seqlen_q != seqlen_k per sequence, causal and not, GQA, windows, and
offsets the kernel must refuse."""
import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
from cuflash import reference
from cuflash.serving import attention_varlen_reference
from cuflash.testing import assert_attention_close, to_numpy, varlen_problems

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_kvcache_kernels")]


def _np_dtype(tag):
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if tag == "bf16" else np.dtype(np.float16)


def _packed(rng, lens_q, lens_k, heads, heads_k, head_dim, dtype):
    npd = _np_dtype(dtype)
    q = rng.standard_normal((int(sum(lens_q)), heads, head_dim)).astype(npd)
    k = rng.standard_normal((int(sum(lens_k)), heads_k, head_dim)).astype(npd)
    v = rng.standard_normal((int(sum(lens_k)), heads_k, head_dim)).astype(npd)
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


def _reference(q, k, v, cu_q, cu_k, naive=False, **kwargs):
    return attention_varlen_reference(q, k, v, cu_q, cu_k, naive=naive, **kwargs)


# every dtype x head dim x mask once; the head counts (GQA 4:1, none, MQA) taken in turn, each
# with and without the mask
_PER_SEQUENCE = [(t, d, c, *((8, 2), (4, 4), (8, 1))[i % 3])
                 for i, (t, d, c) in enumerate((t, d, c) for t in ("bf16", "fp16") for d in (64, 128, 256, 72)
                                               for c in (False, True))]


@pytest.mark.parametrize("dtype,head_dim,causal,heads,heads_k", _PER_SEQUENCE)
def test_varlen_matches_per_sequence_attention(dtype, head_dim, causal, heads, heads_k):
    rng = np.random.default_rng(head_dim + heads + causal)
    lens_q = np.array([0, 1, 17, 113, 239, 700])
    lens_k = np.array([5, 1, 40, 113, 100, 1023])
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, heads, heads_k, head_dim, dtype)
    out, lse = cuflash.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), causal=causal,
                                        return_lse=True)
    ref, ref_lse = _reference(q, k, v, cu_q, cu_k, causal=causal)
    naive, naive_lse = _reference(q, k, v, cu_q, cu_k, naive=True, causal=causal)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    assert_attention_close(out, ref, dtype, baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)


def _window_mask(offset):
    def window(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx + offset
    return window


def test_varlen_windows_softcap_and_random_lengths():
    rng = np.random.default_rng(1)
    lens_q = rng.integers(0, 400, size=7)
    lens_k = lens_q + rng.integers(0, 200, size=7)
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 8, 2, 128, "bf16")
    out, lse = cuflash.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), causal=True,
                                        window_size=(50, 0), softcap=20.0, max_seqlen_q=int(lens_q.max()),
                                        return_lse=True)
    kwargs = dict(causal=True, score_mod=cuflash.mods.softcap(20.0))
    refs = [], []
    for naive in (False, True):
        fn = reference.attention_naive if naive else reference.attention_reference
        o_all = np.zeros(q.shape, dtype=q.dtype if naive else np.float64)
        l_all = np.zeros((8, q.shape[0]))
        for b in range(7):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if qs.stop == qs.start:
                continue
            window = _window_mask((ks.stop - ks.start) - (qs.stop - qs.start) - 50)
            o, l = fn(q[None, qs], k[None, ks], v[None, ks], layout="bshd", mask_mod=window, **kwargs)
            o_all[qs], l_all[:, qs] = o[0], l[0]
        refs[0].append(o_all)
        refs[1].append(l_all)
    assert_attention_close(out, refs[0][0], "bf16", baseline=refs[0][1], lse=lse, ref_lse=refs[1][0],
                           baseline_lse=refs[1][1])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal,window_size", [(True, (100, 0)), (True, (0, 0)), (False, (70, 30)),
                                                (False, (-1, 5)), (False, (300, -1))])
def test_varlen_windows_on_the_hopper_kernel(head_dim, causal, window_size):
    """A window without a softcap runs on the Hopper varlen kernels, forward and backward, which
    bound each sequence's key range themselves (aligned bottom-right per sequence)."""
    from cuflash.testing import assert_gradients_close

    rng = np.random.default_rng(head_dim + causal + window_size[0])
    # the longest sequences span 5 to 6 tiles, more than the widest window (300) and a tile; kept
    # short for the float64 references' sake
    lens_q = np.array([0, 1, 17, 113, 239, 400, 650, 30])
    lens_k = np.array([5, 1, 40, 113, 100, 650, 650, 0])
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 8, 2, head_dim, "bf16")
    # a max_seqlen_q past SHORT_SEQLEN (it only sizes the grid): the long sequences' tiles, which
    # warm_kvcache_kernels compiled (at head dim 64 they are not the short ones')
    out, lse = cuflash.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), causal=causal,
                                        window_size=window_size, max_seqlen_q=1500, return_lse=True)
    kwargs = dict(causal=causal, window_size=window_size)
    ref, ref_lse = _reference(q, k, v, cu_q, cu_k, **kwargs)
    naive, naive_lse = _reference(q, k, v, cu_q, cu_k, naive=True, **kwargs)
    assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    dev = [cupy.asarray(x) for x in (dout, q, k, v)]
    dq, dk, dv = (to_numpy(g) for g in cuflash.attention_varlen_backward(
        *dev, out, lse, cupy.asarray(cu_q), cupy.asarray(cu_k), family="wgmma", **kwargs))
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start:
            assert not np.any(dk[ks].astype(np.float32)) and not np.any(dv[ks].astype(np.float32))
            continue
        args = (dout[None, qs], q[None, qs], k[None, ks], v[None, ks])
        want = reference.attention_backward_reference(*args, layout="bshd", **kwargs)
        naive = reference.attention_backward_naive(*args, layout="bshd", **kwargs)
        assert_gradients_close((dq[None, qs], dk[None, ks], dv[None, ks]), want, "bf16", baselines=naive)


@pytest.mark.parametrize("causal,window_size,softcap", [(True, (100, 0), 0.0), (False, (40, 60), 15.0)])
def test_varlen_backward_with_a_window_or_softcap(causal, window_size, softcap, poison):
    """Gradients of packed sequences with a window and softcap (sequence by sequence)."""
    from cuflash.testing import assert_gradients_close

    rng = np.random.default_rng(11 + causal)
    lens = np.array([0, 1, 17, 300, 129])
    q, k, v, cu_q, cu_k = _packed(rng, lens, lens, 8, 2, 128, "bf16")
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    kwargs = dict(causal=causal, window_size=window_size, softcap=softcap)
    out, backward = cuflash.attention_varlen_with_grad(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), **kwargs)
    ref, _ = _reference(q, k, v, cu_q, cu_k, **kwargs)
    naive, _ = _reference(q, k, v, cu_q, cu_k, naive=True, **kwargs)
    assert_attention_close(out, ref, "bf16", baseline=naive)
    poison(k.size * k.itemsize)
    dq, dk, dv = (to_numpy(g) for g in backward(cupy.asarray(dout)))
    for b in range(len(lens)):
        qs = slice(cu_q[b], cu_q[b + 1])
        if qs.stop == qs.start:
            assert np.all(dk[qs].astype(np.float32) == 0) and np.all(dv[qs].astype(np.float32) == 0)
            continue
        args = (dout[None, qs], q[None, qs], k[None, qs], v[None, qs])
        want = reference.attention_backward_reference(*args, layout="bshd", **kwargs)
        naive = reference.attention_backward_naive(*args, layout="bshd", **kwargs)
        assert_gradients_close((dq[None, qs], dk[None, qs], dv[None, qs]), want, "bf16", baselines=naive)


def test_bad_offsets_give_nan_rows_only_there():
    rng = np.random.default_rng(2)
    lens = np.array([50, 60, 70])
    q, k, v, cu_q, cu_k = _packed(rng, lens, lens, 4, 2, 64, "bf16")
    cu_k_bad = cu_k.copy()
    cu_k_bad[2] = 10 ** 6  # sequence 1 ends, and sequence 2 starts, past k
    out = to_numpy(cuflash.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k_bad)))).astype(np.float32)
    assert np.isfinite(out[:50]).all() and np.isnan(out[50:]).all()
    # max_seqlen_q smaller than a sequence: that sequence is NaN, the others are right
    out = to_numpy(cuflash.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), max_seqlen_q=60))
    ref, _ = _reference(q, k, v, cu_q, cu_k)
    out = out.astype(np.float32)
    assert np.isnan(out[110:]).all() and np.abs(out[:110] - ref[:110]).max() < 2e-2


def test_invalid_varlen_inputs_are_named():
    q = cupy.zeros((10, 4, 64), dtype=cupy.float16)
    cu = cupy.asarray(np.array([0, 4, 10], dtype=np.int32))
    with pytest.raises(ValueError, match="3-d"):
        cuflash.attention_varlen(q[None], q, q, cu, cu)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32"):
        cuflash.attention_varlen(q, q, q, cu.astype(cupy.int64), cu)
    with pytest.raises(ValueError, match="one per sequence"):
        cuflash.attention_varlen(q, q, q, cu, cu[:2])
    with pytest.raises(ValueError, match="max_seqlen_k=-1"):
        cuflash.attention_varlen(q, q, q, cu, cu, max_seqlen_k=-1)


def test_varlen_with_no_keys_gives_zero_rows():
    rng = np.random.default_rng(3)
    q = cupy.asarray(rng.standard_normal((10, 4, 64)), dtype=cupy.float16)
    k = cupy.zeros((0, 2, 64), dtype=cupy.float16)
    cu_q = cupy.asarray(np.array([0, 4, 10], dtype=np.int32))
    cu_k = cupy.zeros(3, dtype=cupy.int32)
    for causal in (False, True):
        out, lse = cuflash.attention_varlen(q, k, k, cu_q, cu_k, causal=causal, return_lse=True, max_seqlen_k=0)
        assert (out == 0).all() and cupy.isneginf(lse).all()
    # offsets that claim a key of the empty k: that sequence's rows stay NaN, the other's are 0
    claims = cupy.asarray(np.array([0, 1, 1], dtype=np.int32))
    out = cuflash.attention_varlen(q, k, k, cu_q, claims).astype(cupy.float32)
    assert cupy.isnan(out[:4]).all() and (out[4:] == 0).all()


@pytest.mark.parametrize("deterministic", [False, True])  # one launch on Hopper; the per-sequence walk
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_matches_per_sequence_gradients(causal, deterministic):
    from cuflash.testing import assert_gradients_close

    rng = np.random.default_rng(5 + causal)
    lens_q, lens_k = np.array([0, 1, 17, 113, 300]), np.array([9, 1, 40, 113, 250])
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 8, 2, 128, "bf16")
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    out, backward = cuflash.attention_varlen_with_grad(*dev, causal=causal, deterministic=deterministic)
    dq, dk, dv = (to_numpy(g) for g in backward(cupy.asarray(dout)))
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            assert np.all(dk[ks].astype(np.float32) == 0) and np.all(dv[ks].astype(np.float32) == 0)
            continue
        args = (dout[None, qs], q[None, qs], k[None, ks], v[None, ks])
        want = reference.attention_backward_reference(*args, causal=causal, layout="bshd")
        naive = reference.attention_backward_naive(*args, causal=causal, layout="bshd")
        assert_gradients_close((dq[None, qs], dk[None, ks], dv[None, ks]), want, "bf16", baselines=naive)


@pytest.mark.parametrize("head_dim,window", [(128, (-1, -1)), (64, (-1, -1)), (128, (64, 0))])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_sinks_forward_and_backward(head_dim, window, deterministic):
    """Attention sinks on packed sequences (the Hopper varlen kernel, with a window too), and their
    gradient (with a window: sequence by sequence), against the per-sequence float64 reference."""
    from cuflash.testing import assert_gradients_close

    rng = np.random.default_rng(head_dim + deterministic)
    lens_q = np.array([0, 1, 17, 113, 300])
    lens_k = lens_q if window != (-1, -1) else np.array([9, 1, 40, 113, 300])
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 8, 2, head_dim, "bf16")
    sinks = rng.normal(1.0, 2.0, 8).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    kwargs = dict(causal=True, sinks=sinks, window_size=window)
    out, backward = cuflash.attention_varlen_with_grad(*dev, causal=True, deterministic=deterministic,
                                                       sinks=cupy.asarray(sinks), window_size=window)
    ref, ref_lse = _reference(q, k, v, cu_q, cu_k, **kwargs)
    naive, _ = _reference(q, k, v, cu_q, cu_k, naive=True, **kwargs)
    assert_attention_close(out, ref, "bf16", baseline=naive)
    dq, dk, dv, dsinks = (to_numpy(g) for g in backward(cupy.asarray(dout)))
    want_dsinks = np.zeros(8)
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        args = (dout[None, qs], q[None, qs], k[None, ks], v[None, ks])
        want = reference.attention_backward_reference(*args, layout="bshd", **kwargs)
        naive = reference.attention_backward_naive(*args, layout="bshd", **kwargs)
        assert_gradients_close((dq[None, qs], dk[None, ks], dv[None, ks]), want[:3], "bf16", baselines=naive[:3])
        want_dsinks += want[3]
    assert np.abs(dsinks - want_dsinks).max() <= 2e-2 * (1 + np.abs(want_dsinks).max()), (dsinks, want_dsinks)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_of_many_random_lengths(causal):
    rng = np.random.default_rng(7 + causal)
    lens_q = rng.integers(0, 1500, size=12)
    lens_k = np.maximum(lens_q + rng.integers(-200, 300, size=12), 0)
    lens_q[3], lens_k[5] = 0, 0
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 8, 2, 128, "bf16")
    # a max_seqlen_q above the longest sequence only sizes the work
    out, lse = cuflash.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), causal=causal,
                                        max_seqlen_q=int(lens_q.max()) + 300, return_lse=True)
    ref, ref_lse = _reference(q, k, v, cu_q, cu_k, causal=causal)
    naive, naive_lse = _reference(q, k, v, cu_q, cu_k, naive=True, causal=causal)
    assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)


@pytest.mark.parametrize("dtype,head_dim,heads,heads_k",
                         [(t, d, 8, 2) for t in ("bf16", "fp16") for d in (64, 128, 256, 96)] + [("bf16", 128, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_in_one_launch_matches_the_reference(dtype, head_dim, causal, heads, heads_k, poison):
    from cuflash.testing import assert_gradients_close

    rng = np.random.default_rng(head_dim + 3 * causal + heads_k)
    lens_q, lens_k = np.array([0, 1, 17, 113, 239, 400, 64]), np.array([5, 1, 40, 113, 100, 650, 0])
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, heads, heads_k, head_dim, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    out, lse = cuflash.attention_varlen(*dev, causal=causal, return_lse=True)
    poison(q.nbytes, k.nbytes, k.nbytes)
    grads = cuflash.attention_varlen_backward(cupy.asarray(dout), dev[0], dev[1], dev[2], out, lse, dev[3], dev[4],
                                              causal=causal)  # the default: one launch on Hopper
    dq, dk, dv = (to_numpy(g) for g in grads)
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0 or lens_k[b] == 0:  # no pair attends: zero gradients
            assert np.all(dk[ks].astype(np.float32) == 0) and np.all(dv[ks].astype(np.float32) == 0)
            assert np.all(dq[qs].astype(np.float32) == 0)
            continue
        args = (dout[None, qs], q[None, qs], k[None, ks], v[None, ks])
        want = reference.attention_backward_reference(*args, causal=causal, layout="bshd")
        naive = reference.attention_backward_naive(*args, causal=causal, layout="bshd")
        assert_gradients_close((dq[None, qs], dk[None, ks], dv[None, ks]), want, dtype, baselines=naive)



def test_varlen_captured_in_a_cuda_graph():
    """One captured call replayed with new contents and new sequence boundaries (within
    max_seqlen_q): offsets are read on the device, nothing on the host."""
    rng = np.random.default_rng(11)
    heads, heads_k, head_dim, total, longest = 8, 2, 128, 900, 500
    shape_q, shape_k = (total, heads, head_dim), (total, heads_k, head_dim)
    dq_, dk_, dv_ = (cupy.zeros(s, dtype=cupy.float16) for s in (shape_q, shape_k, shape_k))
    cu = cupy.asarray(np.array([0, 300, 800, 900], dtype=np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        warm = cuflash.attention_varlen(dq_, dk_, dv_, cu, cu, max_seqlen_q=longest, causal=True, return_lse=True)
        del warm
        stream.synchronize()
        stream.begin_capture()
        out, lse = cuflash.attention_varlen(dq_, dk_, dv_, cu, cu, max_seqlen_q=longest, causal=True,
                                            return_lse=True)
        graph = stream.end_capture()
    for cuts in ([0, 300, 800, 900], [0, 450, 451, 900], [0, 0, 400, 900]):
        q, k, v = (rng.standard_normal(s).astype(np.float16) for s in (shape_q, shape_k, shape_k))
        offsets = np.array(cuts, dtype=np.int32)
        with stream:
            for dev, host in ((dq_, q), (dk_, k), (dv_, v), (cu, offsets)):
                dev.set(host)
            graph.launch(stream)
        stream.synchronize()
        ref, ref_lse = _reference(q, k, v, offsets, offsets, causal=True)
        naive, naive_lse = _reference(q, k, v, offsets, offsets, naive=True, causal=True)
        assert_attention_close(out, ref, "fp16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)


@settings(max_examples=12)
@given(problem=varlen_problems(head_dims=(64, 128), max_seqlen=700))
def test_drawn_varlen_problems_forward_and_backward(problem):
    """Packed sequences drawn by cuflash.testing.varlen_problems: the forward against the float64
    reference, and the gradients of the backward against each sequence's."""
    from cuflash.testing import assert_gradients_close

    inputs = problem.make_inputs(cupy, seed=0)
    arrays = [inputs[name] for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    out, backward = cuflash.attention_varlen_with_grad(*arrays, **problem.call_kwargs())
    host = problem.make_inputs(seed=0)
    ref, _ = problem.reference(host)
    naive, _ = problem.naive(host)
    assert_attention_close(out, ref, problem.dtype, baseline=naive)
    dout = problem.make_dout(seed=0)
    grads = [to_numpy(g) for g in backward(cupy.asarray(dout))]
    want = problem.backward_reference(dout, host)
    naive_grads = problem.backward_reference(dout, host, naive=True)
    assert_gradients_close(tuple(g[None] for g in grads), tuple(w[None] for w in want), problem.dtype,
                           baselines=tuple(n[None] for n in naive_grads))

