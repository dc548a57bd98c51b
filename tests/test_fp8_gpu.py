"""cuflash.attention on FP8 inputs against the float64 reference of the dequantized inputs, with
:func:`cuflash.reference.attention_fp8_naive` as the accuracy baseline: the Hopper FP8 kernel
(sm_90a) and the portable one (``family="mma"``, any GPU of sm_80 and newer), which converts the
codes to fp16 on chip.

Every test draws fresh inputs quantized with :func:`cuflash.quantize_fp8`, poisons the output
memory first and checks every element. The Hopper kernel's tests need sm_90a; the portable
kernel's and the bad-input tests run on any GPU.

The naive baseline rounds P to e4m3 (x 2^8) as the Hopper kernel does; the portable kernel keeps
P in fp16, about 2^7 times finer, so for it the same rule is a looser bound, not a tight one.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.reference
from cuflash.core import compile as compile_mod
from cuflash.core.policy import FP8_PORTABLE_TEST_HEAD_DIMS
from cuflash.testing import Fp8AttentionProblem, assert_attention_close, fp8_attention_problems

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def hopper():
    if compile_mod.device_arch() != "sm90a":
        pytest.skip("the FP8 kernel needs sm_90a")


@pytest.fixture(scope="module")
def warm_fp8_kernels(hopper):
    """Compile the FP8 kernel set (head dims 64/128/256 x e4m3/e5m2 x causal x bf16/fp16 output)
    once, in parallel processes."""
    from cuflash.core.policy import all_fp8_specs

    cuflash.warmup(all_fp8_specs(compile_mod.device_arch()), progress=False)


@pytest.fixture(scope="module")
def warm_portable_fp8_kernels():
    """Compile the portable FP8 set (spec.all_fp8_portable_specs: head dims 64/72/80/96/128/256 x
    e4m3/e5m2 x causal x bf16/fp16 output) once, in parallel processes."""
    from cuflash.core.policy import all_fp8_portable_specs

    cuflash.warmup(all_fp8_portable_specs(compile_mod.device_arch()), progress=False)


def run_and_check(problem: Fp8AttentionProblem, poison, seed=None, family=None, spec=None, return_lse=True):
    """One call checked against the reference. Without return_lse the Hopper kernel sums P on
    the tensor cores (spec.sums_on_tensor_cores); only the output is checked then."""
    inputs = problem.make_inputs(cupy, seed=seed)
    q_shape, _ = problem.shapes()
    poison(math.prod(q_shape) * 2, problem.batch * problem.heads * problem.seqlen_q * 4)
    result = cuflash.attention(inputs.q, inputs.k, inputs.v, return_lse=return_lse, family=family, spec=spec,
                               **problem.attention_kwargs(inputs))
    out, lse = result if return_lse else (result, None)
    assert out.dtype == problem.out_numpy_dtype and out.shape == q_shape
    ref, ref_lse = problem.reference(inputs)
    base, _ = problem.naive(inputs)
    if return_lse:
        assert lse.dtype == cupy.float32 and lse.shape == (problem.batch, problem.heads, problem.seqlen_q)
        assert_attention_close(out, ref, problem.fp8_format, baseline=base, lse=lse, ref_lse=ref_lse)
    else:
        assert_attention_close(out, ref, problem.fp8_format, baseline=base)
    return inputs, out, lse


def check_every_kernel(fmt, head_dim, causal, poison, family=None):
    """Tails in both sequences, seqlen_q != seqlen_k both ways, GQA, both layouts, both descale
    granularities, both output dtypes, with and without the LSE: every kernel of a set runs
    twice."""
    for sq, sk, layout, granularity, out_dtype in ((113, 239, "bhsd", "tensor", "bf16"),
                                                   (239, 113, "bshd", "head", "fp16")):
        problem = Fp8AttentionProblem(2, 4, 2, sq, sk, head_dim, fmt, granularity, out_dtype, causal=causal,
                                      layout=layout)
        for return_lse in (True, False):
            run_and_check(problem, poison, family=family, return_lse=return_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_kernel(fmt, head_dim, causal, warm_fp8_kernels, poison):
    check_every_kernel(fmt, head_dim, causal, poison)


def split_spec(problem: Fp8AttentionProblem, return_lse: bool):
    """The Hopper kernel the tests of tiles dealt out by keys run: the default, but at head dims up
    to 64, whose default has three consumers and never deals tiles out by keys
    (KernelSpec.split_keys), two consumers on 192 keys, so that rows of 64 bytes are covered
    split too."""
    from cuflash.core.policy import default_spec

    spec = default_spec(problem.head_dim, problem.fp8_format, False, "sm90a", lse=return_lse)
    return spec.replace(block_m=128, num_warps=12, block_n=192) if spec.compute_warpgroups == 3 else spec


def shares_end_inside_tiles(problem: Fp8AttentionProblem, spec) -> bool:
    """Whether ``spec`` deals the problem's last tiles out by keys (launch.split_plan) in shares
    of which some end inside a tile."""
    from cuflash.core.launch import split_plan
    from cuflash.core.validate import validate

    inputs = problem.make_inputs(cupy, seed=0)
    plan = split_plan(spec, validate(inputs.q, inputs.k, inputs.v, causal=False, scale=None, layout=problem.layout,
                                     fp8_format=problem.fp8_format))
    return plan.shares_end_inside_tiles


# 280 query tiles of 128 rows (1 x 140 heads x 2) on 132 multiprocessors: the last 148 are dealt
# out by keys (2 or 3 key tiles each, so shares end inside tiles). Kept small: the float64
# reference dominates these tests' time.
SPLIT_PROBLEM = dict(batch=1, heads=140, heads_k=20, seqlen_q=129, seqlen_k=300)


def _split_problem(head_dim):
    return Fp8AttentionProblem(**SPLIT_PROBLEM, head_dim=head_dim, fp8_format="e4m3", granularity="head")


@pytest.fixture(scope="module")
def warm_split_fp8_kernels(hopper):
    """Compile test_last_tiles_dealt_out_by_keys's kernels at once, in parallel processes."""
    cuflash.warmup(_split_fp8_specs(), progress=False)


