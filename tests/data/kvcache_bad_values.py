"""Bad lengths, page ids and offsets for attention_with_kvcache and attention_varlen: run under
compute-sanitizer memcheck by tests/test_kvcache_gpu.py (the kernels must touch nothing outside the arrays)."""
import numpy as np, cupy, cuflash
rng = np.random.default_rng(0)
q = cupy.asarray(rng.standard_normal((3, 2, 8, 64)).astype(np.float16))
kc = cupy.asarray(rng.standard_normal((24, 16, 2, 64)).astype(np.float16))
table = cupy.asarray(np.array([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, -3, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 10**7]], np.int32))
lens = cupy.asarray(np.array([-5, 100, 10**6], np.int32))
new = cupy.asarray(rng.standard_normal((3, 2, 2, 64)).astype(np.float16))
for splits in (1, 3):
    out = cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=lens, page_table=table, k_new=new, v_new=new, num_splits=splits)
    print(splits, np.isnan(out.get().astype(np.float32)).all(axis=(1, 2, 3)))
# FP8 caches at head dim 128 (read straight into the fragments), contiguous and paged
q8 = cupy.asarray(rng.standard_normal((3, 5, 8, 128)).astype(np.float16))
k8 = cupy.asarray(rng.integers(0, 0x7E, size=(3, 128, 2, 128)).astype(np.uint8))
p8 = cupy.asarray(rng.integers(0, 0x7E, size=(24, 16, 2, 128)).astype(np.uint8))
for splits in (1, 3):
    out = cuflash.attention_with_kvcache(q8, k8, k8, cache_seqlens=cupy.asarray(np.array([-5, 100, 129], np.int32)),
                                         num_splits=splits, fp8_format="e4m3")
    print("fp8", splits, np.isnan(out.get().astype(np.float32)).all(axis=(1, 2, 3)))
    out = cuflash.attention_with_kvcache(q8, p8, p8, cache_seqlens=lens, page_table=table, num_splits=splits,
                                         fp8_format="e5m2")
    print("fp8 paged", splits, np.isnan(out.get().astype(np.float32)).all(axis=(1, 2, 3)))
qv = cupy.asarray(rng.standard_normal((30, 4, 64)).astype(np.float16))
cu_bad = cupy.asarray(np.array([0, 10, -4, 30], np.int32))
out = cuflash.attention_varlen(qv, qv[:, :2], qv[:, :2], cu_bad, cupy.asarray(np.array([0, 10, 10**6, 30], np.int32)), max_seqlen_q=20)
print("varlen nan rows", int(np.isnan(out.get().astype(np.float32)).any(axis=(1, 2)).sum()))
cupy.cuda.Device().synchronize()
print("done")
