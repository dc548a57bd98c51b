"""cuflash.attention_with_kvcache on the GPU against the float64 reference: decode and a few query
tokens, GQA, contiguous and paged caches (shuffled pages), appends, forced splits, FP8 caches,
lengths and page ids the kernels must refuse, and a decode loop captured in a CUDA graph."""
import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
from cuflash.serving import attention_with_kvcache_reference
from cuflash.testing import assert_attention_close, kvcache_problems, to_numpy

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_kvcache_kernels")]

def _np_dtype(tag):
    if tag == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def _make(rng, *, batch, seqlen_q, heads, heads_k, head_dim, dtype, lengths, capacity, page_size=None,
          seqlen_new=0, fp8_format=None):
    """Device arrays of one problem: caches whose slots past each length (and unused pages) hold
    NaN (or FP8 NaN codes), so a kernel reading past a length shows it."""
    npd = _np_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(npd)
    if page_size is None:
        shape, table = (batch, capacity, heads_k, head_dim), None
    else:
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq + 3
        table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
        shape = (num_pages, page_size, heads_k, head_dim)
    if fp8_format is None:
        kc = np.full(shape, np.nan, dtype=np.float32).astype(npd)
        vc = kc.copy()
        fill = lambda n: rng.standard_normal((n, heads_k, head_dim)).astype(npd)  # noqa: E731
    else:
        kc = np.full(shape, 0x7F, dtype=np.uint8)  # e4m3 NaN (e5m2: a NaN too)
        vc = kc.copy()
        import ml_dtypes
        fp8 = ml_dtypes.float8_e4m3fn if fp8_format == "e4m3" else ml_dtypes.float8_e5m2
        fill = lambda n: (4 * rng.standard_normal((n, heads_k, head_dim))).astype(fp8).view(np.uint8)  # noqa: E731
    for b, n in enumerate(lengths):
        n = max(0, min(int(n), capacity))
        keys = np.arange(n)
        if table is None:
            kc[b, :n], vc[b, :n] = fill(n), fill(n)
        else:
            kc[table[b, keys // page_size], keys % page_size] = fill(n)
            vc[table[b, keys // page_size], keys % page_size] = fill(n)
    new = None
    if seqlen_new:
        new = tuple(fill(batch * seqlen_new).reshape(batch, seqlen_new, heads_k, head_dim) for _ in range(2))
    return q, kc, vc, table, new


def _to_device(*xs):
    return tuple(None if x is None else cupy.asarray(x) for x in xs)


def _check(q, kc, vc, lens, table, new, *, dtype, causal=True, num_splits=None, fp8_format=None, descales=(None, None),
           window_size=(-1, -1), softcap=0.0, sinks=None, rotary=None):
    dq, dk, dv, dlens, dtable = _to_device(q, kc, vc, np.asarray(lens, dtype=np.int32), table)
    tables = {} if rotary is None else dict(rotary_cos=rotary[0], rotary_sin=rotary[1], rotary_interleaved=rotary[2])
    dnew = _to_device(*new) if new else (None, None)
    kwargs = dict(page_table=dtable, causal=causal, fp8_format=fp8_format, window_size=window_size, softcap=softcap)
    out, lse = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, k_new=dnew[0], v_new=dnew[1],
                                              num_splits=num_splits, return_lse=True, k_descale=descales[0],
                                              v_descale=descales[1], sinks=None if sinks is None else cupy.asarray(sinks),
                                              **kwargs, **{k: cupy.asarray(v) if k != "rotary_interleaved" else v
                                                           for k, v in tables.items()})
    ref_kwargs = dict(k_new=None if not new else new[0], v_new=None if not new else new[1], page_table=table,
                      causal=causal, fp8_format=fp8_format, k_descale=descales[0], v_descale=descales[1],
                      window_size=window_size, softcap=softcap, sinks=sinks, **tables)
    ref, ref_lse, k_after, v_after = attention_with_kvcache_reference(q, kc, vc, lens, **ref_kwargs)
    naive, naive_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, naive=True, **ref_kwargs)
    assert out.dtype == dq.dtype and out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_attention_close(out, ref, dtype, baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    bits = np.uint8 if fp8_format else np.uint16
    assert np.array_equal(to_numpy(dk).view(bits), k_after.view(bits))
    assert np.array_equal(to_numpy(dv).view(bits), v_after.view(bits))
    return to_numpy(out), to_numpy(lse)


# every head dim with every query count and head layout (GQA 4:1, 4:1, MQA, none), the dtypes
# taken in turn so that each head dim and each layout runs in both
DECODE_CASES = [(("bf16", "fp16")[(i + j) % 2], head_dim, *layout) for i, head_dim in enumerate((64, 72, 128, 256))
                for j, layout in enumerate(((1, 32, 8), (4, 8, 2), (16, 8, 1), (3, 4, 4)))]


@pytest.mark.parametrize("dtype,head_dim,seqlen_q,heads,heads_k", DECODE_CASES)
def test_decode_contiguous(dtype, head_dim, seqlen_q, heads, heads_k):
    rng = np.random.default_rng(head_dim * 100 + seqlen_q + heads)
    lens = rng.integers(0, 700, size=3)
    lens[0] = 0
    q, kc, vc, table, new = _make(rng, batch=3, seqlen_q=seqlen_q, heads=heads, heads_k=heads_k, head_dim=head_dim,
                                  dtype=dtype, lengths=lens, capacity=720)
    _check(q, kc, vc, lens, table, new, dtype=dtype)


@pytest.mark.parametrize("page_size", [None, 16, 48])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q,seqlen_new,num_splits", [(16, 0, None), (10, 3, 3)])
def test_tiles_of_64_rows(page_size, head_dim, seqlen_q, seqlen_new, num_splits):
    """Row tiles of 64 query rows, whole and part-filled (on Hopper one warpgroup's wgmma products
    over swizzled stages), contiguous and paged, with appends and forced splits."""
    rng = np.random.default_rng(head_dim + seqlen_q + (page_size or 0))
    lens = rng.integers(1, 900, size=3)
    q, kc, vc, table, new = _make(rng, batch=3, seqlen_q=seqlen_q, heads=16, heads_k=4, head_dim=head_dim,
                                  dtype="bf16", lengths=lens, capacity=960, page_size=page_size,
                                  seqlen_new=seqlen_new)
    _check(q, kc, vc, lens, table, new, dtype="bf16", num_splits=num_splits)


@pytest.mark.parametrize("page_size", [1, 16, 256, 48])
@pytest.mark.parametrize("seqlen_new", [0, 1, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_with_appends(page_size, seqlen_new, causal):
    rng = np.random.default_rng(page_size * 10 + seqlen_new)
    lens = rng.integers(0, 900, size=4)
    q, kc, vc, table, new = _make(rng, batch=4, seqlen_q=max(seqlen_new, 1), heads=16, heads_k=4, head_dim=128,
                                  dtype="bf16", lengths=lens, capacity=1024, page_size=page_size,
                                  seqlen_new=seqlen_new)
    _check(q, kc, vc, lens, table, new, dtype="bf16", causal=causal)


@pytest.mark.parametrize("paged", [False, True])
def test_forced_splits_agree_with_one(paged):
    rng = np.random.default_rng(7)
    lens = np.array([3000, 17, 1, 2500])
    q, kc, vc, table, new = _make(rng, batch=4, seqlen_q=2, heads=8, heads_k=2, head_dim=128, dtype="bf16",
                                  lengths=lens, capacity=3072, page_size=64 if paged else None)
    one, one_lse = _check(q, kc, vc, lens, table, new, dtype="bf16", num_splits=1)
    for splits in (3, 16, 128):
        many, many_lse = _check(q, kc, vc, lens, table, new, dtype="bf16", num_splits=splits)
        assert np.abs(many.astype(np.float32) - one.astype(np.float32)).max() < 2e-2
        assert np.array_equal(np.isfinite(many_lse), np.isfinite(one_lse))
        finite = np.isfinite(one_lse)
        assert np.all(many_lse[~finite] == one_lse[~finite]) and np.abs(many_lse - one_lse)[finite].max() < 1e-3


@pytest.mark.parametrize("paged", [False, True])
def test_the_merge_kernel_agrees_with_the_last_split(paged, monkeypatch):
    from cuflash import kvcache
    from cuflash.core import policy
    rng = np.random.default_rng(11)
    lens = np.array([4000, 0, 333])
    q, kc, vc, table, new = _make(rng, batch=3, seqlen_q=9, heads=16, heads_k=2, head_dim=128, dtype="bf16",
                                  lengths=lens, capacity=4096, page_size=16 if paged else None, seqlen_new=1)
    results = []
    for apart in (1 << 40, 0):  # never, always
        monkeypatch.setattr(policy, "DECODE_MERGE_APART_BYTES", apart)
        monkeypatch.setattr(kvcache, "_plans", {})
        results.append(_check(q, kc, vc, lens, table, new, dtype="bf16", num_splits=17))
    (one, one_lse), (two, two_lse) = results
    assert np.array_equal(one.view(np.uint16), two.view(np.uint16))
    assert np.array_equal(one_lse, two_lse, equal_nan=True)


@pytest.mark.parametrize("window_size,causal", [((64, -1), True), ((0, -1), True), ((300, 0), True),
                                                ((100, 20), False), ((-1, 7), False)])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("num_splits", [None, 5])
def test_sliding_window_and_softcap(window_size, causal, softcap, num_splits):
    rng = np.random.default_rng(window_size[0] + 13)
    lens = np.array([0, 1, 90, 700, 1500])
    q, kc, vc, table, new = _make(rng, batch=5, seqlen_q=5, heads=8, heads_k=2, head_dim=128, dtype="bf16",
                                  lengths=lens, capacity=1536, page_size=16, seqlen_new=2)
    q = (q.astype(np.float32) * 8).astype(q.dtype)  # large scores, where the cap bites
    _check(q, kc, vc, lens, table, new, dtype="bf16", causal=causal, num_splits=num_splits, window_size=window_size,
           softcap=softcap)


@pytest.mark.parametrize("page_size,seqlen_q,fp8_format", [(None, 1, None), (16, 4, None), (None, 16, None),
                                                            (16, 1, "e4m3")])
@pytest.mark.parametrize("num_splits", [1, 5, None])
def test_attention_sinks(page_size, seqlen_q, fp8_format, num_splits):
    """A sink logit per query head in each row's sum, on one split and merged over several, with a
    sliding window (gpt-oss decode); empty sequences give O = 0 and LSE = the sink."""
    rng = np.random.default_rng(seqlen_q + (page_size or 0))
    lens = np.array([0, 1, 300, 1200])
    q, kc, vc, table, new = _make(rng, batch=4, seqlen_q=seqlen_q, heads=16, heads_k=4, head_dim=64, dtype="bf16",
                                  lengths=lens, capacity=1280, page_size=page_size, seqlen_new=1,
                                  fp8_format=fp8_format)
    sinks = rng.normal(1.0, 2.0, 16).astype(np.float32)
    out, lse = _check(q, kc, vc, lens, table, new, dtype="bf16", num_splits=num_splits, fp8_format=fp8_format,
                      sinks=sinks, window_size=(128, -1) if seqlen_q == 4 else (-1, -1))
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("fp8_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_caches(fp8_format, dtype, per_head):
    rng = np.random.default_rng(11)
    lens = rng.integers(1, 1500, size=3)
    q, kc, vc, table, new = _make(rng, batch=3, seqlen_q=1, heads=16, heads_k=4, head_dim=128, dtype=dtype,
                                  lengths=lens, capacity=1600, page_size=16, seqlen_new=1, fp8_format=fp8_format)
    if per_head:
        descales = (cupy.asarray(rng.uniform(0.5, 2, 4).astype(np.float32)),
                    cupy.asarray(rng.uniform(0.5, 2, 4).astype(np.float32)))
    else:
        descales = (0.75, 1.5)
    _check(q, kc, vc, lens, table, new, dtype=dtype, fp8_format=fp8_format, descales=descales)


@pytest.mark.parametrize("fp8_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("seqlen_q, num_splits", [(1, 3), (5, None), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_contiguous_caches_with_more_rows_and_splits(fp8_format, seqlen_q, num_splits, head_dim):
    rng = np.random.default_rng(seqlen_q * 10 + head_dim)
    lens = rng.integers(seqlen_q, 900, size=3)
    q, kc, vc, table, _ = _make(rng, batch=3, seqlen_q=seqlen_q, heads=8, heads_k=2, head_dim=head_dim, dtype="bf16",
                                lengths=lens, capacity=1000, fp8_format=fp8_format)
    _check(q, kc, vc, lens, table, None, dtype="bf16", fp8_format=fp8_format, num_splits=num_splits,
           window_size=(200, -1) if seqlen_q == 5 else (-1, -1))


def test_rows_with_no_key_and_more_queries_than_keys():
    rng = np.random.default_rng(3)
    lens = np.array([0, 2, 9])
    q, kc, vc, table, new = _make(rng, batch=3, seqlen_q=6, heads=4, heads_k=2, head_dim=64, dtype="bf16",
                                  lengths=lens, capacity=64)
    out, lse = _check(q, kc, vc, lens, table, new, dtype="bf16", causal=True)
    assert np.all(out[0].astype(np.float32) == 0) and np.all(lse[0] == -np.inf)
    assert np.all(lse[1][:, :4] == -np.inf) and np.isfinite(lse[1][:, 4:]).all()


def test_bad_lengths_and_page_ids_give_nan_rows_only_there():
    rng = np.random.default_rng(5)
    lens = np.array([100, -1, 300, 5000])
    q, kc, vc, table, _ = _make(rng, batch=4, seqlen_q=1, heads=8, heads_k=2, head_dim=128, dtype="bf16",
                                lengths=np.clip(lens, 0, 512), capacity=512, page_size=16)
    table = table.copy()
    table[2, 3] = -7          # a page id outside the cache, inside sequence 2's 300 keys
    table[0, 20] = 10 ** 6    # outside the cache too, but past sequence 0's length: never read
    dq, dk, dv, dlens, dtable = _to_device(q, kc, vc, lens.astype(np.int32), table)
    for splits in (1, 4):
        out, lse = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, page_table=dtable,
                                                  num_splits=splits, return_lse=True)
        out, lse = to_numpy(out).astype(np.float32), to_numpy(lse)
        assert np.isnan(out[1:]).all() and np.isnan(lse[1:]).all()
        assert np.isfinite(out[0]).all() and np.isfinite(lse[0]).all()


def test_invalid_host_inputs_are_named():
    q = cupy.zeros((2, 1, 8, 64), dtype=cupy.float16)
    kc = cupy.zeros((2, 128, 2, 64), dtype=cupy.float16)
    lens = cupy.zeros(2, dtype=cupy.int32)
    call = cuflash.attention_with_kvcache
    with pytest.raises(TypeError, match="k_cache .* must have q's dtype"):
        call(q, kc.astype(cupy.float32), kc, cache_seqlens=lens)
    with pytest.raises(ValueError, match="multiple of heads_k"):
        call(q, kc[:, :, :1].repeat(3, axis=2), kc[:, :, :1].repeat(3, axis=2), cache_seqlens=lens)
    with pytest.raises(ValueError, match="cache_seqlens must be int32 \\[batch=2\\]"):
        call(q, kc, kc, cache_seqlens=cupy.zeros(3, dtype=cupy.int32))
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        call(q, kc, kc, cache_seqlens=cupy.zeros(2, dtype=cupy.int64))
    with pytest.raises(ValueError, match="page_table must be int32 \\[batch=2"):
        call(q, kc, kc, cache_seqlens=lens, page_table=cupy.zeros((3, 4), dtype=cupy.int32))
    with pytest.raises(ValueError, match="k_new must be"):
        call(q, kc, kc, cache_seqlens=lens, k_new=cupy.zeros((2, 1, 8, 64), dtype=cupy.float16),
             v_new=cupy.zeros((2, 1, 8, 64), dtype=cupy.float16))
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        call(q[..., :32], kc[..., 1:33], kc[..., 1:33], cache_seqlens=lens)
    huge = cupy.lib.stride_tricks.as_strided(kc, shape=(2, 16, 2, 64), strides=(2**31, 256, 128, 2))
    with pytest.raises(ValueError, match="k_cache .* has pages of 2 GiB or more"):
        call(q, huge, huge, cache_seqlens=lens, page_table=cupy.zeros((2, 4), dtype=cupy.int32))
    with pytest.raises(ValueError, match="cache_seqlens=129 is outside"):
        call(q, kc, kc, cache_seqlens=129)
    with pytest.raises(ValueError, match="num_splits=0"):
        call(q, kc, kc, cache_seqlens=lens, num_splits=0)
    with pytest.raises(ValueError, match="FP8 caches only"):
        call(q, kc, kc, cache_seqlens=lens, k_descale=2.0)
    with pytest.raises(ValueError, match="right must be 0 or -1"):
        call(q, kc, kc, cache_seqlens=lens, window_size=(10, 3))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        call(q, kc, kc, cache_seqlens=lens, window_size=10)
    with pytest.raises(ValueError, match="softcap=-1"):
        call(q, kc, kc, cache_seqlens=lens, softcap=-1)


@pytest.mark.parametrize("page_size,seqlen_q,seqlen_new,causal,interleaved,rotary_dim,dtype", [
    (None, 1, 1, True, False, 128, "bf16"), (None, 1, 1, True, True, 64, "fp16"), (16, 4, 4, True, False, 128, "bf16"),
    (256, 3, 5, False, True, 32, "bf16"), (None, 2, 2, False, False, 128, "fp16")])
def test_rotary_embeddings_of_queries_and_new_keys(page_size, seqlen_q, seqlen_new, causal, interleaved, rotary_dim,
                                                   dtype):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_new + rotary_dim)
    lens = rng.integers(0, 500, size=3)
    q, kc, vc, table, new = _make(rng, batch=3, seqlen_q=seqlen_q, heads=8, heads_k=2, head_dim=128, dtype=dtype,
                                  lengths=lens, capacity=512, page_size=page_size, seqlen_new=seqlen_new)
    capacity = 512 if page_size is None else table.shape[1] * page_size
    angles = np.arange(capacity)[:, None] / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)[None, :]
    tables = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), interleaved)
    rotated, _ = _check(q, kc, vc, lens, table, new, dtype=dtype, causal=causal, rotary=tables)
    plain, _ = _check(q, kc, vc, lens, table, new, dtype=dtype, causal=causal)
    assert not np.allclose(rotated, plain)  # the tables were applied


@pytest.mark.parametrize("dtype,table_dtype,interleaved,rotary_dim,per_token", [
    ("float16", "float32", False, 64, True), ("bfloat16", "bfloat16", True, 128, True),
    ("bfloat16", "float16", False, 32, False), ("float16", "bfloat16", True, 16, True)])
def test_the_rotation_kernel_is_the_rotation_in_float32(dtype, table_dtype, interleaved, rotary_dim, per_token):
    """The one-kernel rotation of a strided view against rotate() in NumPy, bit for bit (each
    product and sum rounded to float32 on its own), positions past the table clamped."""
    from cuflash.core import rotary

    np_dtype = np.dtype(dtype) if dtype == "float16" else _bf16()
    table_np = np.dtype(table_dtype) if table_dtype != "bfloat16" else _bf16()
    rng = np.random.default_rng(rotary_dim)
    x = rng.standard_normal((3, 5, 4, 96 + 32)).astype(np_dtype)
    angles = rng.uniform(-3, 3, size=(40, rotary_dim // 2))
    cos, sin = np.cos(angles).astype(table_np), np.sin(angles).astype(table_np)
    lens = np.array([0, 17, 38], np.int32)  # the last runs past the table's 40 positions
    wide = cupy.asarray(np.stack([x, x], axis=3).reshape(3, 5, 8, 128))[:, :, ::2]  # a strided view of x
    got = rotary.rotate_on_device(cupy, wide, cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(lens), -2,
                                  per_token, interleaved)
    pos = rotary.positions(np, lens, 3, 5, -2, per_token)
    want = rotary.rotate(np, x, cos, sin, pos, interleaved, np.float32)
    assert got.flags.c_contiguous and got.dtype == np_dtype
    assert np.array_equal(to_numpy(got).view(np.uint16), want.view(np.uint16))  # NumPy's float32 rotation


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("seqlen_q,seqlen_new,num_splits,rotary", [(1, 1, None, False), (4, 4, 3, True),
                                                                     (2, 0, 1, False)])
def test_left_padded_caches(seqlen_q, seqlen_new, num_splits, rotary):
    """cache_leftpad: each sequence attends rows pad .. length (plus its new keys) with positions
    from pad: the reference's, and the padding rows (NaN here) are never read; a pad past the
    length gives NaN rows."""
    rng = np.random.default_rng(seqlen_q + seqlen_new)
    lens, pads = np.array([40, 300, 7, 500]), np.array([5, 0, 7, 120])
    q, kc, vc, _, new = _make(rng, batch=4, seqlen_q=seqlen_q, heads=8, heads_k=2, head_dim=128, dtype="bf16",
                              lengths=lens, capacity=512, seqlen_new=seqlen_new)
    for b, pad in enumerate(pads):
        kc[b, :pad], vc[b, :pad] = np.nan, np.nan  # padding rows: never read
    pads[2] = 9  # past its length 7: NaN rows
    kwargs = dict(k_new=None if new is None else new[0], v_new=None if new is None else new[1], window_size=(100, 0))
    if rotary:
        angles = np.arange(512)[:, None] / 10000.0 ** (np.arange(0, 64, 2) / 64)[None, :]
        kwargs.update(rotary_cos=np.cos(angles).astype(np.float32), rotary_sin=np.sin(angles).astype(np.float32))
    dq, dk, dv, dlens, dpads = _to_device(q, kc, vc, lens.astype(np.int32), pads.astype(np.int32))
    out, lse = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, cache_leftpad=dpads, return_lse=True,
                                              num_splits=num_splits,
                                              **{key: x if x is None or key == "window_size" else cupy.asarray(x)
                                                 for key, x in kwargs.items()})
    ref, ref_lse, k_after, _ = attention_with_kvcache_reference(q, kc, vc, lens, cache_leftpad=pads, **kwargs)
    naive, naive_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, cache_leftpad=pads, naive=True,
                                                              **kwargs)
    assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    assert np.isnan(to_numpy(out)[2]).all() and np.isfinite(to_numpy(out)[[0, 1, 3]]).all()
    assert np.array_equal(to_numpy(dk).view(np.uint16), k_after.view(np.uint16))  # a bad pad: no new keys


def test_cache_batch_idx_picks_each_sequences_cache_row():
    rng = np.random.default_rng(11)
    lens5 = rng.integers(1, 300, size=5)
    _, kc, vc, _, _ = _make(rng, batch=5, seqlen_q=1, heads=8, heads_k=2, head_dim=128, dtype="bf16", lengths=lens5,
                            capacity=320)
    rows = np.array([4, 0, 2], np.int32)
    q, _, _, _, new = _make(rng, batch=3, seqlen_q=2, heads=8, heads_k=2, head_dim=128, dtype="bf16",
                            lengths=[1, 1, 1], capacity=320, seqlen_new=2)
    lens = lens5[rows]
    dq, dk, dv, dlens, drows, dkn, dvn = _to_device(q, kc, vc, lens.astype(np.int32), rows, *new)
    out, lse = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, k_new=dkn, v_new=dvn,
                                              cache_batch_idx=drows, return_lse=True)
    ref, ref_lse, k_after, _ = attention_with_kvcache_reference(q, kc, vc, lens, k_new=new[0], v_new=new[1],
                                                                cache_batch_idx=rows)
    naive, naive_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, k_new=new[0], v_new=new[1],
                                                              cache_batch_idx=rows, naive=True)
    assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    assert np.array_equal(to_numpy(dk).view(np.uint16), k_after.view(np.uint16))