@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no_lse"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_last_tiles_dealt_out_by_keys(head_dim, return_lse, warm_split_fp8_kernels, poison):
    """Enough tiles without a causal mask that the last ones are dealt out by keys
    (launch.split_plan), twice in a row."""
    problem = _split_problem(head_dim)
    spec = split_spec(problem, return_lse)
    assert shares_end_inside_tiles(problem, spec)
    for _ in range(2):
        run_and_check(problem, poison, spec=spec, return_lse=return_lse)


def _sums_on_tensor_cores_spec(head_dim, causal):
    from cuflash.core.policy import default_spec

    return default_spec(head_dim, "e5m2", causal, "sm90a", out_dtype="fp16").replace(lse=False)


@pytest.fixture(scope="module")
def warm_sums_on_tensor_cores_kernels(hopper):
    """Compile test_sums_on_tensor_cores_forced's kernels at once, in parallel processes."""
    cuflash.warmup(_sums_on_tensor_cores_specs(), progress=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sums_on_tensor_cores_forced(head_dim, causal, warm_sums_on_tensor_cores_kernels, poison):
    """The row sums on the tensor cores at the head dims whose default keeps float sums, forced;
    forcing them with return_lse=True is refused."""
    fast = _sums_on_tensor_cores_spec(head_dim, causal)
    problem = Fp8AttentionProblem(2, 4, 2, 239, 113, head_dim, "e5m2", "head", "fp16", causal=causal)
    run_and_check(problem, poison, spec=fast, return_lse=False)
    inputs = problem.make_inputs(cupy, seed=0)
    with pytest.raises(ValueError, match="lse=False"):
        cuflash.attention(inputs.q, inputs.k, inputs.v, spec=fast, return_lse=True, **problem.attention_kwargs(inputs))


@pytest.fixture(scope="module")
def warm_lazy_fp8_kernels(hopper):
    """Compile test_lazy_row_max's kernels at once, in parallel processes."""
    from cuflash.core.policy import default_spec

    cuflash.warmup(_lazy_fp8_specs(), progress=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lazy_row_max(head_dim, causal, warm_lazy_fp8_kernels, poison):
    """The Hopper FP8 kernel with and without lazy_rescale (the row max moves only by more than
    a slack, P up to 2^8.75) on keys whose scale rises by steps over many key tiles, so that each
    row's max moves by more than the slack on some tiles and by less on others. Only the output
    is checked: with keys up to a few times N(0, 1) the LSE drifts past the rule on the FP8
    tensor cores' accumulation, lazy or not (docs/fp8.md)."""
    from cuflash.fp8 import quantize_fp8
    from cuflash.core.policy import default_spec

    sq, sk = (200, 1700) if not causal else (1700, 1700)
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, n, head_dim), dtype=np.float32) for n in (sq, sk, sk))
    k *= (1 + 0.15 * ((sk - 1 - np.arange(sk)) // 100))[:, None].astype(np.float32)  # visited last to first
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(cupy.asarray(x), "e4m3", "head") for x in (q, k, v))
    descales = dict(q_descale=cupy.asnumpy(qd), k_descale=cupy.asnumpy(kd), v_descale=cupy.asnumpy(vd))
    codes = [cupy.asnumpy(c) for c in (q8, k8, v8)]
    ref, _ = cuflash.reference.attention_fp8_reference(*codes, causal=causal, fp8_format="e4m3", **descales)
    base, _ = cuflash.reference.attention_fp8_naive(*codes, causal=causal, fp8_format="e4m3", **descales)
    for lazy in (True, False):
        spec = default_spec(head_dim, "e4m3", causal, "sm90a").replace(lazy_rescale=lazy)
        poison(sq * 2 * head_dim * 2)
        out = cuflash.attention(q8, k8, v8, causal=causal, spec=spec, fp8_format="e4m3", q_descale=qd,
                                k_descale=kd, v_descale=vd)
        assert_attention_close(out, ref, "e4m3", baseline=base)


def _key_tile_spec(fmt, causal, block_n, out_dtype):
    import dataclasses

    from cuflash.core.policy import default_spec

    return dataclasses.replace(default_spec(128, fmt, causal, "sm90a", out_dtype=out_dtype), block_n=block_n)


# (fmt, causal, block_n): each format at each key tile once, the causal mask taken in turn, so
# each format and each key tile runs with and without it
KEY_TILE_CASES = [(fmt, (i + j) % 2 == 1, block_n) for i, fmt in enumerate(("e4m3", "e5m2"))
                  for j, block_n in enumerate((64, 128, 160))]


@pytest.fixture(scope="module")
def warm_key_tile_fp8_kernels(hopper):
    """Compile test_key_tiles_other_than_the_default's kernels at once, in parallel processes."""
    cuflash.warmup(_key_tile_fp8_specs(), progress=False)


@pytest.mark.parametrize("fmt,causal,block_n", KEY_TILE_CASES,
                         ids=[f"{t}-{('full', 'causal')[c]}-{n}" for t, c, n in KEY_TILE_CASES])
def test_key_tiles_other_than_the_default(fmt, causal, block_n, warm_key_tile_fp8_kernels, poison):
    """Key tiles read V^T in boxes of 128 keys with 128-byte swizzle where block_n is a multiple
    of 128, else of 64 keys with 64-byte swizzle (as the default 192 with a causal mask), else
    of 32 keys with 32-byte swizzle (as the default 224 without one)."""
    for sq, sk, layout, granularity, out_dtype in ((113, 239, "bhsd", "tensor", "bf16"),
                                                   (300, 451, "bshd", "head", "fp16")):
        spec = _key_tile_spec(fmt, causal, block_n, out_dtype)
        assert spec.fp8_v_box_keys == {64: 64, 128: 128, 160: 32}[block_n]
        problem = Fp8AttentionProblem(2, 4, 2, sq, sk, 128, fmt, granularity, out_dtype, causal=causal,
                                      layout=layout)
        run_and_check(problem, poison, spec=spec)


@pytest.fixture(scope="module")
def warm_key_loop_fp8_kernels(hopper):
    from cuflash.core.policy import default_spec

    cuflash.warmup(_key_loop_fp8_specs(), progress=False)


@pytest.mark.parametrize("early", [False, True], ids=["late", "early"])
@pytest.mark.parametrize("mask_in_loop", [False, True], ids=["masked_apart", "mask_in_loop"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_loop_variants(causal, mask_in_loop, early, warm_key_loop_fp8_kernels, poison):
    """Head dim 128 with each choice of mask_in_loop and early_rescale (the default takes the
    early rescale without a mask, its policy row), with and without the turns of
    its default (none at head dim 128, its policy row), on causal diagonals and
    key tails."""
    from cuflash.core.policy import default_spec

    for turns in (False, True):
        spec = default_spec(128, "e4m3", causal, "sm90a").replace(mask_in_loop=mask_in_loop, early_rescale=early,
                                                                    pingpong=turns)
        for sq, sk in ((300, 451), (451, 300)) if causal else ((113, 701),):
            problem = Fp8AttentionProblem(1, 2, 1, sq, sk, 128, "e4m3", "head", "bf16", causal=causal)
            run_and_check(problem, poison, spec=spec)


#: Head dims without Hopper FP8 tiles of their own (padded to whole column blocks), one format each.
PADDED_FP8 = [(32, "e4m3"), (80, "e5m2"), (96, "e4m3"), (160, "e5m2"), (192, "e4m3"), (240, "e5m2")]


@pytest.fixture(scope="module")
def warm_padded_fp8_kernels(hopper):
    from cuflash.core.policy import default_spec

    cuflash.warmup(_padded_fp8_specs(), progress=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,fmt", PADDED_FP8)
def test_padded_head_dims(head_dim, fmt, causal, warm_padded_fp8_kernels, poison):
    """Head dims that are multiples of 16 without tiles of their own run the Hopper kernel by
    default, computed at the next whole column block (48 at 64, 96 at 128, 160 at 256)."""
    assert cuflash.default_spec(head_dim, fmt, causal, "sm90a").family == "wgmma"
    check_every_kernel(fmt, head_dim, causal, poison)


def test_padded_head_dims_dealt_out_by_keys(hopper, poison):
    """A padded head dim whose last tiles are dealt out by keys (launch.split_plan)."""
    problem = Fp8AttentionProblem(**SPLIT_PROBLEM, head_dim=96, fp8_format="e4m3", granularity="head")
    assert shares_end_inside_tiles(problem, split_spec(problem, True))
    run_and_check(problem, poison)


@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_head_dim_72_runs_the_portable_fp8_kernel(out_dtype, warm_portable_fp8_kernels, poison, monkeypatch):
    """Head dim 72 (8 mod 16: rows TMA cannot copy) has no Hopper FP8 kernel: by default (on
    Hopper too) the portable kernel runs on the codes themselves, under the same contract and
    tolerance (any GPU)."""
    problem = Fp8AttentionProblem(2, 4, 2, 150, 211, 72, "e4m3", "head", out_dtype, causal=True, layout="bshd")
    launched = []
    get_kernel = compile_mod.get_kernel
    monkeypatch.setattr(compile_mod, "get_kernel", lambda spec, device: launched.append(spec) or get_kernel(spec, device))
    run_and_check(problem, poison)
    want = cuflash.default_spec(72, "e4m3", True, compile_mod.device_arch(), out_dtype=out_dtype)
    assert launched == [want] and want.family == "mma" and want.converts_fp8, launched


# The fixtures are module-wide or stateless helpers, safe to share between examples.
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=fp8_attention_problems(), return_lse=st.booleans())
def test_property_against_reference(problem, return_lse, warm_fp8_kernels, poison):
    run_and_check(problem, poison, return_lse=return_lse)


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 700), (700, 1), (128, 128), (129, 257), (257, 129)])
def test_awkward_lengths(seqlens, warm_fp8_kernels, poison):
    sq, sk = seqlens
    for causal in (False, True):
        run_and_check(Fp8AttentionProblem(1, 2, 1, sq, sk, 128, "e4m3", "head", causal=causal), poison)


