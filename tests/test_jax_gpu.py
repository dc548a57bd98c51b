"""cuflash.jax on the GPU: the forward, its LSE and the gradients against the float64 reference
(grouped-query, causal, both layouts, fp16, bf16 and fp32), jax.vjp against jax.grad, and CuPy's
current stream."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from cuflash.testing import AttentionProblem, assert_attention_close, assert_gradients_close  # noqa: E402

pytestmark = pytest.mark.gpu


def _cuda_device():
    try:
        return jax.devices("cuda")[0]
    except RuntimeError:  # no CUDA backend in this jax
        return None


@pytest.fixture(scope="module")
def cuda_device():
    device = _cuda_device()
    if device is None:
        pytest.skip("needs jax with a CUDA GPU")
    return device


PROBLEMS = [
    AttentionProblem(batch=2, heads=8, heads_k=2, seqlen_q=113, seqlen_k=239, head_dim=64, dtype="bf16", causal=True),
    AttentionProblem(batch=1, heads=4, heads_k=4, seqlen_q=256, seqlen_k=256, head_dim=128, dtype="fp16",
                     layout="bshd"),
    AttentionProblem(batch=2, heads=8, heads_k=1, seqlen_q=239, seqlen_k=17, head_dim=96, dtype="bf16", causal=True,
                     layout="bshd"),
    AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=64, seqlen_k=64, head_dim=64, dtype="fp32", causal=True),
]


def _inputs(problem, device, seed=3):
    q, k, v = problem.make_inputs(np, seed=seed)
    dout = problem.make_dout(np, seed=seed)
    return (q, k, v, dout), tuple(jax.device_put(x, device) for x in (q, k, v, dout))


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_forward_and_gradients_against_the_reference(problem, cuda_device):
    import cuflash.jax as cj
    (q, k, v, dout), (jq, jk, jv, jdout) = _inputs(problem, cuda_device)
    out, lse = cj.attention(jq, jk, jv, causal=problem.causal, layout=problem.layout, return_lse=True)
    assert out.dtype == jq.dtype and out.shape == jq.shape and lse.dtype == jnp.float32
    assert out.devices() == {cuda_device}
    ref, ref_lse = problem.reference(q, k, v)
    naive, naive_lse = problem.naive(q, k, v)
    assert_attention_close(np.asarray(out), ref, problem.dtype, baseline=naive, lse=np.asarray(lse), ref_lse=ref_lse,
                           baseline_lse=naive_lse)

    def loss(q, k, v):  # the cotangent of the output is dout, exactly
        out = cj.attention(q, k, v, causal=problem.causal, layout=problem.layout)
        return (out.astype(jnp.float32) * jdout.astype(jnp.float32)).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(jq, jk, jv)
    assert [g.dtype for g in grads] == [x.dtype for x in (jq, jk, jv)]
    assert_gradients_close(tuple(np.asarray(g) for g in grads), problem.backward_reference(dout, q, k, v),
                           problem.dtype, baselines=problem.backward_naive(dout, q, k, v))


def test_sinks_and_their_gradient(cuda_device):
    import cuflash.jax as cj
    from cuflash import reference
    problem = PROBLEMS[0]
    (q, k, v, dout), (jq, jk, jv, jdout) = _inputs(problem, cuda_device, seed=9)
    sinks = np.random.default_rng(9).normal(0.5, 1.0, problem.heads).astype(np.float32)
    out = cj.attention(jq, jk, jv, causal=True, sinks=jax.device_put(sinks, cuda_device))
    kw = dict(causal=True, sinks=sinks)
    assert_attention_close(np.asarray(out), reference.attention_reference(q, k, v, **kw)[0], problem.dtype,
                           baseline=reference.attention_naive(q, k, v, **kw)[0])

    def loss(q, k, v, sinks):
        out = cj.attention(q, k, v, causal=True, sinks=sinks)
        return (out.astype(jnp.float32) * jdout.astype(jnp.float32)).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(jq, jk, jv, jax.device_put(sinks, cuda_device))
    assert grads[3].dtype == jnp.float32 and grads[3].shape == sinks.shape
    ref = reference.attention_backward_reference(dout, q, k, v, **kw)
    assert_gradients_close(tuple(np.asarray(g) for g in grads[:3]), ref[:3], problem.dtype,
                           baselines=reference.attention_backward_naive(dout, q, k, v, **kw)[:3])
    assert np.allclose(np.asarray(grads[3]), ref[3], atol=0.05 * (1 + np.abs(ref[3]).max()))


def test_mods_capturing_jax_arrays_and_their_gradients(cuda_device):
    import cuflash.jax as cj
    from cuflash import reference
    problem = PROBLEMS[0]
    (q, k, v, dout), (jq, jk, jv, jdout) = _inputs(problem, cuda_device, seed=5)
    slopes = np.linspace(0.05, 0.4, problem.heads).astype(np.float32)
    docs = np.sort(np.random.default_rng(5).integers(0, 4, (problem.batch, problem.seqlen_k))).astype(np.int32)
    d = problem.seqlen_k - problem.seqlen_q

    def mods_of(slopes, docs):
        return (lambda s, b, h, q_idx, kv_idx: s - slopes[h] * abs(q_idx + d - kv_idx),
                lambda b, h, q_idx, kv_idx: docs[b, q_idx + d] == docs[b, kv_idx])
    kw = dict(causal=True, **dict(zip(("score_mod", "mask_mod"), mods_of(slopes, docs))))
    score_mod, mask_mod = mods_of(jax.device_put(slopes, cuda_device), jax.device_put(docs, cuda_device))
    out = cj.attention(jq, jk, jv, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    assert_attention_close(np.asarray(out), reference.attention_reference(q, k, v, **kw)[0], problem.dtype,
                           baseline=reference.attention_naive(q, k, v, **kw)[0])

    def loss(q, k, v):
        out = cj.attention(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
        return (out.astype(jnp.float32) * jdout.astype(jnp.float32)).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(jq, jk, jv)
    assert_gradients_close(tuple(np.asarray(g) for g in grads),
                           reference.attention_backward_reference(dout, q, k, v, **kw), problem.dtype,
                           baselines=reference.attention_backward_naive(dout, q, k, v, **kw))


def test_vjp_with_the_lse_matches_grad_bit_for_bit(cuda_device):
    import cuflash.jax as cj
    problem = PROBLEMS[0]
    _, (jq, jk, jv, jdout) = _inputs(problem, cuda_device, seed=5)

    def attend(q, k, v, return_lse):
        return cj.attention(q, k, v, causal=True, return_lse=return_lse, deterministic=True)

    (out, lse), vjp = jax.vjp(lambda q, k, v: attend(q, k, v, True), jq, jk, jv)
    from_vjp = vjp((jdout, jnp.ones_like(lse)))  # the LSE's cotangent is ignored
    from_grad = jax.grad(lambda q, k, v: (attend(q, k, v, False).astype(jnp.float32)
                                          * jdout.astype(jnp.float32)).sum(), argnums=(0, 1, 2))(jq, jk, jv)
    assert all(bool((a == b).all()) for a, b in zip(from_vjp, from_grad))


def test_runs_on_cupys_current_stream(cuda_device):
    import cupy

    import cuflash.jax as cj
    _, (jq, jk, jv, _) = _inputs(PROBLEMS[1], cuda_device, seed=7)
    want = cj.attention(jq, jk, jv, layout="bshd")
    with cupy.cuda.Stream(non_blocking=True):
        got = [cj.attention(jq, jk, jv, layout="bshd") for _ in range(3)]
    for out in got:  # read by JAX at once, on its own streams
        assert bool((out == want).all())
