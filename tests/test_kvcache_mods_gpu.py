"""score_mod and mask_mod on cuflash.attention_with_kvcache against the float64 reference: b the
sequence, h the query head, q_idx the query's position after its sequence's keys (bottom-right),
kv_idx the key's; GQA rows of several heads and tokens per tile, contiguous and paged caches,
appends, forced splits, a softcap beside a mask, rows the mask leaves no key (O = 0, LSE = -inf),
a decode step captured in a CUDA graph; and the portable varlen forward, which runs on the same
kernel (positions within each sequence from 0)."""
import numpy as np
import pytest

import cuflash
from cuflash.serving import attention_with_kvcache_reference
from cuflash.testing import assert_attention_close, to_numpy

from test_kvcache_gpu import _make, _to_device

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

HEADS, HEADS_K, HEAD_DIM, CAPACITY, BATCH = 8, 2, 128, 600, 3


def _mods(kind, rng):
    """(score_mod, mask_mod) of a case; the arrays they capture are CuPy arrays."""
    slopes = cupy.asarray(rng.uniform(0.01, 0.3, HEADS).astype(np.float32))
    sink_keys = cupy.asarray(np.array([0, 4, 2, 1], dtype=np.int32))

    def alibi(score, b, h, q_idx, kv_idx):  # BLOOM's bias, by the query's absolute position
        return score - slopes[h] * (q_idx - kv_idx)

    def recent(b, h, q_idx, kv_idx):  # a window of 48 keys, narrower for odd heads
        return q_idx - kv_idx < 48 - 16 * (h % 2)

    def streaming(b, h, q_idx, kv_idx):  # StreamingLLM: the first sink_keys[b] keys and the last 32
        return (kv_idx < sink_keys[b]) | (q_idx - kv_idx < 32)

    def lonely(b, h, q_idx, kv_idx):  # heads 0 and 5 of sequence 1 attend nothing; positions read per row
        return ~((b == 1) & ((h == 0) | (h == 5))) & (kv_idx <= q_idx - (q_idx % 3))

    return {"alibi": (alibi, None), "window": (None, recent), "both": (alibi, streaming),
            "softcap": (None, recent), "empty": (alibi, lonely)}[kind]


def _warm_specs(arch):
    """The specializations of these tests (the mods' digests name them)."""
    from cuflash.core import modset
    from cuflash.core.policy import decode_spec

    specs = []
    for kind, paged, seqlen_q, *_ in CASES + [("both", True, 1), ("window", False, 4)]:
        score_mod, mask_mod = _mods(kind, np.random.default_rng(0))
        mods = modset.prepare(score_mod, mask_mod, 0)
        rows = seqlen_q * HEADS // HEADS_K
        specs.append(decode_spec(HEAD_DIM, "bf16", "bf16", paged, min(rows, 64), arch).replace(
            score_mod=mods.score_digest, mask_mod=mods.mask_digest))
        if kind == "alibi" and not paged:  # an FP8 cache's (test_an_fp8_cache_takes_mods)
            specs.append(decode_spec(HEAD_DIM, "bf16", "e4m3", False, 16, arch).replace(
                score_mod=mods.score_digest, mask_mod=mods.mask_digest))
        if kind == "both":  # the portable varlen forward's
            specs.append(decode_spec(HEAD_DIM, "bf16", "bf16", False, 64, arch, varlen=True).replace(
                score_mod=mods.score_digest, mask_mod=mods.mask_digest))
    return list(dict.fromkeys(specs))


# kind, paged (page size 16), seqlen_q, seqlen_new, num_splits
CASES = [("alibi", False, 1, 0, 1), ("alibi", True, 4, 2, 4), ("window", False, 1, 1, 3), ("window", True, 4, 0, 1),
         ("both", False, 4, 0, 5), ("both", True, 1, 1, 1), ("softcap", False, 4, 1, 3), ("softcap", True, 1, 0, 1),
         ("empty", False, 4, 0, 1), ("empty", True, 4, 1, 6)]


@pytest.fixture(scope="module", autouse=True)
def warm_kvcache_mod_kernels():
    from cuflash.core.compile import device_arch

    cuflash.warmup(_warm_specs(device_arch()), progress=False)