def test_fully_masked_rows_give_zero_and_minus_inf(warm_fp8_kernels, poison):
    problem = Fp8AttentionProblem(1, 2, 2, 300, 100, 64, "e5m2", "head", "fp16", causal=True)
    _, out, lse = run_and_check(problem, poison)
    out, lse = cupy.asnumpy(out).astype(np.float32), cupy.asnumpy(lse)
    assert np.all(out[:, :, :200] == 0) and not np.isnan(out).any()
    assert np.all(lse[:, :, :200] == -np.inf) and np.all(np.isfinite(lse[:, :, 200:]))
    _, out, _ = run_and_check(problem, poison, return_lse=False)  # the sums from the tensor cores
    out = cupy.asnumpy(out).astype(np.float32)
    assert np.all(out[:, :, :200] == 0) and not np.isnan(out).any()


def test_descale_forms_and_int8_codes_agree(warm_fp8_kernels):
    """A per-tensor descale as a 0-d array, a Python float or a (batch, heads) array of that one
    value gives the same bits; int8 arrays are read as the same codes; None means 1."""
    problem = Fp8AttentionProblem(2, 4, 2, 150, 150, 128, "e4m3", "tensor", causal=True)
    inputs = problem.make_inputs(cupy, seed=0)
    kwargs = problem.attention_kwargs(inputs)
    want = cuflash.attention(inputs.q, inputs.k, inputs.v, **kwargs)
    as_float = dict(kwargs, **{name: float(kwargs[name]) for name in ("q_descale", "k_descale", "v_descale")})
    assert bool((cuflash.attention(inputs.q, inputs.k, inputs.v, **as_float) == want).all())
    per_head = dict(kwargs, q_descale=cupy.full((2, 4), float(kwargs["q_descale"]), cupy.float32),
                    k_descale=cupy.full((2, 2), float(kwargs["k_descale"]), cupy.float32))
    assert bool((cuflash.attention(inputs.q, inputs.k, inputs.v, **per_head) == want).all())
    signed = (x.view(cupy.int8) for x in (inputs.q, inputs.k, inputs.v))
    assert bool((cuflash.attention(*signed, **kwargs) == want).all())
    # Descales of 1 on the same codes: the softmax scale takes q's and k's factors, so the scores
    # stay those of the quantized problem. (Raw codes at scale 1/sqrt(d) give scores near 10^6,
    # where the FP8 tensor cores' accumulation, narrower than float32, decides the argmax.)
    scale = (problem.scale or 1 / math.sqrt(problem.head_dim)) * float(kwargs["q_descale"]) * float(kwargs["k_descale"])
    ones = dict(kwargs, q_descale=None, k_descale=None, v_descale=None, scale=scale)
    out, lse = cuflash.attention(inputs.q, inputs.k, inputs.v, return_lse=True, **ones)
    numpy_args = [cupy.asnumpy(x) for x in (inputs.q, inputs.k, inputs.v)]
    reference_kwargs = {name: value for name, value in ones.items() if name != "out_dtype"}
    ref, ref_lse = cuflash.reference.attention_fp8_reference(*numpy_args, **reference_kwargs)
    base, _ = cuflash.reference.attention_fp8_naive(*numpy_args, **ones)
    assert_attention_close(out, ref, "e4m3", baseline=base, lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_lowers_the_error_on_outliers(head_dim, fmt, warm_fp8_kernels):
    """q and k with 4 head-dim channels 50x larger: rotating both before quantizing (the same
    orthogonal matrix, q k^T unchanged) lowers the error against the float64 attention of the
    unrotated float inputs."""
    errors = {}
    for rotate in (False, True):
        problem = Fp8AttentionProblem(1, 2, 2, 256, 256, head_dim, fmt, "head", scale=1 / (50 * math.sqrt(head_dim)),
                                      outliers=4, rotate=rotate)
        inputs = problem.make_inputs(cupy, seed=5)
        out = cuflash.attention(inputs.q, inputs.k, inputs.v, **problem.attention_kwargs(inputs))
        want, _ = problem.float_reference(inputs)
        errors[rotate] = float(np.abs(cupy.asnumpy(out).astype(np.float64) - want).max())
    assert errors[True] < errors[False], errors


@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 3, 15, 48), (1, 2, 17, 144), (2, 1, 64, 256), (1, 2, 65, 128),
                                   (3, 2, 200, 80)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_v_operand_kernel_matches_numpy(shape, layout):
    """The device kernel behind fp8.v_operand lays V out byte for byte as the NumPy definition
    does: keys padded with zero codes, the order within each 16, both layouts, and views that
    start off 16-byte alignment (copied first)."""
    from cuflash import fp8

    v = cupy.asarray(np.random.default_rng().integers(0, 256, shape, dtype=np.uint8))
    if layout == "bshd":
        v = v.transpose(0, 2, 1, 3)
    want = fp8.v_operand(cupy.asnumpy(v), layout)
    got = fp8.v_operand(v, layout)
    assert got.shape == want.shape and bool((cupy.asnumpy(got) == want).all())
    wide = cupy.asarray(np.random.default_rng().integers(0, 256, v.shape[:3] + (v.shape[3] + 4,), dtype=np.uint8))
    flat = cupy.asarray(np.random.default_rng().integers(0, 256, v.size + 4, dtype=np.uint8))
    # Rows 4 bytes past 16-byte alignment; one contiguous run 4 bytes into its buffer.
    for view in (wide[..., 4:], flat[4:].reshape(v.shape)):
        assert bool((cupy.asnumpy(fp8.v_operand(view, layout)) == fp8.v_operand(cupy.asnumpy(view), layout)).all())


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_prepared_v_gives_the_same_bits(layout, warm_fp8_kernels, poison):
    """V rearranged once (cuflash.prepare_v, a KV cache) gives bit-identical results to V passed
    as is, call after call."""
    problem = Fp8AttentionProblem(2, 4, 2, 77, 300, 128, "e4m3", "head", "bf16", causal=True, layout=layout)
    inputs = problem.make_inputs(cupy)
    kwargs = problem.attention_kwargs(inputs)
    prepared = cuflash.prepare_v(inputs.v, layout=layout)
    assert isinstance(prepared, cuflash.PreparedV) and prepared.shape == inputs.v.shape
    want, want_lse = cuflash.attention(inputs.q, inputs.k, inputs.v, return_lse=True, **kwargs)
    for _ in range(2):
        poison(math.prod(want.shape) * 2, want_lse.size * 4)
        got, got_lse = cuflash.attention(inputs.q, inputs.k, prepared, return_lse=True, **kwargs)
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all())
        assert bool((got_lse == want_lse).all())


