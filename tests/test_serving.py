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


def _direct_kvcache(q, k, v, lens, seqlen_new, slopes, window, softcap=0.0, causal=True):
    """attention_with_kvcache's result written out by hand in float64 for a contiguous cache after
    the append: ALiBi by the query's absolute position, and a window of `window` keys."""
    batch, seqlen_q, heads, d = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape)
    lse = np.full((batch, heads, seqlen_q), -np.inf)
    for b in range(batch):
        n = lens[b] + seqlen_new
        for h in range(heads):
            for i in range(seqlen_q):
                pos = n - seqlen_q + i
                s = k[b, :n, h // group] @ q[b, i, h] / np.sqrt(d)
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                j = np.arange(n)
                if slopes is not None:
                    s = s - slopes[h] * (pos - j) - 0.5 * b
                keep = (pos - j < window) & ((j <= pos) if causal else True)
                if not keep.any():
                    continue
                s = np.where(keep, s, -np.inf)
                lse[b, h, i] = np.log(np.exp(s - s.max()).sum()) + s.max()
                out[b, i, h] = np.exp(s - lse[b, h, i]) @ v[b, :n, h // group]
    return out, lse


@pytest.mark.parametrize("softcap,traced", [(0.0, False), (0.0, True), (3.0, False)])
def test_kvcache_reference_reads_the_mods_at_each_sequences_positions(softcap, traced):
    """b is the sequence and q_idx the query's position after the sequence's keys (the new ones
    included); the mask and-ed with causal; a row left no key gives 0 and -inf. The mods may be
    functions or their traced graphs."""
    from cuflash.serving import attention_with_kvcache_reference

    rng = np.random.default_rng(3)
    batch, capacity, heads, heads_k, d, seqlen_q, seqlen_new = 3, 24, 4, 2, 8, 3, 2
    q = rng.standard_normal((batch, seqlen_q, heads, d))
    k, v = (rng.standard_normal((batch, capacity, heads_k, d)) for _ in range(2))
    kn, vn = (rng.standard_normal((batch, seqlen_new, heads_k, d)) for _ in range(2))
    lens = np.array([7, 0, 19])
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32)
    window = 3

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx) - 0.5 * b

    def recent(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    k_full, v_full = k.copy(), v.copy()
    for b in range(batch):
        k_full[b, lens[b]:lens[b] + seqlen_new], v_full[b, lens[b]:lens[b] + seqlen_new] = kn[b], vn[b]
    score_mod, mask_mod = None if softcap else alibi, recent
    if traced:
        score_mod, mask_mod = cuflash.mods.trace_score_mod(alibi), cuflash.mods.trace_mask_mod(recent)
    out, lse, _, _ = attention_with_kvcache_reference(q, k, v, lens, k_new=kn, v_new=vn, softcap=softcap,
                                                      score_mod=score_mod, mask_mod=mask_mod)
    want, want_lse = _direct_kvcache(q, k_full, v_full, lens, seqlen_new, None if softcap else slopes, window, softcap)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    # sequence 1 holds 2 keys for 3 queries: query 0 sits at position -1 and sees none
    assert np.isneginf(lse[1, :, 0]).all() and not out[1, 0].any()


def test_kvcache_reference_refuses_a_softcap_beside_a_score_mod():
    from cuflash.serving import attention_with_kvcache_reference

    q, k = np.zeros((1, 1, 2, 8)), np.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="softcap=2.0 and score_mod"):
        attention_with_kvcache_reference(q, k, k, np.array([2]), softcap=2.0,
                                         score_mod=lambda s, b, h, q_idx, kv_idx: s)


def test_packed_outputs_merge_as_one_sequence_of_a_batch():
    """Outputs [total_q, heads, head_dim] with LSE [heads, total_q] merge through [None] views
    (layout bshd) into the attention over the union of their keys."""
    q, k, v = _problem(seqlen_k=60, layout="bshd")
    q, k, v = q[0], k[0], v[0]                         # one packed run of 37 queries
    full, full_lse = reference.attention_reference(q[None], k[None], v[None], layout="bshd")
    parts = [reference.attention_reference(q[None], k[None, a:b], v[None, a:b], layout="bshd") for a, b in ((0, 25),
                                                                                                           (25, 60))]
    packed = [(o[0].astype(np.float32), l[0].astype(np.float32)) for o, l in parts]
    out, lse = cuflash.merge_states([o[None] for o, _ in packed], [l[None] for _, l in packed], layout="bshd")
    assert out[0].shape == q.shape and lse[0].shape == (q.shape[1], q.shape[0])
    assert np.allclose(out[0], full[0], atol=1e-5) and np.allclose(lse[0], full_lse[0], atol=1e-5)