#: The warm fixtures' kernels by fixture name: the session compiles them in its first pool.
WARM = {"warm_kvcache_mod_kernels": _warm_specs}


@pytest.mark.parametrize("kind,paged,seqlen_q,seqlen_new,num_splits", CASES)
def test_mods_against_the_reference(kind, paged, seqlen_q, seqlen_new, num_splits):
    rng = np.random.default_rng(len(kind) * 31 + seqlen_q * 7 + seqlen_new + num_splits)
    lens = np.array([0, 310, 570 - seqlen_new])  # an empty cache, a middling one, a nearly full one
    q, kc, vc, table, new = _make(rng, batch=BATCH, seqlen_q=seqlen_q, heads=HEADS, heads_k=HEADS_K, head_dim=HEAD_DIM,
                                  dtype="bf16", lengths=lens, capacity=CAPACITY, page_size=16 if paged else None,
                                  seqlen_new=seqlen_new)
    score_mod, mask_mod = _mods(kind, rng)
    softcap = 8.0 if kind == "softcap" else 0.0
    dq, dk, dv, dlens, dtable = _to_device(q, kc, vc, lens.astype(np.int32), table)
    dnew = _to_device(*new) if new else (None, None)
    out, lse = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, k_new=dnew[0], v_new=dnew[1],
                                              page_table=dtable, num_splits=num_splits, softcap=softcap,
                                              return_lse=True, score_mod=score_mod, mask_mod=mask_mod)
    ref_kwargs = dict(k_new=None if not new else new[0], v_new=None if not new else new[1], page_table=table,
                      softcap=softcap, score_mod=score_mod, mask_mod=mask_mod)
    ref, ref_lse, k_after, _ = attention_with_kvcache_reference(q, kc, vc, lens, **ref_kwargs)
    naive, naive_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, naive=True, **ref_kwargs)
    assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    assert np.array_equal(to_numpy(dk).view(np.uint16), k_after.view(np.uint16))
    if kind == "empty":  # the rows of heads 0 and 5 of sequence 1: no key, O = 0 and LSE = -inf, never NaN
        lse_host, out_host = to_numpy(lse), to_numpy(out).astype(np.float32)
        assert np.isneginf(lse_host[1, [0, 5]]).all() and not out_host[1, :, [0, 5]].any()
        assert np.isfinite(out_host).all()


def test_an_fp8_cache_takes_mods():
    """e4m3 codes with a per-head descale: the scores the mods see include the descale."""
    rng = np.random.default_rng(11)
    lens = np.array([5, 310, 569])
    q, kc, vc, _, new = _make(rng, batch=BATCH, seqlen_q=4, heads=HEADS, heads_k=HEADS_K, head_dim=HEAD_DIM,
                              dtype="bf16", lengths=lens, capacity=CAPACITY, seqlen_new=1, fp8_format="e4m3")
    score_mod, _ = _mods("alibi", rng)
    k_descale = np.array([0.25, 0.5], dtype=np.float32)
    dq, dk, dv, dlens = _to_device(q, kc, vc, lens.astype(np.int32))
    out, lse = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, k_new=cupy.asarray(new[0]),
                                              v_new=cupy.asarray(new[1]), fp8_format="e4m3", num_splits=3,
                                              k_descale=cupy.asarray(k_descale), v_descale=0.5, return_lse=True,
                                              score_mod=score_mod)
    kwargs = dict(k_new=new[0], v_new=new[1], fp8_format="e4m3", k_descale=k_descale, v_descale=0.5,
                  score_mod=score_mod)
    ref, ref_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, **kwargs)
    naive, naive_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, naive=True, **kwargs)
    assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)


def test_a_softcap_beside_a_score_mod_is_refused():
    rng = np.random.default_rng(1)
    q, kc, vc, _, _ = _make(rng, batch=1, seqlen_q=1, heads=HEADS, heads_k=HEADS_K, head_dim=HEAD_DIM, dtype="bf16",
                            lengths=[5], capacity=64)
    dq, dk, dv = _to_device(q, kc, vc)
    with pytest.raises(ValueError, match="softcap=8.0 and score_mod"):
        cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=5, softcap=8.0, score_mod=_mods("alibi", rng)[0])


