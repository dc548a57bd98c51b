"""Attention sinks on the GPU (forward, backward, with-grad) against the float64 reference."""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.testing import (AttentionProblem, Fp8AttentionProblem, assert_attention_close, assert_gradients_close,
                             to_numpy)

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

# (batch, heads, heads_k, seqlen_q, seqlen_k, head_dim): GQA, tails, more queries than keys (under
# a causal mask their first rows see no key) and fewer
SHAPES = [(2, 4, 2, 113, 239, 128), (1, 4, 1, 239, 113, 64), (2, 2, 2, 1, 300, 96), (1, 8, 2, 64, 64, 128)]
FP8_CASES = (("e4m3", "bf16"), ("e5m2", "fp16"))  # (format, output dtype)
# (shape, family, dtype, causal, layout): each shape on both families with and without the causal
# mask, the dtypes and layouts taken in turn so that each shape meets every dtype x layout pair
FORWARD_CASES = [(shape, family, ("fp16", "bf16")[(s + f + c) % 2], bool(c), ("bhsd", "bshd")[(s + c) % 2])
                 for s, shape in enumerate(SHAPES) for f, family in enumerate((None, "mma")) for c in (0, 1)]


def _sink_specs(arch):
    """The forward and backward specializations these tests run."""
    from cuflash.core.policy import default_bwd_spec, default_spec

    specs = {default_spec(s[5], dtype, causal, arch, seqlen=max(s[3], s[4])).replace(sinks=True)
             for s in SHAPES + [(1, 4, 2, 200, 70, 128), (1, 2, 2, 64, 128, 64), (2, 4, 2, 100, 130, 64)]
             for dtype in ("fp16", "bf16") for causal in (False, True)}
    specs |= {default_spec(s[5], dtype, causal, arch, family=family, seqlen=max(s[3], s[4])).replace(sinks=True)
              for s, family, dtype, causal, _ in FORWARD_CASES}
    specs |= {default_bwd_spec(s[5], dtype, causal, arch) for s in SHAPES for dtype in ("fp16", "bf16")
              for causal in (False, True)}
    specs |= {default_spec(hd, "fp32", causal, arch).replace(sinks=True) for hd in (64, 128) for causal in (False, True)}
    specs |= {default_spec(128, fmt, causal, arch, family=family, out_dtype=out, seqlen=239).replace(sinks=True)
              for fmt, out in FP8_CASES for causal in (False, True) for family in (None, "mma")
              if family or arch == "sm90a"}
    return sorted(specs, key=lambda spec: spec.name)


@pytest.fixture(scope="module", autouse=True)
def warm_sink_kernels():
    from cuflash.core.compile import device_arch

    cuflash.warmup(_sink_specs(device_arch()), progress=False)


#: The warm fixtures' kernels by fixture name: the session compiles them in its first pool.
WARM = {"warm_sink_kernels": _sink_specs}


def _sinks(heads, seed):
    return cupy.asarray(np.random.default_rng(seed).normal(1.0, 2.0, heads).astype(np.float32))


def _problem(shape, dtype, causal, layout):
    batch, heads, heads_k, seqlen_q, seqlen_k, head_dim = shape
    return AttentionProblem(batch=batch, heads=heads, heads_k=heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            head_dim=head_dim, dtype=dtype, causal=causal, layout=layout)


def _forward(problem, sinks, poison, family=None, seed=0):
    q, k, v = problem.make_inputs(cupy, seed=seed)
    q_shape, _ = problem.shapes()
    poison(math.prod(q_shape) * problem.numpy_dtype.itemsize, problem.batch * problem.heads * problem.seqlen_q * 4)
    out, lse = cuflash.attention(q, k, v, causal=problem.causal, return_lse=True, layout=problem.layout,
                                 family=family, sinks=sinks)
    args = [to_numpy(x) for x in (q, k, v)]
    ref, ref_lse = reference.attention_reference(*args, causal=problem.causal, layout=problem.layout,
                                                 sinks=to_numpy(sinks))
    base, _ = reference.attention_naive(*args, causal=problem.causal, layout=problem.layout, sinks=to_numpy(sinks))
    assert_attention_close(out, ref, problem.dtype, baseline=base, lse=lse, ref_lse=ref_lse)
    return (q, k, v), out, lse