def test_prepared_v_is_for_the_hopper_kernel_and_its_own_call(hopper):
    q = k = _codes((1, 2, 40, 128))
    prepared = cuflash.prepare_v(_codes((1, 2, 40, 128)))
    with pytest.raises(TypeError, match="fp8_format"):
        cuflash.attention(q, k, prepared)
    with pytest.raises(ValueError, match="layout='bhsd'"):
        cuflash.attention(q, k, prepared, fp8_format="e4m3", layout="bshd")
    with pytest.raises(ValueError, match="Hopper FP8 kernel only"):
        cuflash.attention(q, k, prepared, fp8_format="e4m3", family="mma")
    with pytest.raises(ValueError, match="k.shape"):
        cuflash.attention(q, _codes((1, 2, 41, 128)), prepared, fp8_format="e4m3")
    q72 = _codes((1, 2, 40, 72))  # 8 mod 16: the portable kernel
    with pytest.raises(ValueError, match="Hopper FP8 kernel only"):
        cuflash.attention(q72, q72, cuflash.prepare_v(q72), fp8_format="e4m3")
    with pytest.raises(TypeError, match="FP8 codes"):
        cuflash.prepare_v(_half((1, 2, 40, 128)))


def _codes(shape):
    return cupy.random.randint(0, 0x7F, size=shape, dtype=cupy.int32).astype(cupy.uint8)