def test_empty_queries_and_empty_caches():
    q = cupy.asarray(np.random.default_rng(0).standard_normal((2, 1, 8, 64)), dtype=cupy.float16)
    kc = cupy.ones((2, 128, 2, 64), dtype=cupy.float16)
    lens = cupy.zeros(2, dtype=cupy.int32)
    call = cuflash.attention_with_kvcache
    for empty in (q[:, :0], q[:, :, :0]):  # no query rows: empty outputs, nothing launched
        out, lse = call(empty, kc, kc, cache_seqlens=lens, return_lse=True)
        assert out.shape == empty.shape and lse.shape == (2, empty.shape[2], empty.shape[1])
    out = call(q[:0], kc[:0], kc[:0], cache_seqlens=cupy.zeros(0, dtype=cupy.int32))
    assert out.shape == (0, 1, 8, 64)
    with pytest.raises(ValueError, match="no query rows: k_new and v_new"):
        call(q[:, :0], kc, kc, cache_seqlens=lens, k_new=kc[:, :1], v_new=kc[:, :1])
    with pytest.raises(ValueError, match=r"\(2, 0, 2, 64\) are empty"):
        call(q, kc[:, :0], kc[:, :0], cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"page_table \(2, 0\) holds no pages"):
        call(q, kc, kc, cache_seqlens=lens, page_table=cupy.zeros((2, 0), dtype=cupy.int32))
    assert cupy.isfinite(call(q, kc, kc, cache_seqlens=lens)).all()  # still usable