def test_a_decode_step_with_mods_captured_in_a_cuda_graph():
    """The captured step reads the mods' arrays as they are at each replay (new slopes, new
    lengths) and never synchronizes."""
    rng = np.random.default_rng(5)
    lens0 = np.array([40, 300, 555])
    q, kc, vc, table, _ = _make(rng, batch=BATCH, seqlen_q=1, heads=HEADS, heads_k=HEADS_K, head_dim=HEAD_DIM,
                                dtype="bf16", lengths=lens0, capacity=CAPACITY, page_size=16)
    dq, dk, dv, dtable = _to_device(q, kc, vc, table)
    dlens = cupy.asarray(lens0.astype(np.int32))
    k_new = cupy.zeros((BATCH, 1, HEADS_K, HEAD_DIM), dtype=dq.dtype)
    v_new = cupy.zeros_like(k_new)
    score_mod, mask_mod = _mods("both", rng)
    slopes = score_mod.__closure__[0].cell_contents
    call = dict(cache_seqlens=dlens, k_new=k_new, v_new=v_new, page_table=dtable, return_lse=True,
                score_mod=score_mod, mask_mod=mask_mod)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        scratch = (dk.copy(), dv.copy())
        cuflash.attention_with_kvcache(dq, *scratch, **call)  # compiled and planned before the capture
        del scratch
        stream.synchronize()
        stream.begin_capture()
        out, lse = cuflash.attention_with_kvcache(dq, dk, dv, **call)
        graph = stream.end_capture()
    lens = lens0.copy()
    for step in range(3):
        kn, vn = (rng.standard_normal(k_new.shape).astype(q.dtype) for _ in range(2))
        k_before, v_before = to_numpy(dk), to_numpy(dv)
        with stream:
            k_new.set(kn)
            v_new.set(vn)
            slopes.set(rng.uniform(0.01, 0.3, HEADS).astype(np.float32))
            dlens.set(lens.astype(np.int32))
            graph.launch(stream)
        stream.synchronize()
        kwargs = dict(k_new=kn, v_new=vn, page_table=table, score_mod=score_mod, mask_mod=mask_mod)
        ref, ref_lse, _, _ = attention_with_kvcache_reference(q, k_before, v_before, lens, **kwargs)
        naive, naive_lse, _, _ = attention_with_kvcache_reference(q, k_before, v_before, lens, naive=True, **kwargs)
        assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
        lens += 1


def test_the_portable_varlen_forward_takes_mods(monkeypatch):
    """attention_varlen off the Hopper kernel (forced here) runs the KV-cache kernel's varlen
    specialization with the mods: b the sequence, q_idx and kv_idx positions within it."""
    from cuflash import reference, varlen
    from cuflash.mods import _rebased
    from test_kvcache_gpu import _np_dtype

    monkeypatch.setattr(varlen, "_hopper", lambda *args, **kwargs: None)
    rng = np.random.default_rng(7)
    lens_q, lens_k = np.array([3, 1, 17, 0]), np.array([40, 1, 100, 5])
    npd = _np_dtype("bf16")
    q = rng.standard_normal((int(lens_q.sum()), HEADS, HEAD_DIM)).astype(npd)
    k, v = (rng.standard_normal((int(lens_k.sum()), HEADS_K, HEAD_DIM)).astype(npd) for _ in range(2))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    score_mod, mask_mod = _mods("both", rng)
    dq, dk, dv, dcu_q, dcu_k = _to_device(q, k, v, cu_q, cu_k)
    out, lse = cuflash.attention_varlen(dq, dk, dv, dcu_q, dcu_k, max_seqlen_q=int(lens_q.max()), causal=True,
                                        return_lse=True, score_mod=score_mod, mask_mod=mask_mod)
    out, lse = to_numpy(out), to_numpy(lse)
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.start == qs.stop:
            continue
        mods = dict(score_mod=_rebased(score_mod, "score", b), mask_mod=_rebased(mask_mod, "mask", b))
        args = (q[qs][None], k[ks][None], v[ks][None])
        ref, ref_lse = reference.attention_reference(*args, causal=True, layout="bshd", **mods)
        naive, naive_lse = reference.attention_naive(*args, causal=True, layout="bshd", **mods)
        assert_attention_close(out[qs][None], ref, "bf16", baseline=naive, lse=lse[:, qs][None], ref_lse=ref_lse,
                               baseline_lse=naive_lse)
