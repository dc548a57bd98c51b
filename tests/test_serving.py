"""cuflash.merge_states on NumPy arrays: attention over a union of key sets from its parts."""
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import reference

RNG = np.random.default_rng(0)


def _problem(seqlen_k=90, causal=False, layout="bhsd"):
    q = RNG.standard_normal((2, 4, 37, 16))
    k, v = (RNG.standard_normal((2, 2, seqlen_k, 16)) for _ in range(2))
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3).copy() for x in (q, k, v))
    return q, k, v


def _split(x, bounds, layout):
    axis = 2 if layout == "bhsd" else 1
    return [np.take(x, np.arange(a, b), axis=axis) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("bounds", [(0, 40, 90), (0, 10, 10, 60, 90), (0, 0, 90)])
def test_merged_parts_are_the_attention_over_their_union(layout, bounds):
    q, k, v = _problem(layout=layout)
    want, want_lse = reference.attention_reference(q, k, v, layout=layout)
    parts = [reference.attention_reference(q, kp, vp, layout=layout) for kp, vp in
             zip(_split(k, bounds, layout), _split(v, bounds, layout))]
    outs = [o.astype(np.float32) for o, _ in parts]
    lses = [lse.astype(np.float32) for _, lse in parts]
    out, lse = cuflash.merge_states(outs, lses, layout=layout)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert np.abs(out - want).max() < 1e-5 and np.abs(lse - want_lse).max() < 1e-5


def test_bfloat16_outputs_and_rows_no_part_attends():
    q, k, v = _problem(seqlen_k=30)
    # causal with seqlen_q > seqlen_k: the first rows attend nothing in either part
    first = reference.attention_reference(q, k[:, :, :20], v[:, :, :20], causal=True)
    second_out = np.zeros_like(first[0])
    second_lse = np.full_like(first[1], -np.inf)
    outs = [first[0].astype(ml_dtypes.bfloat16), second_out.astype(ml_dtypes.bfloat16)]
    out, lse = cuflash.merge_states(outs, [first[1].astype(np.float32), second_lse.astype(np.float32)])
    assert out.dtype == ml_dtypes.bfloat16
    empty = first[1] == -np.inf
    assert empty.any() and np.all(lse[empty] == -np.inf) and np.all(out.astype(np.float32)[empty] == 0)
    assert not np.isnan(out.astype(np.float32)).any()
    assert np.abs(out.astype(np.float32) - first[0]).max() < 1e-2


def test_a_nan_stays_in_its_row():
    outs = [RNG.standard_normal((1, 1, 4, 8)).astype(np.float32) for _ in range(2)]
    lses = [RNG.standard_normal((1, 1, 4)).astype(np.float32) for _ in range(2)]
    outs[0][0, 0, 1, 3] = np.nan
    lses[1][0, 0, 2] = np.nan
    out, lse = cuflash.merge_states(outs, lses)
    assert np.isnan(out[0, 0, 1, 3]) and np.isfinite(np.delete(out[0, 0, 1], 3)).all()
    assert np.isnan(out[0, 0, 2]).all() and np.isnan(lse[0, 0, 2])
    assert np.isfinite(out[0, 0, [0, 3]]).all() and np.isfinite(lse[0, 0, [0, 1, 3]]).all()


def test_bad_inputs_are_named():
    out = np.zeros((1, 2, 3, 8), np.float32)
    lse = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match="two or more"):
        cuflash.merge_states([out], [lse])
    with pytest.raises(ValueError, match=r"lses\[1\] must be float32 \(1, 2, 3\)"):
        cuflash.merge_states([out, out], [lse, lse.astype(np.float64)])
    with pytest.raises(ValueError, match=r"outs\[1\] is float32 \(1, 2, 3, 4\)"):
        cuflash.merge_states([out, out[..., :4]], [lse, lse])
    with pytest.raises(ValueError, match="layout='sbhd'"):
        cuflash.merge_states([out, out], [lse, lse], layout="sbhd")
    with pytest.raises(TypeError, match="sequences"):
        cuflash.merge_states(out, lse)
    with pytest.raises(TypeError, match="float64"):
        cuflash.merge_states([out.astype(np.float64)] * 2, [lse, lse])
