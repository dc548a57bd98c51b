"""cuflash.attention_backward on the GPU against the float64 gradients.

Every test draws fresh random inputs, poisons the gradients' memory first and checks every element
of dq, dk and dv with the accuracy rule of :func:`cuflash.testing.assert_gradients_close`.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash.core.spec import HEAD_DIMS
from cuflash.testing import AttentionProblem, assert_gradients_close, attention_problems

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


def run_backward(problem: AttentionProblem, poison, deterministic=False, seed=None):
    q, k, v = problem.make_inputs(cupy, seed=seed)
    dout = problem.make_dout(cupy, seed=seed)
    out, lse = cuflash.attention(q, k, v, causal=problem.causal, scale=problem.scale, return_lse=True,
                                 layout=problem.layout)
    q_shape, kv_shape = problem.shapes()
    itemsize = problem.numpy_dtype.itemsize
    poison(math.prod(q_shape) * itemsize, math.prod(kv_shape) * itemsize, math.prod(kv_shape) * itemsize)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=problem.causal, scale=problem.scale,
                                       layout=problem.layout, deterministic=deterministic)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    return (q, k, v, dout), grads


def check_backward(problem: AttentionProblem, poison, deterministic=False, seed=None):
    (q, k, v, dout), grads = run_backward(problem, poison, deterministic, seed)
    ref = problem.backward_reference(dout, q, k, v)
    base = problem.backward_naive(dout, q, k, v)
    assert_gradients_close(grads, ref, problem.dtype, baselines=base)
    return grads


def _every_head_dim_cases():
    """Every head dim x dtype once, the causal mask taken in turn: each head dim and each dtype
    runs with and without it."""
    return [pytest.param(d, t, (i + j) % 2 == 1, id=f"{d}-{t}-{('full', 'causal')[(i + j) % 2]}")
            for i, d in enumerate(HEAD_DIMS) for j, t in enumerate(("fp16", "bf16", "fp32"))]


@pytest.mark.parametrize("head_dim,dtype,causal", _every_head_dim_cases())
def test_every_head_dim(head_dim, dtype, causal, warm_bwd_kernels, poison):
    # seqlen_q != seqlen_k both ways, GQA, sequence tails, both layouts, strided inputs, and both
    # ways of accumulating dQ.
    layout = "bshd" if head_dim % 16 else "bhsd"
    check_backward(AttentionProblem(batch=2, heads=4, heads_k=2, seqlen_q=113, seqlen_k=239, head_dim=head_dim,
                                    dtype=dtype, causal=causal, layout=layout), poison, deterministic=False)
    check_backward(AttentionProblem(batch=1, heads=2, heads_k=2, seqlen_q=239, seqlen_k=113, head_dim=head_dim,
                                    dtype=dtype, causal=causal, strided=True), poison, deterministic=True)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=attention_problems(), deterministic=st.booleans())
def test_property_against_reference(problem, deterministic, warm_bwd_kernels, poison):
    check_backward(problem, poison, deterministic)


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 700), (700, 1), (128, 128), (700, 700), (64, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_awkward_lengths(seqlens, causal, warm_bwd_kernels, poison):
    sq, sk = seqlens
    check_backward(AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=sq, seqlen_k=sk, head_dim=128,
                                    dtype="bf16", causal=causal), poison)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 200, 256])
def test_deterministic_gives_identical_bits(head_dim, warm_bwd_kernels):
    problem = AttentionProblem(batch=2, heads=4, heads_k=1, seqlen_q=1000, seqlen_k=1000, head_dim=head_dim,
                               dtype="bf16", causal=True)
    q, k, v = problem.make_inputs(cupy)
    dout = problem.make_dout(cupy)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            assert cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16))


@pytest.mark.parametrize("head_dim,causal", [(64, False), (96, False), (128, False), (128, True)])
def test_ordered_dq_is_right_and_gives_identical_bits(head_dim, causal, warm_bwd_kernels, poison):
    # Many key tiles (8 of 128) add into every dQ tile (the Hopper kernel's ordered adds up to head
    # dim 128), with GQA, seqlen_q != seqlen_k and the bshd layout; kept short for the float64
    # reference's sake.
    problem = AttentionProblem(batch=2, heads=8, heads_k=2, seqlen_q=600, seqlen_k=1000, head_dim=head_dim,
                               dtype="bf16", causal=causal, layout="bshd")
    first = check_backward(problem, poison, deterministic=True, seed=7)
    for _ in range(3):
        _, again = run_backward(problem, poison, deterministic=True, seed=7)
        for a, b in zip(first, again):
            assert cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16))


def test_fully_masked_rows_give_zero_gradients(warm_bwd_kernels, poison):
    # Causal with seqlen_q > seqlen_k: the first 200 query rows see no key.
    problem = AttentionProblem(batch=1, heads=2, heads_k=2, seqlen_q=300, seqlen_k=100, head_dim=64,
                               dtype="fp16", causal=True)
    for deterministic in (False, True):
        dq, dk, dv = check_backward(problem, poison, deterministic)
        dq = cupy.asnumpy(dq).astype(np.float32)
        assert np.all(dq[:, :, :200] == 0)
        for g in (dq, dk, dv):
            assert not cupy.isnan(cupy.asarray(g)).any()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_nan_in_q_stays_near_what_depends_on_it(head_dim, deterministic, warm_bwd_kernels):
    # A NaN in query row 7 (causal, 600 tokens): output row 7 is NaN, so dq row 7 and the dk / dv
    # rows of keys 0..7 (which row 7 attends) are NaN. dv stays exactly there. dk can also turn
    # NaN for the other keys of the first key tile (at most 128): its tensor-core product adds
    # 0 * NaN for the masked pairs. No key past that tile and no other query row is touched.
    problem = AttentionProblem(batch=1, heads=1, heads_k=1, seqlen_q=600, seqlen_k=600, head_dim=head_dim,
                               dtype="bf16", causal=True)
    q, k, v = problem.make_inputs(cupy)
    q[0, 0, 7, 3] = cupy.nan
    dout = problem.make_dout(cupy)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = (cupy.asnumpy(cupy.isnan(g).any(axis=-1))[0, 0] for g in
                  cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic))
    assert np.flatnonzero(dq).tolist() == [7]
    assert np.flatnonzero(dv).tolist() == list(range(8))
    assert dk[:8].all() and not dk[128:].any()


def test_attention_with_grad_matches_the_two_calls(warm_bwd_kernels):
    problem = AttentionProblem(batch=1, heads=4, heads_k=2, seqlen_q=77, seqlen_k=131, head_dim=64, dtype="fp16",
                               causal=True, layout="bshd")
    q, k, v = problem.make_inputs(cupy)
    dout = problem.make_dout(cupy)
    out, backward = cuflash.attention_with_grad(q, k, v, causal=True, layout="bshd", deterministic=True)
    out2, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, layout="bshd")
    assert cupy.array_equal(out, out2)
    for a, b in zip(backward(dout), cuflash.attention_backward(dout, q, k, v, out2, lse, causal=True,
                                                                layout="bshd", deterministic=True)):
        assert cupy.array_equal(a, b)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
def test_any_scale(scale, warm_bwd_kernels, poison):
    check_backward(AttentionProblem(batch=1, heads=2, heads_k=2, seqlen_q=65, seqlen_k=90, head_dim=32,
                                    dtype="fp16", causal=True, scale=scale), poison)


def test_empty_problems_give_zero_gradients():
    q = cupy.ones((1, 2, 5, 64), dtype=cupy.float16)
    k = cupy.ones((1, 2, 0, 64), dtype=cupy.float16)
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(cupy.ones_like(out), q, k, k, out, lse)
    assert dq.shape == q.shape and not dq.any() and dk.shape == k.shape


def test_rejects_bad_backward_inputs():
    q = cupy.ones((1, 2, 5, 64), dtype=cupy.float16)
    lse = cupy.zeros((1, 2, 5), dtype=cupy.float32)
    with pytest.raises(ValueError, match="dout.shape"):
        cuflash.attention_backward(q[:, :, :4], q, q, q, q, lse)
    with pytest.raises(TypeError, match="out.dtype"):
        cuflash.attention_backward(q, q, q, q, q.astype(cupy.float32), lse)
    with pytest.raises(ValueError, match="lse must be float32"):
        cuflash.attention_backward(q, q, q, q, q, lse.astype(cupy.float16))
    with pytest.raises(ValueError, match="lse must be float32"):
        cuflash.attention_backward(q, q, q, q, q, lse[:, :1])
    with pytest.raises(TypeError, match="deterministic"):
        cuflash.attention_backward(q, q, q, q, q, lse, deterministic="yes")
    with pytest.raises(TypeError, match="dout must be a cupy.ndarray"):
        cuflash.attention_backward(np.ones((1, 2, 5, 64)), q, q, q, q, lse)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_portable_backward_on_every_target(head_dim, causal, deterministic, warm_bwd_kernels, poison):
    """Where the Hopper backward is the default, the portable one must stay right too."""
    from cuflash.core.compile import device_arch
    from cuflash.core.policy import default_bwd_spec

    problem = AttentionProblem(batch=2, heads=4, heads_k=2, seqlen_q=200, seqlen_k=150, head_dim=head_dim,
                               dtype="bf16", causal=causal)
    spec = default_bwd_spec(head_dim, "bf16", causal, device_arch(), deterministic, family="mma")
    q, k, v = problem.make_inputs(cupy)
    dout = problem.make_dout(cupy)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    poison(q.nbytes, k.nbytes, v.nbytes)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, spec=spec)
    assert_gradients_close(grads, problem.backward_reference(dout, q, k, v), "bf16",
                           baselines=problem.backward_naive(dout, q, k, v))


PADDED_BWD = [(32, "fp16"), (80, "bf16"), (96, "fp16"), (160, "bf16"), (200, "fp16")]


def _padded_bwd_specs():
    from cuflash.core.policy import default_bwd_spec

    return [default_bwd_spec(d, t, c, "sm90a", det, family="wgmma") for d, t in PADDED_BWD
            for c in (False, True) for det in (False, True)]


#: The warm fixtures' kernels on sm_90a, by fixture name: the session compiles them in its first pool.
WARM_HOPPER = {"warm_padded_bwd_kernels": _padded_bwd_specs}


@pytest.fixture(scope="module")
def warm_padded_bwd_kernels():
    """Compile test_hopper_backward_padded's kernels at once, in parallel processes."""
    from cuflash.core.compile import device_arch

    if device_arch() != "sm90a":
        pytest.skip("the Hopper backward needs sm_90a")
    cuflash.warmup(_padded_bwd_specs(), progress=False)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,dtype", PADDED_BWD)
