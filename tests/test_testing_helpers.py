"""cuflash.testing: problems, strategies, the accuracy rule and Hypothesis profiles (CPU only)."""
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from cuflash.core import dtypes, spec
from cuflash.simulate import simulate_tiled
from cuflash.testing import (AWKWARD_SEQLENS, MAX_PROBLEM_WORK, TOLERANCES, AttentionProblem,
                             assert_attention_close, attention_problems,
                             register_hypothesis_profiles, seqlen_pairs, seqlens, to_numpy)


def _single_row(shape):
    """True when every dim but the last has size 1: such a view is contiguous whatever its strides."""
    return all(n == 1 for n in shape[:-1])


@settings(deadline=None, max_examples=60)
@given(problem=attention_problems(max_seqlen=300), seed=st.integers(0, 2**32 - 1))
def test_problems_are_valid_and_inputs_match_them(problem, seed):
    assert problem.dtype in dtypes.DTYPES
    assert problem.head_dim in spec.HEAD_DIMS
    assert problem.heads % problem.heads_k == 0
    assert 1 <= problem.seqlen_q <= 300 and 1 <= problem.seqlen_k <= 300
    assert problem.layout in ("bhsd", "bshd")
    assert problem.work <= MAX_PROBLEM_WORK
    q_shape, kv_shape = problem.shapes()
    inputs = problem.make_inputs(seed=seed)
    for x, shape in zip(inputs, (q_shape, kv_shape, kv_shape)):
        assert x.shape == shape
        assert x.dtype == problem.numpy_dtype
        assert x.strides[-1] == x.itemsize
        if problem.strided and not _single_row(shape):
            assert not x.flags.c_contiguous
        if not problem.strided:
            assert x.flags.c_contiguous
        values = x.astype(np.float64)
        assert np.isfinite(values).all()
        assert (values != 0).any()


def test_shapes_follow_the_layout():
    p = AttentionProblem(batch=2, heads=6, heads_k=3, seqlen_q=17, seqlen_k=113, head_dim=40,
                         dtype="bf16")
    assert p.shapes() == ((2, 6, 17, 40), (2, 3, 113, 40))
    bshd = AttentionProblem(2, 6, 3, 17, 113, 40, "bf16", layout="bshd")
    assert bshd.shapes() == ((2, 17, 6, 40), (2, 113, 3, 40))
    assert bshd.name == "bf16 hd40 b2 h6/3 sq17 sk113 bshd"
    assert AttentionProblem(1, 2, 2, 3, 3, 8, "float16").dtype == "fp16"


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_strided_inputs_are_views_with_row_aligned_strides(layout, dtype):
    p = AttentionProblem(2, 4, 2, 17, 9, 24, dtype, layout=layout, strided=True)
    q, k, v = p.make_inputs(seed=1)
    contiguous = AttentionProblem(2, 4, 2, 17, 9, 24, dtype, layout=layout).make_inputs(seed=1)
    for x, y in zip((q, k, v), contiguous):
        assert x.base is not None and not x.flags.c_contiguous
        assert x.strides[-1] == x.itemsize
        assert all(s % 16 == 0 for s in x.strides[:-1])   # every row starts 16-byte aligned
        assert x.shape == y.shape
    # the reference sees the view's values, never the NaN padding around them
    out, lse = p.reference(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_inputs_are_reproducible_and_seed_dependent():
    p = AttentionProblem(1, 2, 2, 5, 5, 8, "fp16")
    a, b, c = p.make_inputs(seed=3), p.make_inputs(seed=3), p.make_inputs(seed=4)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)


def test_problem_validation():
    with pytest.raises(ValueError, match="multiple of heads_k"):
        AttentionProblem(1, 3, 2, 4, 4, 8, "fp16")
    with pytest.raises(ValueError, match="layout"):
        AttentionProblem(1, 2, 2, 4, 4, 8, "fp16", layout="sbhd")
    with pytest.raises(ValueError, match="not supported"):
        AttentionProblem(1, 2, 2, 4, 4, 8, "fp64")


def test_strategy_respects_its_arguments():
    problem = find(attention_problems(head_dims=(64,), dtypes=("bf16",), causal=True,
                                      layouts=("bshd",), allow_gqa=False, allow_strided=False),
                   lambda p: p.heads > 1, settings=settings(database=None))
    assert (problem.head_dim, problem.dtype, problem.causal, problem.layout) == (64, "bf16", True, "bshd")
    assert problem.heads == problem.heads_k and not problem.strided


@settings(deadline=None, max_examples=60)
@given(problem=attention_problems(max_work=1 << 16))
def test_strategy_bounds_the_work(problem):
    assert problem.work <= 1 << 16


def test_strategy_shrinks_long_sequences_to_fit_the_work_bound():
    problem = find(attention_problems(head_dims=(256,), max_work=1 << 16),
                   lambda p: max(p.seqlen_q, p.seqlen_k) >= 200, settings=settings(database=None))
    assert problem.work <= 1 << 16 and min(problem.seqlen_q, problem.seqlen_k) == 1


@pytest.mark.parametrize("relation", [lambda q, k: q > k, lambda q, k: q < k, lambda q, k: q == k])
def test_seqlen_pairs_cover_every_relation(relation):
    find(seqlen_pairs(), lambda pair: relation(*pair), settings=settings(database=None))


def test_seqlens_reach_the_awkward_values():
    for value in AWKWARD_SEQLENS:
        find(seqlens(), lambda s, value=value: s == value, settings=settings(database=None))
    assert find(seqlens(min_value=2, max_value=16), lambda s: True) in range(2, 17)