def test_a_decode_loop_captured_in_a_cuda_graph():
    """One captured step (append one token, attend) replayed with new tokens and lengths that the
    host moves forward on the device between replays."""
    rng = np.random.default_rng(9)
    batch, heads, heads_k, head_dim, capacity = 4, 16, 4, 128, 2048
    lens0 = rng.integers(100, 1500, size=batch)
    q, kc, vc, table, _ = _make(rng, batch=batch, seqlen_q=1, heads=heads, heads_k=heads_k, head_dim=head_dim,
                                dtype="bf16", lengths=lens0, capacity=capacity, page_size=16)
    dq, dk, dv, dtable = _to_device(q, kc, vc, table)
    dlens = cupy.asarray(lens0.astype(np.int32))
    k_new = cupy.zeros((batch, 1, heads_k, head_dim), dtype=dq.dtype)
    v_new = cupy.zeros_like(k_new)
    stream = cupy.cuda.Stream(non_blocking=True)
    call = dict(cache_seqlens=dlens, k_new=k_new, v_new=v_new, page_table=dtable, return_lse=True)
    with stream:
        scratch = (dk.copy(), dv.copy())
        out, lse = cuflash.attention_with_kvcache(dq, *scratch, **{**call, "k_new": None, "v_new": None})
        del out, lse, scratch
        stream.synchronize()
        stream.begin_capture()
        out, lse = cuflash.attention_with_kvcache(dq, dk, dv, **call)
        graph = stream.end_capture()
    lens = lens0.copy()
    for step in range(4):
        kn = rng.standard_normal(k_new.shape).astype(q.dtype)
        vn = rng.standard_normal(k_new.shape).astype(q.dtype)
        qn = rng.standard_normal(q.shape).astype(q.dtype)
        k_before, v_before = to_numpy(dk), to_numpy(dv)
        with stream:
            k_new.set(kn)
            v_new.set(vn)
            dq.set(qn)
            dlens.set(lens.astype(np.int32))
            graph.launch(stream)
        stream.synchronize()
        ref, ref_lse, k_after, v_after = attention_with_kvcache_reference(
            qn, k_before, v_before, lens, k_new=kn, v_new=vn, page_table=table)
        naive, naive_lse, _, _ = attention_with_kvcache_reference(
            qn, k_before, v_before, lens, k_new=kn, v_new=vn, page_table=table, naive=True)
        assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
        assert np.array_equal(to_numpy(dk).view(np.uint16), k_after.view(np.uint16)), step
        lens += 1


