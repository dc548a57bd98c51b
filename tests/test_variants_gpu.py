"""FlashAttention's ``window_size`` and ``softcap`` arguments on the GPU, forward and backward,
against the float64 reference running an independently written window mask and cap; the
block mask made once per shape, calls reusing their plans, the torch bridge."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import mods, reference
from cuflash.testing import Fp8AttentionProblem, assert_attention_close, assert_gradients_close, to_numpy

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

# (causal, window_size, softcap, head_dim, dtype)
CASES = [
    (True, (48, 0), 0.0, 64, "bf16"),
    (True, (100, -1), 20.0, 128, "bf16"),
    (False, (33, 17), 0.0, 64, "fp16"),
    (False, (-1, 7), 0.0, 128, "bf16"),
    (False, (5, -1), 0.0, 64, "bf16"),
    (False, (-1, -1), 30.0, 64, "bf16"),
    (False, (64, 64), 30.0, 128, "fp16"),
]
LENGTHS = [(200, 200), (77, 300), (300, 77)]
# (case, lengths): each case at two of the length pairs, the one left out taken in turn, so each
# case meets seqlen_q != seqlen_k and each pair runs with several cases
RUNS = [(case, lengths) for i, case in enumerate(CASES) for j, lengths in enumerate(LENGTHS) if j != i % 3]
# (head_dim, fp8 format, causal, window_size, softcap): FP8 windows the Hopper kernel bounds itself
FP8_WINDOWS = [
    (64, "e4m3", True, (300, 0), 0.0),
    (64, "e4m3", False, (200, 130), 0.0),
    (128, "e4m3", True, (0, 0), 0.0),
    (128, "e4m3", False, (-1, 70), 30.0),
    (128, "e5m2", True, (300, 0), 0.0),
    (128, "e5m2", False, (200, 130), 0.0),
    (256, "e4m3", True, (300, 0), 0.0),
    (256, "e4m3", False, (517, -1), 0.0),
]
# several key tiles past the widest window (517) and both length classes; kept short for the
# float64 references' sake
WINDOW_LENGTHS = [(800, 800), (450, 1100), (1100, 450)]
FP8_LENGTHS = WINDOW_LENGTHS


def _fp8_call(fmt):
    """(out_dtype, descale granularity, layout) of the FP8 window tests, varied by format."""
    return ("fp16", "tensor", "bhsd") if fmt == "e5m2" else ("bf16", "head", "bshd")


def _mask(window_size, seqlen_q, seqlen_k):
    """The window as a mask_mod written out here: query i sees keys i + d - left .. i + d + right."""
    left, right = window_size
    d = seqlen_k - seqlen_q

    def window(b, h, q_idx, kv_idx):
        lo = kv_idx >= q_idx + d - left if left >= 0 else kv_idx >= 0
        hi = kv_idx <= q_idx + d + right if right >= 0 else kv_idx >= 0
        return lo & hi
    return window


def _reference_args(causal, window_size, softcap, seqlen_q, seqlen_k, layout):
    return dict(causal=causal, layout=layout, mask_mod=_mask(window_size, seqlen_q, seqlen_k),
                score_mod=mods.softcap(softcap) if softcap else None)


def _np_dtype(tag):
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if tag == "bf16" else np.dtype(np.float16)


def _inputs(seed, dtype, batch, heads, heads_k, seqlen_q, seqlen_k, layout, head_dim):
    rng = np.random.default_rng(seed)

    def make(h, s):
        shape = (batch, h, s, head_dim) if layout == "bhsd" else (batch, s, h, head_dim)
        return rng.standard_normal(shape).astype(_np_dtype(dtype))
    q, k, v = make(heads, seqlen_q), make(heads_k, seqlen_k), make(heads_k, seqlen_k)
    return rng, q, k, v


def _variant_specs(arch):
    """Each case's forward and backward at its length pairs (RUNS), and the windows' kernels."""
    from types import SimpleNamespace

    from cuflash import backward as _backward
    from cuflash import forward as _forward
    from cuflash import sparsity
    from cuflash.core import modset, policy
    from cuflash.core.validate import validate_variants

    device = cupy.cuda.Device().id
    specs = []
    for (causal, window_size, softcap, head_dim, dtype), (seqlen_q, seqlen_k) in RUNS:
        problem = SimpleNamespace(causal=causal, batch=2, heads=4, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                  head_dim=head_dim, dtype=SimpleNamespace(tag=dtype), device_id=device)
        variants = validate_variants(window_size, softcap, causal)
        score_mod, mask_mod, block = sparsity.flash_mods(problem, *variants, None, None, None)
        prepared = modset.prepare(score_mod, mask_mod, device)
        spec = policy.default_spec(head_dim, dtype, causal, arch, seqlen=512)
        if spec.warp_specialized and block is not None:  # the Hopper forward bounds the window itself
            cap = sparsity.flash_mods(problem, (-1, -1), softcap, None, None, None)[0]
            specs.append(_forward._with_mods(spec, modset.prepare(cap, None, device), problem, None).replace(
                local=True) if cap is not None else spec.replace(local=True))
        else:
            spec = _forward._with_mods(spec, prepared, problem, None)
            specs.append(spec.replace(block_sparse=True) if block is not None and spec.warp_specialized else spec)
        bwd = policy.default_bwd_spec(head_dim, dtype, causal, arch, False)
        if _backward._local_window(bwd, variants, causal, None, None, None) != (-1, -1):  # bounded by the kernel
            cap = sparsity.flash_mods(problem, (-1, -1), softcap, None, None, None)[0]
            bwd = _backward._with_mods(bwd, modset.prepare(cap, None, device), SimpleNamespace(forward=problem)) \
                if cap is not None else bwd
            specs.append(bwd.replace(local=True))
            continue
        bwd = _backward._with_mods(bwd, prepared, SimpleNamespace(forward=problem))
        specs.append(bwd.replace(block_sparse=True) if block is not None and bwd.family == "wgmma" else bwd)
    if arch == "sm90a":  # test_windows_over_many_key_tiles
        specs += [policy.default_spec(d, "bf16", c, arch, seqlen=n).replace(local=True) for d in (64, 128, 256)
                  for c in (False, True) for n in (700, 1100, 1500)]
        specs += [policy.default_bwd_spec(d, "bf16", c, arch, False).replace(local=True) for d in (64, 128, 256)
                  for c in (False, True)]
        for head_dim, fmt, causal, window_size, softcap in FP8_WINDOWS:  # test_fp8_windows_over_many_key_tiles
            problem = SimpleNamespace(causal=causal, head_dim=head_dim, dtype=SimpleNamespace(tag=fmt),
                                      device_id=device)
            cap = modset.prepare(sparsity.flash_mods(problem, (-1, -1), softcap, None, None, None)[0], None, device) \
                if softcap else None
            for lse in (True, False):
                spec = policy.default_spec(head_dim, fmt, causal, arch, out_dtype=_fp8_call(fmt)[0], seqlen=1500,
                                           lse=lse)
                spec = _forward._with_mods(spec, cap, problem, spec.out_dtype) if cap is not None else spec
                specs.append(spec.replace(local=True))
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="module")
def warm_variant_kernels():
    from cuflash.core.compile import device_arch

    cuflash.warmup(_variant_specs(device_arch()), progress=False)


#: The warm fixtures' kernels by fixture name: the session compiles them in its first pool.
WARM = {"warm_variant_kernels": _variant_specs}


@pytest.mark.usefixtures("warm_variant_kernels")
@pytest.mark.parametrize("case,lengths", RUNS,
                         ids=[f"case{CASES.index(c)}-{sq}x{sk}" for c, (sq, sk) in RUNS])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 2), heads=st.sampled_from([(4, 4), (4, 1)]), layout=st.sampled_from(["bhsd", "bshd"]),
       seed=st.integers(0, 2**31))
def test_window_and_softcap_match_the_reference(case, lengths, batch, heads, layout, seed, poison):
    causal, window_size, softcap, head_dim, dtype = case
    seqlen_q, seqlen_k = lengths
    rng, q, k, v = _inputs(seed, dtype, batch, *heads, seqlen_q, seqlen_k, layout, head_dim)
    poison(q.size * q.itemsize)
    out, backward = cuflash.attention_with_grad(*(cupy.asarray(x) for x in (q, k, v)), causal=causal, layout=layout,
                                                window_size=window_size, softcap=softcap)
    args = _reference_args(causal, window_size, softcap, seqlen_q, seqlen_k, layout)
    ref, _ = reference.attention_reference(q, k, v, **args)
    naive, _ = reference.attention_naive(q, k, v, **args)
    assert out.dtype == cupy.asarray(q).dtype
    assert_attention_close(out, ref, dtype, baseline=naive)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    grads = backward(cupy.asarray(dout))
    assert_gradients_close(grads, reference.attention_backward_reference(dout, q, k, v, **args), dtype,
                           baselines=reference.attention_backward_naive(dout, q, k, v, **args))


MANY_TILE_WINDOWS = [(True, (300, 0)), (True, (0, 0)), (False, (200, 130)), (False, (-1, 70)), (False, (517, -1))]
# each head dim with three of the windows (one or two causal, one or two not), taken in turn so
# that every window runs and each head dim meets both masks
MANY_TILE_RUNS = [(causal, window_size, head_dim) for w, (causal, window_size) in enumerate(MANY_TILE_WINDOWS)
                  for j, head_dim in enumerate((64, 128, 256)) if (w + j) % 5 < 3]


@pytest.mark.usefixtures("warm_variant_kernels")
@pytest.mark.parametrize("causal,window_size,head_dim", MANY_TILE_RUNS,
                         ids=[f"{c}-{w[0]}_{w[1]}-{d}" for c, w, d in MANY_TILE_RUNS])
def test_windows_over_many_key_tiles(head_dim, causal, window_size, poison):
    """The Hopper kernels' own window bounds (KernelSpec.local, BwdSpec.local) over lengths of many
    tiles: tiles past either edge skipped, both edges masked, seqlen_q != seqlen_k both ways, GQA;
    the backward at one length pair per head dim."""
    backward_lengths = dict(zip((64, 128, 256), WINDOW_LENGTHS))[head_dim]
    for seqlen_q, seqlen_k in WINDOW_LENGTHS:
        rng, q, k, v = _inputs(head_dim + seqlen_q, "bf16", 1, 4, 2, seqlen_q, seqlen_k, "bshd", head_dim)
        poison(q.size * q.itemsize)
        dev = [cupy.asarray(x) for x in (q, k, v)]
        out, lse = cuflash.attention(*dev, causal=causal, layout="bshd", window_size=window_size, return_lse=True)
        args = _reference_args(causal, window_size, 0.0, seqlen_q, seqlen_k, "bshd")
        ref, ref_lse = reference.attention_reference(q, k, v, **args)
        naive, naive_lse = reference.attention_naive(q, k, v, **args)
        assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
        if (seqlen_q, seqlen_k) == backward_lengths:
            dout = rng.standard_normal(q.shape).astype(q.dtype)
            grads = cuflash.attention_backward(cupy.asarray(dout), *dev, out, lse, causal=causal, layout="bshd",
                                               window_size=window_size)
            assert_gradients_close(grads, reference.attention_backward_reference(dout, q, k, v, **args), "bf16",
                                   baselines=reference.attention_backward_naive(dout, q, k, v, **args))


@pytest.mark.usefixtures("warm_variant_kernels")
@pytest.mark.parametrize("head_dim,fmt,causal,window_size,softcap", FP8_WINDOWS)
def test_fp8_windows_over_many_key_tiles(head_dim, fmt, causal, window_size, softcap, poison):
    """The Hopper FP8 kernel's own window bounds (KernelSpec.local) over lengths of many key tiles,
    against the float64 reference of the dequantized inputs with FP8 naive as the baseline: both
    edges masked, rows with no key (O = 0, LSE = -inf), seqlen_q != seqlen_k both ways, GQA; one
    length pair without the LSE (causal: the one with rows that see no key; head dim 256: row sums
    on the tensor cores)."""
    from cuflash.core.compile import device_arch

    if device_arch() != "sm90a":
        pytest.skip("the FP8 kernel that bounds a window itself needs sm_90a")
    out_dtype, granularity, layout = _fp8_call(fmt)
    without_lse = (1100, 450) if causal else (450, 1100)
    for seqlen_q, seqlen_k in FP8_LENGTHS:
        problem = Fp8AttentionProblem(1, 4, 2, seqlen_q, seqlen_k, head_dim, fmt, granularity, out_dtype,
                                      causal=causal, layout=layout)
        inputs = problem.make_inputs(cupy, seed=head_dim + seqlen_q)
        return_lse = (seqlen_q, seqlen_k) != without_lse
        poison(inputs.q.size * 2, 4 * seqlen_q * 4)
        result = cuflash.attention(inputs.q, inputs.k, inputs.v, window_size=window_size, softcap=softcap,
                                   return_lse=return_lse, **problem.attention_kwargs(inputs))
        out, lse = result if return_lse else (result, None)
        assert out.dtype == problem.out_numpy_dtype
        codes = [to_numpy(x) for x in (inputs.q, inputs.k, inputs.v)]
        args = dict(_reference_args(causal, window_size, softcap, seqlen_q, seqlen_k, layout), fp8_format=fmt,
                    q_descale=to_numpy(inputs.q_descale), k_descale=to_numpy(inputs.k_descale),
                    v_descale=to_numpy(inputs.v_descale))
        ref, ref_lse = reference.attention_fp8_reference(*codes, **args)
        naive, _ = reference.attention_fp8_naive(*codes, out_dtype=out_dtype, **args)
        assert_attention_close(out, ref, fmt, baseline=naive, lse=lse, ref_lse=ref_lse if return_lse else None)


def test_rows_outside_every_window_give_zeros_and_minus_infinity():
    rng, q, k, v = _inputs(5, "bf16", 1, 2, 2, 200, 77, "bhsd", 64)
    # seqlen_q > seqlen_k, causal: the first 123 rows see no key; a window of 5 keeps that
    out, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True, window_size=(5, 0),
                                 return_lse=True)
    lse = to_numpy(lse)
    assert np.all(np.isneginf(lse[:, :, :123])) and np.all(np.isfinite(lse[:, :, 123:]))
    assert not np.any(to_numpy(out)[:, :, :123].astype(np.float32))


def test_repeated_calls_reuse_the_block_mask_and_the_plan():
    from cuflash import forward, sparsity

    _, q, k, v = _inputs(6, "bf16", 2, 4, 2, 256, 256, "bshd", 64)
    q, k, v = (cupy.asarray(x) for x in (q, k, v))
    first = cuflash.attention(q, k, v, causal=True, layout="bshd", window_size=(31, 0), softcap=10.0)
    masks, plans = dict(sparsity._window_masks), len(forward._plans)
    again = cuflash.attention(q, k, v, causal=True, layout="bshd", window_size=(31, 0), softcap=10.0)
    assert cupy.array_equal(first, again)
    assert sparsity._window_masks == masks and len(forward._plans) == plans
    wider = cuflash.attention(q, k, v, causal=True, layout="bshd", window_size=(63, 0), softcap=10.0)
    assert not cupy.array_equal(first, wider)


def test_conflicting_and_bad_arguments_are_refused():
    q = cupy.asarray(np.random.default_rng(7).standard_normal((1, 2, 64, 64)).astype(np.float16))
    with pytest.raises(ValueError, match="score_mod"):
        cuflash.attention(q, q, q, softcap=5.0, score_mod=mods.softcap(5.0))
    with pytest.raises(ValueError, match="mask_mod"):
        cuflash.attention(q, q, q, window_size=(8, 8), mask_mod=mods.sliding_window(8))
    with pytest.raises(ValueError, match="right must be 0"):
        cuflash.attention(q, q, q, causal=True, window_size=(8, 8))
    with pytest.raises(TypeError, match="window_size"):
        cuflash.attention(q, q, q, window_size=8)
    with pytest.raises(ValueError, match="softcap"):
        cuflash.attention(q, q, q, softcap=-1.0)



@pytest.mark.parametrize("sinks", [False, True])
def test_torch_bridge_takes_window_and_softcap(sinks):
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    rng, q, k, v = _inputs(8, "bf16", 2, 4, 2, 150, 150, "bshd", 64)
    tq, tk, tv = (torch.tensor(x.astype(np.float32), device="cuda").to(torch.bfloat16).requires_grad_()
                  for x in (q, k, v))
    ts = torch.tensor(rng.standard_normal(4).astype(np.float32), device="cuda", requires_grad=True) if sinks else None
    out = ct.attention(tq, tk, tv, causal=True, layout="bshd", window_size=(40, 0), softcap=15.0, sinks=ts)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out.backward(torch.tensor(dout.astype(np.float32), device="cuda").to(torch.bfloat16))
    args = dict(_reference_args(True, (40, 0), 15.0, 150, 150, "bshd"),
                sinks=None if ts is None else ts.detach().cpu().numpy())
    ref, _ = reference.attention_reference(q, k, v, **args)
    naive, _ = reference.attention_naive(q, k, v, **args)
    assert_attention_close(out.detach().float().cpu().numpy(), ref, "bf16", baseline=naive)
    grads = [x.grad.float().cpu().numpy() for x in (tq, tk, tv)]
    ref_grads = reference.attention_backward_reference(dout, q, k, v, **args)
    assert_gradients_close(grads, ref_grads[:3], "bf16",
                           baselines=reference.attention_backward_naive(dout, q, k, v, **args)[:3])
    if sinks:
        assert np.allclose(ts.grad.cpu().numpy(), ref_grads[3], atol=2e-2, rtol=2e-2)