def _half(shape):
    return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)


def test_rejects_fp8_codes_without_a_format_and_16_bit_arrays_with_one():
    x = _codes((1, 2, 8, 64))
    with pytest.raises(TypeError, match="fp8_format"):
        cuflash.attention(x, x, x)
    with pytest.raises(TypeError):
        cuflash.attention(_half((1, 2, 8, 64)), _half((1, 2, 8, 64)), _half((1, 2, 8, 64)), fp8_format="e4m3")
    with pytest.raises(TypeError):
        cuflash.attention(x, _half((1, 2, 8, 64)), x, fp8_format="e4m3")
    with pytest.raises(ValueError, match="fp8_format='e3m4'"):
        cuflash.attention(x, x, x, fp8_format="e3m4")


@pytest.mark.parametrize("name,value", [
    ("q_descale", (1, 3)), ("k_descale", (1, 2)), ("v_descale", (1, 1, 1)),   # shapes; q has 2 heads, k 1
    ("q_descale", -1.0), ("k_descale", float("nan")), ("v_descale", float("inf")),
    ("out_dtype", "fp32"), ("out_dtype", "e4m3"),
])
def test_rejects_bad_descales_and_out_dtypes(name, value):
    q, kv = _codes((1, 2, 8, 64)), _codes((1, 1, 8, 64))
    kwargs = {name: cupy.ones(value, cupy.float32) if isinstance(value, tuple) else value}
    with pytest.raises((ValueError, TypeError), match=name):
        cuflash.attention(q, kv, kv, fp8_format="e4m3", **kwargs)