# -- the accuracy rule ----------------------------------------------------------------------------

def _case(dtype="fp16", causal=True, seqlen_q=23, seqlen_k=11, seed=0):
    p = AttentionProblem(1, 2, 1, seqlen_q, seqlen_k, 32, dtype, causal=causal)
    q, k, v = p.make_inputs(seed=seed)
    ref, ref_lse = p.reference(q, k, v)
    base, base_lse = p.naive(q, k, v)
    return p, (q, k, v), ref, ref_lse, base, base_lse


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_reference_passes_against_itself(dtype):
    _, _, ref, ref_lse, base, base_lse = _case(dtype)
    assert np.isneginf(ref_lse).any()   # rows that attend nothing are part of the check
    assert_attention_close(ref, ref, dtype, lse=ref_lse, ref_lse=ref_lse)
    assert_attention_close(ref, ref, dtype, baseline=base, lse=ref_lse, ref_lse=ref_lse,
                           baseline_lse=base_lse)
    assert_attention_close(base, ref, dtype, baseline=base, lse=base_lse, ref_lse=ref_lse,
                           baseline_lse=base_lse)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_algorithm_rounded_to_dtype_passes(dtype, causal):
    p, (q, k, v), ref, ref_lse, base, base_lse = _case(dtype, causal, seqlen_q=239, seqlen_k=113)
    out, lse = simulate_tiled(q, k, v, causal=causal, block_m=64, block_n=32)
    out = out.astype(p.numpy_dtype)
    assert_attention_close(out, ref, dtype, baseline=base, lse=lse.astype(np.float32),
                           ref_lse=ref_lse, baseline_lse=base_lse)
    assert_attention_close(out, ref, p.numpy_dtype, lse=lse, ref_lse=ref_lse)


def test_perturbed_value_fails_with_location():
    _, _, ref, _, base, _ = _case("fp16")
    out = ref.copy()
    out[0, 1, 20, 7] += 0.05
    with pytest.raises(AssertionError, match=r"index \(0, 1, 20, 7\)") as info:
        assert_attention_close(out, ref, "fp16", baseline=base)
    assert "baseline error" in str(info.value)
    with pytest.raises(AssertionError, match=r"index \(0, 1, 20, 7\)"):
        assert_attention_close(out, ref, "fp16")
    # within atol of a zero baseline error passes, beyond it fails
    out = ref.copy()
    out[0, 0, 15, 0] += TOLERANCES["fp16"].atol / 2
    assert_attention_close(out, ref, "fp16", baseline=ref)
    out[0, 0, 15, 0] += TOLERANCES["fp16"].atol
    with pytest.raises(AssertionError):
        assert_attention_close(out, ref, "fp16", baseline=ref)
    assert_attention_close(out, ref, "fp16", baseline=ref, atol=1.0)


def test_nan_must_match_exactly():
    _, _, ref, ref_lse, base, _ = _case("bf16")
    out = ref.copy()
    out[0, 0, 21, 3] = np.nan
    with pytest.raises(AssertionError, match="NaN"):
        assert_attention_close(out, ref, "bf16", baseline=base)
    poisoned = ref.copy()
    poisoned[0, 1, 22] = np.nan
    with pytest.raises(AssertionError, match="NaN"):
        assert_attention_close(ref, poisoned, "bf16")
    assert_attention_close(poisoned, poisoned, "bf16", baseline=base)


def test_minus_inf_lse_must_match_exactly():
    _, _, ref, ref_lse, _, _ = _case("fp32")
    lse = ref_lse.copy()
    lse[np.isneginf(lse)] = -1e30
    with pytest.raises(AssertionError, match="-inf"):
        assert_attention_close(ref, ref, "fp32", lse=lse, ref_lse=ref_lse)
    lse = ref_lse.copy()
    lse[0, 0, 22] = -np.inf
    with pytest.raises(AssertionError, match="-inf"):
        assert_attention_close(ref, ref, "fp32", lse=lse, ref_lse=ref_lse)
    lse = ref_lse.copy()
    lse[0, 0, 22] += 1e-3
    with pytest.raises(AssertionError, match="lse"):
        assert_attention_close(ref, ref, "fp32", lse=lse, ref_lse=ref_lse)


def test_shape_mismatch_and_argument_errors():
    _, _, ref, ref_lse, _, _ = _case("fp16")
    with pytest.raises(AssertionError, match="shape"):
        assert_attention_close(ref[:, :1], ref, "fp16")
    with pytest.raises(ValueError, match="both"):
        assert_attention_close(ref, ref, "fp16", lse=ref_lse)
    with pytest.raises(ValueError, match="not supported"):
        assert_attention_close(ref, ref, "fp64")


def test_to_numpy_passes_numpy_through():
    x = np.arange(4.0)
    assert to_numpy(x) is x
    assert isinstance(to_numpy([1, 2]), np.ndarray)


def test_hypothesis_profiles():
    assert register_hypothesis_profiles() == ("ci", "dev")
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.deadline is None and ci.max_examples <= 100
    assert settings.get_profile("dev").deadline is None


def test_imports_without_cupy_or_hypothesis():
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['hypothesis'] = None; "
            "import cuflash.testing as t, cuflash.reference as r; "
            "p = t.AttentionProblem(1, 1, 1, 3, 3, 8, 'bf16'); q, k, v = p.make_inputs(seed=0); "
            "o, l = p.reference(q, k, v); t.assert_attention_close(o, o, 'bf16', lse=l, ref_lse=l)")
    subprocess.run([sys.executable, "-c", code], check=True)