def test_bad_device_values_under_memcheck():
    """Negative and overlong lengths, page ids outside the cache and bad varlen offsets (with an
    append and forced splits) under compute-sanitizer: no kernel reads or writes outside its arrays."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer is not installed")
    script = Path(__file__).with_name("data") / "kvcache_bad_values.py"
    root = Path(__file__).resolve().parent.parent
    env = dict(__import__("os").environ, PYTHONPATH=str(root))
    run = subprocess.run([tool, "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "3",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in run.stdout + run.stderr
    assert "varlen nan rows 20" in run.stdout and "done" in run.stdout


def test_the_device_reports_its_memory_bandwidth():
    """The split policy reads the memory's bandwidth (FP8 caches fill two blocks per SM on fast
    memories) from the runtime's clock and bus width."""
    from cuflash.core.launch import _ATTR_MEMORY_BUS_WIDTH, _device_attribute, _memory_bandwidth_gbs
    device = cupy.cuda.runtime.getDevice()
    assert _device_attribute(_ATTR_MEMORY_BUS_WIDTH, device) >= 1024 and _memory_bandwidth_gbs(device) >= 500


def _packed_case(rng, *, counts, lens, heads, heads_k, head_dim, dtype, capacity, page_size, extra_rows=2):
    """Packed queries (counts per sequence, then extra_rows that no sequence covers) over a cache
    of the given lengths, which count the queries' own keys."""
    _, kc, vc, table, _ = _make(rng, batch=len(counts), seqlen_q=1, heads=heads, heads_k=heads_k, head_dim=head_dim,
                                dtype=dtype, lengths=lens, capacity=capacity, page_size=page_size)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    q = rng.standard_normal((int(offsets[-1]) + extra_rows, heads, head_dim)).astype(_np_dtype(dtype))
    return q, kc, vc, table, offsets