@pytest.mark.parametrize("shape,family,dtype,causal,layout", FORWARD_CASES,
                         ids=["-".join(("x".join(map(str, s)), ("default", "portable")[f is not None], t,
                                        ("full", "causal")[c], lay)) for s, f, t, c, lay in FORWARD_CASES])
def test_forward_matches_the_reference(shape, family, dtype, causal, layout, poison):
    _forward(_problem(shape, dtype, causal, layout), _sinks(shape[1], sum(shape)), poison, family)


def test_rows_with_no_key_give_zero_and_their_sink(poison):
    problem = _problem((1, 4, 2, 200, 70, 128), "bf16", True, "bhsd")
    sinks = _sinks(4, 1)
    _, out, lse = _forward(problem, sinks, poison)
    seen = 200 - 70  # rows before this one see no key
    assert not cupy.any(out[:, :, :seen]).item()
    np.testing.assert_array_equal(to_numpy(lse[:, :, :seen]), np.broadcast_to(to_numpy(sinks)[None, :, None],
                                                                              (1, 4, seen)))


def test_a_sink_far_above_the_scores_takes_the_rows(poison):
    problem = _problem((1, 2, 2, 64, 128, 64), "fp16", False, "bhsd")
    sinks = cupy.asarray([80.0, -80.0], dtype=cupy.float32)
    _, out, lse = _forward(problem, sinks, poison)
    assert cupy.isfinite(out).all().item() and cupy.isfinite(lse).all().item()
    assert float(cupy.abs(out[:, 0]).max()) < 1e-20 and float(cupy.abs(lse[:, 0] - 80.0).max()) < 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_the_reference(shape, dtype, causal, poison):
    problem = _problem(shape, dtype, causal, "bshd" if shape[5] == 96 else "bhsd")
    sinks = _sinks(shape[1], 7)
    (q, k, v), out, lse = _forward(problem, sinks, poison)
    dout = problem.make_dout(cupy, seed=3)
    dq, dk, dv, dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, layout=problem.layout,
                                                    sinks=sinks)
    assert dsinks.shape == sinks.shape and dsinks.dtype == sinks.dtype
    args = [to_numpy(x) for x in (dout, q, k, v)]
    kw = dict(causal=causal, layout=problem.layout, sinks=to_numpy(sinks))
    ref = reference.attention_backward_reference(*args, **kw)
    base = reference.attention_backward_naive(*args, **kw)
    assert_gradients_close((dq, dk, dv), ref[:3], dtype, baselines=base[:3])
    _assert_dsinks_close(dsinks, ref[3], base[3], dout, out, lse, sinks, problem.layout)


def _assert_dsinks_close(dsinks, ref, base, dout, out, lse, sinks, layout):
    """dsinks against float64 ``-sum exp(sink - lse) * rowsum(dO * O)`` on the call's own output
    and LSE (O rounded to the input dtype moves dsinks more than the kernels' arithmetic does),
    and against the reference within twice the naive error plus that rounding."""
    dout, out = (to_numpy(x).astype(np.float64) for x in (dout, out))
    if layout == "bshd":
        dout, out = (np.swapaxes(x, 1, 2) for x in (dout, out))
    share = np.exp(to_numpy(sinks).astype(np.float64)[None, :, None] - to_numpy(lse).astype(np.float64))
    model = -(share * (dout * out).sum(-1)).sum(axis=(0, 2))
    got = to_numpy(dsinks).astype(np.float64)
    atol = 1e-3 * (1 + np.abs(ref).max())
    assert np.abs(got - model).max() <= atol, (got, model)
    assert (np.abs(got - ref) <= 2 * np.abs(base - ref) + np.abs(model - ref) + atol).all(), (got, ref, base)


def test_attention_with_grad_takes_sinks():
    problem = _problem((2, 4, 2, 100, 130, 64), "bf16", True, "bhsd")
    q, k, v = problem.make_inputs(cupy, seed=11)
    sinks = _sinks(4, 12).astype(cupy.float16)
    out, backward = cuflash.attention_with_grad(q, k, v, causal=True, sinks=sinks)
    dq, dk, dv, dsinks = backward(problem.make_dout(cupy, seed=13))
    assert dsinks.dtype == cupy.float16 and cupy.isfinite(dsinks).all().item()
    ref_out, _ = reference.attention_reference(*(to_numpy(x) for x in (q, k, v)), causal=True,
                                               sinks=to_numpy(sinks).astype(np.float64))
    assert float(np.abs(to_numpy(out).astype(np.float64) - ref_out).max()) < 2e-2


def test_bad_sinks_are_named():
    q, k, v = _problem((1, 4, 2, 16, 16, 64), "bf16", False, "bhsd").make_inputs(cupy, seed=0)
    with pytest.raises(TypeError, match="sinks must be a cupy.ndarray"):
        cuflash.attention(q, k, v, sinks=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"sinks.shape=\(2,\) must be \(heads,\) = \(4,\)"):
        cuflash.attention(q, k, v, sinks=cupy.zeros(2, cupy.float32))
    with pytest.raises(TypeError, match="floating-point"):
        cuflash.attention(q, k, v, sinks=cupy.zeros(4, cupy.int32))



@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 113, 239, 64), (1, 4, 1, 239, 113, 128)], ids=lambda s: "x".join(map(str, s)))
def test_float32_forward_and_backward_take_sinks(shape, causal, poison):
    problem = _problem(shape, "fp32", causal, "bhsd")
    sinks = _sinks(shape[1], 21)
    (q, k, v), out, lse = _forward(problem, sinks, poison)
    dout = problem.make_dout(cupy, seed=22)
    dq, dk, dv, dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, sinks=sinks)
    args = [to_numpy(x) for x in (dout, q, k, v)]
    kw = dict(causal=causal, sinks=to_numpy(sinks))
    ref = reference.attention_backward_reference(*args, **kw)
    base = reference.attention_backward_naive(*args, **kw)
    assert_gradients_close((dq, dk, dv), ref[:3], "fp32", baselines=base[:3])
    _assert_dsinks_close(dsinks, ref[3], base[3], dout, out, lse, sinks, "bhsd")


@pytest.mark.parametrize("family", [None, "mma"], ids=["default", "portable"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fmt,out_dtype", FP8_CASES)
def test_fp8_forward_takes_sinks(fmt, out_dtype, causal, family, poison):
    from cuflash.core.compile import device_arch

    if family is None and device_arch() != "sm90a":
        pytest.skip("the Hopper FP8 kernel needs sm_90a")
    problem = Fp8AttentionProblem(2, 4, 2, 113, 239, 128, fmt, "head", out_dtype, causal=causal,
                                  layout="bshd" if causal else "bhsd")
    inputs = problem.make_inputs(cupy, seed=5)
    sinks = _sinks(4, 6)
    poison(2 * 2 * 4 * 113 * 128, 2 * 4 * 113 * 4)
    for return_lse in (True, False):
        result = cuflash.attention(inputs.q, inputs.k, inputs.v, family=family, sinks=sinks, return_lse=return_lse,
                                   **problem.attention_kwargs(inputs))
        out, lse = result if return_lse else (result, None)
        ref, ref_lse = problem.reference(inputs, sinks=to_numpy(sinks))
        base, _ = problem.naive(inputs, sinks=to_numpy(sinks))
        assert_attention_close(out, ref, fmt, baseline=base, lse=lse, ref_lse=None if lse is None else ref_lse)