# -- the portable kernel (family "mma": FP8 codes converted to fp16 on chip; any GPU) -------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", FP8_PORTABLE_TEST_HEAD_DIMS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_portable_every_kernel(fmt, head_dim, causal, warm_portable_fp8_kernels, poison):
    # Head dim 72 reads its rows in 8-byte copies.
    check_every_kernel(fmt, head_dim, causal, poison, family="mma")


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 700), (700, 1), (128, 128), (129, 257), (257, 129)])
def test_portable_awkward_lengths(seqlens, warm_portable_fp8_kernels, poison):
    sq, sk = seqlens
    for causal in (False, True):
        run_and_check(Fp8AttentionProblem(1, 2, 1, sq, sk, 128, "e5m2", "head", causal=causal), poison,
                      family="mma")


# The fixtures are module-wide or stateless helpers, safe to share between examples.
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=fp8_attention_problems(head_dims=FP8_PORTABLE_TEST_HEAD_DIMS, outliers=True))
def test_portable_property_against_reference(problem, warm_portable_fp8_kernels, poison):
    run_and_check(problem, poison, family="mma")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_portable_fully_masked_rows_give_zero_and_minus_inf(fmt, warm_portable_fp8_kernels, poison):
    problem = Fp8AttentionProblem(1, 2, 2, 300, 100, 64, fmt, "head", "fp16", causal=True)
    _, out, lse = run_and_check(problem, poison, family="mma")
    out, lse = cupy.asnumpy(out).astype(np.float32), cupy.asnumpy(lse)
    assert np.all(out[:, :, :200] == 0) and not np.isnan(out).any()
    assert np.all(lse[:, :, :200] == -np.inf) and np.all(np.isfinite(lse[:, :, 200:]))