@pytest.mark.parametrize("dtype,head_dim,page_size,causal,heads,heads_k,mods", [
    ("bf16", 128, 16, True, 8, 2, False), ("fp16", 64, None, True, 8, 8, False), ("bf16", 128, None, False, 8, 1, True),
    ("fp16", 128, 256, True, 16, 2, True), ("bf16", 256, 1, True, 4, 2, False)])
def test_packed_queries_over_a_cache(dtype, head_dim, page_size, causal, heads, heads_k, mods):
    """Decode and prefill sequences in one packed batch (cu_seqlens_q): one with no query, one
    with fewer keys than queries (its first rows see no key: O = 0, LSE = -inf), rows past the
    last sequence left NaN."""
    rng = np.random.default_rng(head_dim + heads + (page_size or 0))
    counts, lens = [1, 0, 7, 3, 17], [300, 5, 5, 700, 40]
    q, kc, vc, table, offsets = _packed_case(rng, counts=counts, lens=lens, heads=heads, heads_k=heads_k,
                                             head_dim=head_dim, dtype=dtype, capacity=720, page_size=page_size)
    kwargs = dict(page_table=table, causal=causal)
    if mods:
        slopes = rng.uniform(0.01, 0.1, heads).astype(np.float32)
        dslopes = cupy.asarray(slopes)
        kwargs["sinks"] = rng.standard_normal(heads).astype(np.float32)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - dslopes[h] * (q_idx - kv_idx)

        def recent(b, h, q_idx, kv_idx):
            return q_idx - kv_idx < 200 + 50 * b
    dq, dk, dv, dlens, doffsets = _to_device(q, kc, vc, np.asarray(lens, np.int32), offsets)
    device_kwargs = dict(kwargs, page_table=None if table is None else cupy.asarray(table),
                         sinks=None if not mods else cupy.asarray(kwargs["sinks"]))
    mod_kwargs = dict(score_mod=alibi, mask_mod=recent) if mods else {}
    # unsplit (max_seqlen_q given, then read from the offsets), split and merged by the last split
    # to finish, split and merged by the merge kernel
    for max_seqlen_q, num_splits in ((17, None), (None, None), (17, 3), (17, 64)):
        out, lse = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, cu_seqlens_q=doffsets,
                                                  max_seqlen_q=max_seqlen_q, return_lse=True, num_splits=num_splits,
                                                  **device_kwargs, **mod_kwargs)
        assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
        ref, ref_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, cu_seqlens_q=offsets, **kwargs,
                                                              **mod_kwargs)
        naive, naive_lse, _, _ = attention_with_kvcache_reference(q, kc, vc, lens, cu_seqlens_q=offsets, naive=True,
                                                                  **kwargs, **mod_kwargs)
        assert_attention_close(out, ref, dtype, baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
        assert np.isnan(to_numpy(out)[-2:]).all() and np.isnan(to_numpy(lse)[:, -2:]).all()
        if causal and not mods:
            first = to_numpy(lse)[:, offsets[2]:offsets[2] + 2]  # 7 queries, 5 keys: two rows see none
            assert (first == -np.inf).all() and (to_numpy(out)[offsets[2]:offsets[2] + 2] == 0).all()
    # a grid too small for the longest sequence: its rows NaN, the others as before
    for num_splits in (None, 3):
        short = cuflash.attention_with_kvcache(dq, dk, dv, cache_seqlens=dlens, cu_seqlens_q=doffsets, max_seqlen_q=7,
                                               num_splits=num_splits, **device_kwargs, **mod_kwargs)
        assert np.isnan(to_numpy(short)[offsets[4]:offsets[5]]).all() and np.isnan(to_numpy(short)[-2:]).all()
    got, want = (to_numpy(x)[:offsets[4]].astype(np.float32) for x in (short, out))
    assert np.allclose(got, want, rtol=2e-2, atol=2e-2, equal_nan=True)


def test_packed_queries_bad_inputs_are_named():
    rng = np.random.default_rng(3)
    q, kc, vc, _, offsets = _packed_case(rng, counts=[2, 3], lens=[10, 20], heads=4, heads_k=2, head_dim=64,
                                         dtype="fp16", capacity=64, page_size=None, extra_rows=0)
    dq, dk, dv, doffsets = _to_device(q, kc, vc, offsets)
    lens = cupy.asarray(np.array([10, 20], np.int32))
    call = cuflash.attention_with_kvcache
    with pytest.raises(ValueError, match="k_new and v_new with cu_seqlens_q"):
        call(dq, dk, dv, cache_seqlens=lens, cu_seqlens_q=doffsets, k_new=dk[:, :1], v_new=dv[:, :1])
    with pytest.raises(ValueError, match="num_splits=0"):
        call(dq, dk, dv, cache_seqlens=lens, cu_seqlens_q=doffsets, num_splits=0)
    with pytest.raises(ValueError, match="3-d"):
        call(dq[None], dk, dv, cache_seqlens=lens, cu_seqlens_q=doffsets)
    with pytest.raises(ValueError, match="max_seqlen_q goes with cu_seqlens_q"):
        call(dq, dk, dv, cache_seqlens=lens, max_seqlen_q=3)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32"):
        call(dq, dk, dv, cache_seqlens=lens, cu_seqlens_q=doffsets.astype(cupy.int64))
    with pytest.raises(ValueError, match="cache_seqlens must be int32 \\[batch=2\\]"):
        call(dq, dk, dv, cache_seqlens=lens[:1], cu_seqlens_q=doffsets)
    with pytest.raises(ValueError, match="max_seqlen_q=-1"):
        call(dq, dk, dv, cache_seqlens=lens, cu_seqlens_q=doffsets, max_seqlen_q=-1)
    # a plan per offsets array: the same call again, and with other offsets
    first = call(dq, dk, dv, cache_seqlens=lens, cu_seqlens_q=doffsets)
    again = call(dq, dk, dv, cache_seqlens=lens, cu_seqlens_q=doffsets)
    assert np.array_equal(to_numpy(first).view(np.uint16), to_numpy(again).view(np.uint16))
    other = call(dq, dk, dv, cache_seqlens=lens, cu_seqlens_q=cupy.asarray(np.array([0, 5, 5], np.int32)))
    assert np.isfinite(to_numpy(other)).all() and not np.array_equal(to_numpy(other), to_numpy(first))


@settings(max_examples=16)
@given(problem=kvcache_problems(head_dims=(128,), max_batch=3, max_length=700))
def test_drawn_kvcache_problems_match_the_reference(problem):
    """Decode, verification and chunked-prefill calls drawn by cuflash.testing.kvcache_problems
    (contiguous and paged caches, appends, packed queries, splits) against the float64 reference;
    the caches after the append bit for bit."""
    inputs = problem.make_inputs(cupy, seed=0)
    out, lse = cuflash.attention_with_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"], return_lse=True,
                                              **problem.call_kwargs(inputs))
    ref, ref_lse, k_after, v_after = problem.reference(problem.make_inputs(seed=0))
    naive, naive_lse, _, _ = problem.naive(problem.make_inputs(seed=0))
    assert_attention_close(out, ref, problem.dtype, baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    assert np.array_equal(to_numpy(inputs["k_cache"]).view(np.uint16), k_after.view(np.uint16))
    assert np.array_equal(to_numpy(inputs["v_cache"]).view(np.uint16), v_after.view(np.uint16))


@pytest.mark.parametrize("cache_dtype", ["bf16", "e4m3"])
def test_append_kv_writes_tokens_by_slot_then_packed_queries_attend(cache_dtype):
    """cuflash.append_kv: tokens of three sequences written by slot into a shuffled paged cache
    (a negative slot and one past the cache skipped, nothing else touched), then attended as
    packed queries whose lengths count them: the reference's result over the same cache."""
    rng = np.random.default_rng(21)
    counts, before = [3, 1, 5], np.array([30, 0, 100])
    fp8 = "e4m3" if cache_dtype == "e4m3" else None
    _, kc, vc, table, _ = _make(rng, batch=3, seqlen_q=1, heads=8, heads_k=2, head_dim=128, dtype="bf16",
                                lengths=before, capacity=128, page_size=16, fp8_format=fp8)
    fill = (lambda n: (4 * rng.standard_normal((n, 2, 128))).astype(_fp8_type()).view(np.uint8)) if fp8 else \
        (lambda n: rng.standard_normal((n, 2, 128)).astype(_np_dtype("bf16")))
    k_new, v_new = fill(sum(counts) + 2), fill(sum(counts) + 2)  # two tokens more: padding, and past the cache
    slots = [table[b, p // 16] * 16 + p % 16 for b, n in enumerate(counts) for p in range(before[b], before[b] + n)]
    slots = np.array(slots + [-1, kc.shape[0] * 16 + 5], np.int32)
    dk, dv = _to_device(kc, vc)
    cuflash.append_kv(dk, dv, cupy.asarray(k_new), cupy.asarray(v_new), cupy.asarray(slots))
    want_k, want_v = kc.copy(), vc.copy()
    for t, slot in enumerate(slots[:-2]):
        want_k[slot // 16, slot % 16], want_v[slot // 16, slot % 16] = k_new[t], v_new[t]
    bits = np.uint8 if fp8 else np.uint16
    assert np.array_equal(to_numpy(dk).view(bits), want_k.view(bits))
    assert np.array_equal(to_numpy(dv).view(bits), want_v.view(bits))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    q = rng.standard_normal((offsets[-1], 8, 128)).astype(_np_dtype("bf16"))
    lens = (before + np.array(counts)).astype(np.int32)
    out, lse = cuflash.attention_with_kvcache(cupy.asarray(q), dk, dv, cache_seqlens=cupy.asarray(lens),
                                              page_table=cupy.asarray(table), cu_seqlens_q=cupy.asarray(offsets),
                                              fp8_format=fp8, return_lse=True)
    kwargs = dict(page_table=table, cu_seqlens_q=offsets, fp8_format=fp8)
    ref, ref_lse, _, _ = attention_with_kvcache_reference(q, want_k, want_v, lens, **kwargs)
    naive, naive_lse, _, _ = attention_with_kvcache_reference(q, want_k, want_v, lens, naive=True, **kwargs)
    assert_attention_close(out, ref, "bf16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)


def _fp8_type():
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn
