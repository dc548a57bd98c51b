"""cuflash.jax without a GPU: the import guard, what import cuflash leaves out, the argument checks,
the TypeError of a traced call, bfloat16's DLPack retyping, and the custom_vjp's wiring on CPU
arrays with the float64 reference standing in for the kernels."""
import subprocess
import sys

import numpy as np
import pytest

from cuflash import mods, reference


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_cuflash_never_imports_jax():
    result = _python("import sys, cuflash; cuflash.attention; cuflash.attention_backward; cuflash.generate; "
                     "print('jax' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_bridge_without_jax_says_what_is_missing():
    result = _python("import sys; sys.modules['jax'] = None\n"
                     "try:\n    import cuflash.jax\n"
                     "except ImportError as exc:\n    print('ImportError:', exc)\n")
    assert result.returncode == 0, result.stderr
    assert "ImportError: cuflash.jax needs JAX with CUDA" in result.stdout


try:  # the rest needs jax; a CPU build is enough
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = None
else:
    import cuflash.jax as cj

needs_jax = pytest.mark.skipif(jax is None, reason="needs jax (a CPU build is enough)")


def _cpu(x):
    """x on the CPU, whichever device jax would choose."""
    return jax.device_put(x, jax.devices("cpu")[0])


def _zeros(*shape):
    return _cpu(np.zeros(shape, jnp.bfloat16))


@needs_jax
def test_bad_arguments_are_named():
    q = _zeros(1, 2, 8, 64)
    with pytest.raises(TypeError, match="q must be a jax.Array, got numpy.ndarray"):
        cj.attention(np.zeros((1, 2, 8, 64)), q, q)
    with pytest.raises(TypeError, match="k.dtype=int32"):
        cj.attention(q, q.astype(jnp.int32), q)
    with pytest.raises(ValueError, match="layout='bsdh'"):
        cj.attention(q, q, q, layout="bsdh")
    with pytest.raises(TypeError, match="causal"):
        cj.attention(q, q, q, causal=1)
    with pytest.raises(TypeError, match="scale"):
        cj.attention(q, q, q, scale="0.1")
    with pytest.raises(ValueError, match="4-d"):
        cj.attention(q[0], q[0], q[0])


@needs_jax
def test_arrays_off_a_gpu_are_named():
    q = _zeros(1, 2, 8, 64)
    with pytest.raises(ValueError, match=r"q is on .+ \(cpu\); cuflash.jax.attention takes arrays on a CUDA GPU"):
        cj.attention(q, q, q)
    # Under eager jax.grad the forward gets the concrete arrays, and names them the same way.
    with pytest.raises(ValueError, match=r"\(cpu\)"):
        jax.grad(lambda q: cj.attention(q, q, q).astype(jnp.float32).sum())(q)


@needs_jax
def test_a_traced_call_raises_a_type_error():
    q = _zeros(1, 2, 8, 64)
    eager = "cuflash.jax.attention runs eagerly; it cannot be traced by jax.jit"
    with pytest.raises(TypeError, match=eager + r".*\(q is a DynamicJaxprTracer\)"):
        jax.jit(lambda q: cj.attention(q, q, q))(q)
    with pytest.raises(TypeError, match=eager + r".*\(q is a BatchTracer\)"):
        jax.vmap(lambda q: cj.attention(q, q, q))(q[None])


# -- the custom_vjp on CPU arrays: the reference stands in for the kernels ----------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    """cuflash.jax with the device work on NumPy copies of the arrays and the float64 reference as
    the kernels; the arrays it gets must be concrete (a tracer meets the bridge's own check).
    Returns the names of the arrays of each call."""
    calls = []
    device_of = cj._device_of

    def on_host(named, work):
        for name, x in named:
            if isinstance(x, jax.core.Tracer):
                device_of(name, x)
        calls.append(tuple(name for name, _ in named))
        return tuple(_cpu(r) for r in work(*(np.asarray(x) for _, x in named)))

    def forward(q, k, v, *, causal, scale, layout, return_lse, **extra):
        extra = _as_mods(extra, q, k, layout)
        out, lse = reference.attention_reference(q, k, v, causal=causal, scale=scale, layout=layout, **extra)
        out, lse = out.astype(q.dtype), lse.astype(np.float32)
        return (out, lse) if return_lse else out

    def backward(dout, q, k, v, out, lse, *, causal, scale, layout, deterministic, **extra):
        extra = _as_mods(extra, q, k, layout)
        grads = reference.attention_backward_reference(dout, q, k, v, causal=causal, scale=scale, layout=layout,
                                                       **extra)
        sinks = () if extra.get("sinks") is None else (extra["sinks"],)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, *sinks)))

    monkeypatch.setattr(cj, "_on_cuda", on_host)
    monkeypatch.setattr(cj, "_attention", forward)
    monkeypatch.setattr(cj, "_attention_backward", backward)
    return calls


def _as_mods(extra, q, k, layout):
    """The reference's keywords for a call's: ``window_size`` as a band mask written out here and
    ``softcap`` as mods.softcap."""
    extra = dict(extra)
    block_mask = extra.pop("block_mask", None)
    if block_mask is not None and extra.get("mask_mod") is None:
        extra["mask_mod"] = block_mask.graph
    left, right = extra.pop("window_size", (-1, -1))
    cap = extra.pop("softcap", 0.0)
    axis = 2 if layout == "bhsd" else 1
    d = k.shape[axis] - q.shape[axis]

    def band(b, h, q_idx, kv_idx):
        return ((kv_idx >= q_idx + d - left) if left >= 0 else (kv_idx >= 0)) & \
            ((kv_idx <= q_idx + d + right) if right >= 0 else (kv_idx >= 0))
    if (left, right) != (-1, -1):
        extra["mask_mod"] = band
    if cap:
        extra["score_mod"] = mods.softcap(cap)
    return extra


def _problem(layout="bshd"):
    rng = np.random.default_rng(0)
    b, h, hk, sq, sk, d = 1, 4, 2, 16, 24, 32
    q_shape, kv_shape = ((b, sq, h, d), (b, sk, hk, d)) if layout == "bshd" else ((b, h, sq, d), (b, hk, sk, d))
    q, k, v, dout = (rng.standard_normal(s, dtype=np.float32) for s in (q_shape, kv_shape, kv_shape, q_shape))
    return q, k, v, dout


FORWARD = ("q", "k", "v")
BACKWARD = ("dout", "q", "k", "v", "out", "lse")


@needs_jax
@pytest.mark.parametrize("return_lse", [False, True])
def test_grad_value_and_grad_and_vjp_run_cuflashs_backward_eagerly(reference_kernels, return_lse):
    q, k, v, dout = _problem()
    want = reference.attention_backward_reference(dout, q, k, v, causal=True, layout="bshd")

    def attend(q, k, v):
        result = cj.attention(q, k, v, causal=True, layout="bshd", return_lse=return_lse)
        return result[0] if return_lse else result

    def loss(q, k, v):
        return (attend(q, k, v) * dout).sum()

    arrays = tuple(_cpu(x) for x in (q, k, v))
    grads = jax.grad(loss, argnums=(0, 1, 2))(*arrays)
    value, again = jax.value_and_grad(loss, argnums=(0, 1, 2))(*arrays)
    out, vjp = jax.vjp(attend, *arrays)
    vjp_grads = vjp(_cpu(dout))
    ref_out, _ = reference.attention_reference(q, k, v, causal=True, layout="bshd")
    assert np.allclose(np.asarray(out), ref_out, atol=1e-6)
    assert np.isclose(float(value), float((ref_out * dout).sum()), rtol=1e-5)
    for result in (grads, again, vjp_grads):
        for got, ref in zip(result, want):
            assert got.dtype == jnp.float32 and np.allclose(np.asarray(got), ref, atol=1e-5)
    assert reference_kernels == [FORWARD, BACKWARD] * 3


@needs_jax
def test_sinks_are_an_argument_and_get_their_gradient(reference_kernels):
    q, k, v, dout = _problem()
    sinks = np.random.default_rng(1).normal(0.5, 1.0, 4).astype(np.float32)
    want = reference.attention_backward_reference(dout, q, k, v, causal=True, layout="bshd", sinks=sinks)

    def loss(q, k, v, sinks):
        return (cj.attention(q, k, v, causal=True, layout="bshd", sinks=sinks) * dout).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*(_cpu(x) for x in (q, k, v, sinks)))
    for got, ref in zip(grads, want):
        assert got.dtype == jnp.float32 and np.allclose(np.asarray(got), ref, atol=1e-5)
    out, lse = cj.attention(*(_cpu(x) for x in (q, k, v)), layout="bshd", return_lse=True, sinks=_cpu(sinks))
    ref_out, ref_lse = reference.attention_reference(q, k, v, layout="bshd", sinks=sinks)
    assert np.allclose(np.asarray(out), ref_out, atol=1e-6) and np.allclose(np.asarray(lse), ref_lse, atol=1e-5)
    assert reference_kernels == [FORWARD + ("sinks",), BACKWARD + ("sinks",), FORWARD + ("sinks",)]
    with pytest.raises(TypeError, match="sinks must be a jax.Array, got numpy.ndarray"):
        cj.attention(*(_cpu(x) for x in (q, k, v)), layout="bshd", sinks=sinks)


@needs_jax
def test_window_and_softcap_are_static_arguments_of_both_passes(reference_kernels):
    q, k, v, dout = _problem()
    args = dict(causal=True, layout="bshd", mask_mod=lambda b, h, q_idx, kv_idx: kv_idx >= q_idx + 8 - 5,
                score_mod=mods.softcap(7.0))
    want = reference.attention_backward_reference(dout, q, k, v, **args)

    def loss(q, k, v):
        out = cj.attention(q, k, v, causal=True, layout="bshd", window_size=(5, 0), softcap=7.0)
        return (out * dout).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(*(_cpu(x) for x in (q, k, v)))
    for got, ref in zip(grads, want):
        assert np.allclose(np.asarray(got), ref, atol=1e-5)
    with pytest.raises(ValueError, match="right must be 0"):
        cj.attention(*(_cpu(x) for x in (q, k, v)), causal=True, window_size=(5, 5))


@needs_jax
def test_mods_capturing_jax_arrays_are_traced_once_for_both_passes(reference_kernels):
    from cuflash.core import modset

    q, k, v, dout = _problem()
    slopes = np.linspace(0.1, 0.8, 4).astype(np.float32)
    docs = np.array([[0] * 10 + [1] * 14], np.int32)  # 24 keys; query i sits at key i + 8

    def mods_of(slopes, docs):
        return (lambda s, b, h, q_idx, kv_idx: s - slopes[h] * abs(q_idx + 8 - kv_idx),
                lambda b, h, q_idx, kv_idx: docs[b, q_idx + 8] == docs[b, kv_idx])
    score_np, mask_np = mods_of(slopes, docs)
    want = reference.attention_backward_reference(dout, q, k, v, layout="bshd", score_mod=score_np, mask_mod=mask_np)
    ref_out, ref_lse = reference.attention_reference(q, k, v, layout="bshd", score_mod=score_np, mask_mod=mask_np)
    score_mod, mask_mod = mods_of(_cpu(slopes), _cpu(docs))

    def loss(q, k, v):
        return (cj.attention(q, k, v, layout="bshd", score_mod=score_mod, mask_mod=mask_mod) * dout).sum()

    traced_before = len(modset._traced)
    grads = jax.grad(loss, argnums=(0, 1, 2))(*(_cpu(x) for x in (q, k, v)))
    for got, ref in zip(grads, want):
        assert np.allclose(np.asarray(got), ref, atol=1e-5)
    out, lse = cj.attention(*(_cpu(x) for x in (q, k, v)), layout="bshd", return_lse=True, score_mod=score_mod,
                            mask_mod=mask_mod)
    assert np.allclose(np.asarray(out), ref_out, atol=1e-6) and np.allclose(np.asarray(lse), ref_lse, atol=1e-5)
    assert len(modset._traced) == traced_before + 2  # one graph each, kept for the second call
    assert reference_kernels == [FORWARD, BACKWARD, FORWARD]
    with pytest.raises(ValueError, match="softcap=5.0 and score_mod were both given"):
        cj.attention(*(_cpu(x) for x in (q, k, v)), layout="bshd", softcap=5.0, score_mod=score_mod)


@needs_jax
def test_a_call_without_a_gradient_runs_the_forward_only(reference_kernels):
    q, k, v, _ = _problem("bhsd")
    out, lse = cj.attention(*(_cpu(x) for x in (q, k, v)), return_lse=True)
    ref_out, ref_lse = reference.attention_reference(q, k, v)
    assert np.allclose(np.asarray(out), ref_out, atol=1e-6) and np.allclose(np.asarray(lse), ref_lse, atol=1e-5)
    assert reference_kernels == [FORWARD]


@needs_jax
def test_traced_forwards_and_backwards_raise_a_type_error(reference_kernels):
    q, k, v, dout = (_cpu(x) for x in _problem())

    def loss(q):
        return cj.attention(q, k, v, causal=True, layout="bshd").sum()

    eager = "cuflash.jax.attention runs eagerly"
    with pytest.raises(TypeError, match=eager + r".*\(q is a \w+Tracer\)"):
        jax.grad(lambda q: jax.grad(loss)(q).sum())(q)  # a second derivative
    with pytest.raises(TypeError, match=eager + r".*\(q is a DynamicJaxprTracer\)"):
        jax.grad(jax.checkpoint(loss))(q)
    _, vjp = jax.vjp(lambda q: cj.attention(q, k, v, causal=True, layout="bshd"), q)
    with pytest.raises(TypeError, match=eager + r".*\(dout is a DynamicJaxprTracer\)"):
        jax.jit(vjp)(dout)
    assert reference_kernels == [FORWARD]  # only the eager forward of jax.vjp ran


# -- bfloat16 through DLPack ------------------------------------------------------------------------------

@needs_jax
def test_bfloat16_crosses_dlpack_as_uint16_codes():
    x = _cpu(np.arange(-6, 6, dtype=np.float32).reshape(3, 4).astype(jnp.bfloat16))
    codes = np.asarray(x).view(np.uint16)
    got = np.from_dlpack(cj._Retyped(x, cj._KDL_BFLOAT, cj._KDL_UINT))
    assert got.dtype == np.uint16 and np.array_equal(got, codes)
    back = jax.dlpack.from_dlpack(cj._Retyped(codes.copy(), cj._KDL_UINT, cj._KDL_BFLOAT))
    assert back.dtype == jnp.bfloat16 and np.array_equal(np.asarray(back), np.asarray(x))
    # A versioned (DLPack 1.0) capsule, as NumPy gives one to a consumer that takes them.
    signed = np.from_dlpack(cj._Retyped(codes.copy(), cj._KDL_UINT, 0))
    assert signed.dtype == np.int16 and np.array_equal(signed, codes.view(np.int16))
    with pytest.raises(BufferError, match="code 4"):
        np.from_dlpack(cj._Retyped(x, cj._KDL_UINT, cj._KDL_BFLOAT))