@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("fmt,nan_code", [("e4m3", 0xFF), ("e4m3", 0x7F), ("e5m2", 0x7E)])
def test_portable_nan_codes_reach_only_their_rows_and_columns(fmt, nan_code, head_dim, warm_portable_fp8_kernels):
    """A NaN code in q makes its output row NaN; in k, the rows that attend that key (causal:
    from query j - (seqlen_k - seqlen_q) on); in v (no mask), that column of every row. Everything
    else keeps the bits of the run without the NaN."""
    sq, sk, j = 150, 211, 100
    problem = Fp8AttentionProblem(1, 2, 1, sq, sk, head_dim, fmt, "head", "bf16", causal=True)
    inputs = problem.make_inputs(cupy, seed=3)
    kwargs = problem.attention_kwargs(inputs)

    def run(q, k, v, **extra):
        out, lse = cuflash.attention(q, k, v, return_lse=True, family="mma", **dict(kwargs, **extra))
        return cupy.asnumpy(out).astype(np.float32), cupy.asnumpy(lse)

    def poisoned(x, index):
        x = x.copy()
        x[index] = nan_code
        return x

    for causal in (False, True):
        clean, clean_lse = run(inputs.q, inputs.k, inputs.v, causal=causal)
        assert np.isfinite(clean).all()
        # q: row 17 of head 1
        out, lse = run(poisoned(inputs.q, (0, 1, 17, 5)), inputs.k, inputs.v, causal=causal)
        expected = np.zeros(out.shape, bool)
        expected[0, 1, 17] = True
        assert np.array_equal(np.isnan(out), expected)
        assert np.array_equal(np.isnan(lse), expected[..., 0])
        np.testing.assert_array_equal(out[~expected], clean[~expected])
        # k: key j of the one kv head, seen by both query heads
        out, lse = run(inputs.q, poisoned(inputs.k, (0, 0, j, 3)), inputs.v, causal=causal)
        rows = np.arange(sq) >= (j - (sk - sq) if causal else 0)
        expected = np.broadcast_to(rows[None, None, :, None], out.shape)
        assert np.array_equal(np.isnan(out), expected), causal
        assert np.array_equal(np.isnan(lse), expected[..., 0])
        np.testing.assert_array_equal(out[~expected], clean[~expected])
        np.testing.assert_array_equal(lse[~expected[..., 0]], clean_lse[~expected[..., 0]])
    # v: column 7 of key j (no mask: every row attends it)
    clean, _ = run(inputs.q, inputs.k, inputs.v, causal=False)
    out, lse = run(inputs.q, inputs.k, poisoned(inputs.v, (0, 0, j, 7)), causal=False)
    expected = np.zeros(out.shape, bool)
    expected[..., 7] = True
    assert np.array_equal(np.isnan(out), expected) and np.isfinite(lse).all()
    np.testing.assert_array_equal(out[~expected], clean[~expected])