def test_hopper_backward_padded(head_dim, dtype, causal, deterministic, warm_padded_bwd_kernels, poison):
    """The Hopper backward at head dims it computes padded (to 64, 128 or 256 columns): tails,
    GQA, seqlen_q != seqlen_k."""
    from cuflash.core.compile import device_arch
    from cuflash.core.policy import default_bwd_spec

    if device_arch() != "sm90a":
        pytest.skip("the Hopper backward needs sm_90a")
    problem = AttentionProblem(batch=2, heads=4, heads_k=2, seqlen_q=200, seqlen_k=150, head_dim=head_dim,
                               dtype=dtype, causal=causal)
    spec = default_bwd_spec(head_dim, dtype, causal, "sm90a", deterministic, family="wgmma")
    assert spec.padded_head_dim > head_dim
    q, k, v = problem.make_inputs(cupy)
    dout = problem.make_dout(cupy)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    poison(q.nbytes, k.nbytes, v.nbytes)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, spec=spec)
    assert_gradients_close(grads, problem.backward_reference(dout, q, k, v), dtype,
                           baselines=problem.backward_naive(dout, q, k, v))


def test_forced_backward_spec_must_match(warm_bwd_kernels):
    from cuflash.core.compile import device_arch
    from cuflash.core.policy import default_bwd_spec

    q = cupy.ones((1, 2, 5, 64), dtype=cupy.float16)
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="does not match"):
        cuflash.attention_backward(q, q, q, q, out, lse, spec=default_bwd_spec(128, "fp16", False, device_arch()))
    with pytest.raises(TypeError, match="BwdSpec"):
        cuflash.attention_backward(q, q, q, q, out, lse, spec="fast")


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_misaligned_views(head_dim, contiguous, warm_bwd_kernels):
    # Views that start 2 bytes into their buffer: both tensor-core families copy them once
    # (their 16-byte loads need aligned rows) and give the reference's answer. Rows 2 bytes
    # into padded rows, or one contiguous run 2 bytes into a flat buffer (C-contiguous, so that
    # only a fresh copy aligns it).
    problem = AttentionProblem(batch=1, heads=2, heads_k=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim,
                               dtype="fp16", causal=True)
    q, k, v = problem.make_inputs(cupy)
    dout = problem.make_dout(cupy)

    def misaligned(x):
        if contiguous:
            flat = cupy.zeros(x.size + 1, dtype=x.dtype)
            flat[1:] = x.ravel()
            return flat[1:].reshape(x.shape)
        buffer = cupy.zeros(x.shape[:-1] + (x.shape[-1] + 1,), dtype=x.dtype)
        buffer[..., 1:] = x
        return buffer[..., 1:]

    mq, mk, mv, mdout = (misaligned(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(mq, mk, mv, causal=True, return_lse=True)
    ref_out, _ = problem.reference(q, k, v)
    assert np.abs(cupy.asnumpy(out).astype(np.float64) - ref_out).max() < 1e-2
    grads = cuflash.attention_backward(mdout, mq, mk, mv, out, lse, causal=True)
    assert_gradients_close(grads, problem.backward_reference(dout, q, k, v), "fp16",
                           baselines=problem.backward_naive(dout, q, k, v))
