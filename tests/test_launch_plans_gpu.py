"""Repeated forward calls skip to a launch plan (shapes, strides, dtypes, flags, device and stream
unchanged): the plan's launches give the bits of the full path, on new arrays at new addresses
too; anything else (a misaligned view, another shape, bad input) takes the full path."""
import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import forward  # noqa: E402
from cuflash.testing import AttentionProblem, assert_attention_close  # noqa: E402

pytestmark = pytest.mark.gpu

PROBLEMS = [
    (AttentionProblem(batch=2, heads=8, heads_k=2, seqlen_q=300, seqlen_k=300, head_dim=128, dtype="bf16",
                      causal=True), None),
    (AttentionProblem(batch=1, heads=140, heads_k=140, seqlen_q=129, seqlen_k=1100, head_dim=128, dtype="bf16"),
     None),  # the last wave dealt out by keys on Hopper
    (AttentionProblem(batch=1, heads=4, heads_k=1, seqlen_q=239, seqlen_k=113, head_dim=64, dtype="fp16",
                      causal=True, layout="bshd", strided=True), None),
    (AttentionProblem(batch=1, heads=4, heads_k=4, seqlen_q=100, seqlen_k=100, head_dim=96, dtype="fp16"), "mma"),
    (AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=64, seqlen_k=80, head_dim=64, dtype="fp32",
                      causal=True), None),
]


@pytest.mark.parametrize("problem,family", PROBLEMS, ids=lambda x: getattr(x, "name", str(x)))
def test_plans_give_the_full_paths_bits(problem, family):
    call = dict(causal=problem.causal, layout=problem.layout, family=family, return_lse=True)
    q, k, v = problem.make_inputs(cupy, seed=1)
    forward._plans.clear()
    full = cuflash.attention(q, k, v, **call)
    assert len(forward._plans) == 1
    planned = cuflash.attention(q, k, v, **call)
    assert all(bool((a == b).all()) for a, b in zip(full, planned))
    q2, k2, v2 = problem.make_inputs(cupy, seed=2)  # other arrays, other addresses
    out, lse = cuflash.attention(q2, k2, v2, **call)
    assert len(forward._plans) == 1
    forward._plans.clear()
    want = cuflash.attention(q2, k2, v2, **call)
    assert bool((out == want[0]).all()) and bool((lse == want[1]).all())
    ref, ref_lse = problem.reference(q2, k2, v2)
    naive, naive_lse = problem.naive(q2, k2, v2)
    assert_attention_close(out, ref, problem.dtype, baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)


def test_a_misaligned_view_or_bad_input_takes_the_full_path():
    problem = AttentionProblem(batch=1, heads=4, heads_k=4, seqlen_q=200, seqlen_k=200, head_dim=64, dtype="bf16")
    q, k, v = problem.make_inputs(cupy, seed=3)
    forward._plans.clear()
    cuflash.attention(q, k, v)
    cuflash.attention(q, k, v)
    # same shape and strides, base 2 bytes off the 16-byte grid: not the plan's launch, a fresh copy
    buffer = cupy.empty(q.size + 8, dtype=q.dtype)
    shifted = buffer[1:1 + q.size].reshape(q.shape)
    shifted[...] = q
    assert shifted.data.ptr % 16 and shifted.strides == q.strides
    assert bool((cuflash.attention(shifted, k, v) == cuflash.attention(q, k, v)).all())
    with pytest.raises(ValueError, match="head_dim"):
        cuflash.attention(q, k[..., :32], v[..., :32])
    with pytest.raises(TypeError, match="scale"):
        cuflash.attention(q, k, v, scale="0.1")
    negative = cuflash.attention(q, k, v, scale=-0.125)  # folds the sign into k: never planned
    again = cuflash.attention(q, k, v, scale=-0.125)
    assert bool((negative == again).all())
    ref, _ = AttentionProblem(batch=1, heads=4, heads_k=4, seqlen_q=200, seqlen_k=200, head_dim=64, dtype="bf16",
                              scale=-0.125).reference(q, k, v)
    assert float(cupy.abs(again.astype(cupy.float32) - cupy.asarray(ref, dtype=cupy.float32)).max()) < 3e-2


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_dropped_output_is_handed_out_again_and_a_held_one_keeps_its_values(return_lse):
    problem = AttentionProblem(batch=1, heads=4, heads_k=2, seqlen_q=130, seqlen_k=200, head_dim=64, dtype="bf16",
                               causal=True)
    inputs = [problem.make_inputs(cupy, seed=s) for s in (4, 5, 6)]
    forward._plans.clear()

    def call(i):
        result = cuflash.attention(*inputs[i], causal=True, return_lse=return_lse)
        return result if return_lse else (result, None)

    call(0)
    held, held_lse = call(0)
    kept = held.copy(), held_lse.copy() if return_lse else None
    dropped, _ = call(1)
    ptr = dropped.data.ptr
    del dropped, _
    again, again_lse = call(2)
    assert again.data.ptr == ptr  # nothing referred to the dropped output any more
    assert bool((held == kept[0]).all()) and (not return_lse or bool((held_lse == kept[1]).all()))
    forward._plans.clear()
    want = cuflash.attention(*inputs[2], causal=True, return_lse=True)
    assert bool((again == want[0]).all()) and (not return_lse or bool((again_lse == want[1]).all()))