@pytest.mark.parametrize("family", ["mma", "wgmma"])
def test_negative_descale_product_gives_nan_rows(family, warm_portable_fp8_kernels, poison):
    """Device descales are not read back: a head whose q and k factors multiply to a negative
    number gets NaN rows (O and LSE); the other heads are unaffected."""
    if family == "wgmma" and compile_mod.device_arch() != "sm90a":
        pytest.skip("the Hopper FP8 kernel needs sm_90a")
    problem = Fp8AttentionProblem(2, 4, 2, 100, 130, 128, "e4m3", "head", "bf16", causal=True)
    inputs = problem.make_inputs(cupy, seed=1)
    kwargs = problem.attention_kwargs(inputs)
    want, want_lse = cuflash.attention(inputs.q, inputs.k, inputs.v, return_lse=True, family=family, **kwargs)
    q_descale = inputs.q_descale.copy()
    q_descale[1, 2] *= -1
    out, lse = cuflash.attention(inputs.q, inputs.k, inputs.v, return_lse=True, family=family,
                                 **dict(kwargs, q_descale=q_descale))
    out, lse, want, want_lse = (cupy.asnumpy(x).astype(np.float32) for x in (out, lse, want, want_lse))
    assert np.isnan(out[1, 2]).all() and np.isnan(lse[1, 2]).all()
    others = np.ones(out.shape[:2], bool)
    others[1, 2] = False
    np.testing.assert_array_equal(out[others], want[others])
    np.testing.assert_array_equal(lse[others], want_lse[others])


def test_portable_reads_misaligned_views(warm_portable_fp8_kernels):
    """Views whose rows the 16-byte (head dim 72: 8-byte) copies cannot read are copied once,
    with the same result; the output of the codes themselves is unchanged."""
    for head_dim, layout in ((64, "bhsd"), (72, "bshd")):
        problem = Fp8AttentionProblem(1, 2, 2, 70, 90, head_dim, "e4m3", "tensor", "bf16", layout=layout)
        inputs = problem.make_inputs(cupy, seed=2)
        kwargs = problem.attention_kwargs(inputs)
        want = cuflash.attention(inputs.q, inputs.k, inputs.v, family="mma", **kwargs)
        wide = cupy.zeros(inputs.q.shape[:3] + (head_dim + 1,), cupy.uint8)
        wide[..., 1:] = inputs.q
        out = cuflash.attention(wide[..., 1:], inputs.k, inputs.v, family="mma", **kwargs)
        assert bool((out.view(cupy.uint16) == want.view(cupy.uint16)).all())


# -- the warm fixtures' kernels ---------------------------------------------------------------------

def _lazy_fp8_specs():
    from cuflash.core.policy import default_spec

    return [default_spec(hd, "e4m3", c, "sm90a").replace(lazy_rescale=lazy) for hd in (64, 128, 256)
            for c in (False, True) for lazy in (True, False)]


def _key_loop_fp8_specs():
    from cuflash.core.policy import default_spec

    return [default_spec(128, "e4m3", c, "sm90a").replace(mask_in_loop=m, early_rescale=e, pingpong=t)
            for c in (False, True) for m in (False, True) for e in (False, True) for t in (False, True)]


def _padded_fp8_specs():
    from cuflash.core.policy import default_spec

    # with and without the LSE: check_every_kernel runs both (at 256's tiles they differ)
    return list(dict.fromkeys(default_spec(d, t, c, "sm90a", out_dtype=o, lse=e) for d, t in PADDED_FP8
                              for c in (False, True) for o in ("bf16", "fp16") for e in (True, False)))


def _split_fp8_specs():
    return list(dict.fromkeys(split_spec(_split_problem(d), lse) for d in (64, 128, 256) for lse in (True, False)))


def _sums_on_tensor_cores_specs():
    return [_sums_on_tensor_cores_spec(d, c) for d in (64, 128) for c in (False, True)]


def _key_tile_fp8_specs():
    return [_key_tile_spec(t, c, n, o) for t, c, n in KEY_TILE_CASES for o in ("bf16", "fp16")]


def _all_fp8_specs(arch):
    from cuflash.core.policy import all_fp8_specs

    return all_fp8_specs(arch) if arch == "sm90a" else []


def _all_fp8_portable_specs(arch):
    from cuflash.core.policy import all_fp8_portable_specs

    return all_fp8_portable_specs(arch)


#: The warm fixtures' kernels by fixture name (WARM: of the device's target; WARM_HOPPER: on sm_90a):
#: the session compiles them in its first pool.
WARM = {"warm_fp8_kernels": _all_fp8_specs, "warm_portable_fp8_kernels": _all_fp8_portable_specs}
WARM_HOPPER = {"warm_lazy_fp8_kernels": _lazy_fp8_specs, "warm_key_loop_fp8_kernels": _key_loop_fp8_specs,
               "warm_padded_fp8_kernels": _padded_fp8_specs, "warm_split_fp8_kernels": _split_fp8_specs,
               "warm_sums_on_tensor_cores_kernels": _sums_on_tensor_cores_specs,
               "warm_key_tile_fp8_kernels": _key_tile_fp8_specs}
