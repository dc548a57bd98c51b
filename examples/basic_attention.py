"""Attention on CuPy arrays, checked against cuflash's float64 NumPy reference.

    python examples/basic_attention.py
"""
import sys


def main() -> int:
    from cuflash.tools.machine import gpu_status

    available, reason = gpu_status()
    if not available:
        print(f"skipped: this example needs a CUDA GPU ({reason})")
        return 0

    import cupy
    import ml_dtypes

    import cuflash
    from cuflash.reference import attention_naive, attention_reference
    from cuflash.testing import assert_attention_close

    rng = cupy.random.default_rng(0)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16)

    # 1. Causal self-attention, layout [batch, heads, seqlen, head_dim].
    q, k, v = randn(2, 8, 1000, 128), randn(2, 8, 1000, 128), randn(2, 8, 1000, 128)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    print(f"bhsd causal: out {out.shape} {out.dtype}, lse {lse.shape} {lse.dtype}")
    check(q, k, v, out, lse, causal=True, layout="bhsd",
          reference=attention_reference, baseline=attention_naive, assert_close=assert_attention_close)

    # 2. Grouped-query attention in [batch, seqlen, heads, head_dim] with fewer queries than keys:
    #    8 query heads share 2 key/value heads; the causal mask is aligned bottom-right.
    q, k, v = randn(1, 300, 8, 64), randn(1, 700, 2, 64), randn(1, 700, 2, 64)
    out, lse = cuflash.attention(q, k, v, causal=True, layout="bshd", return_lse=True)
    print(f"bshd GQA 8/2 heads, seqlen_q 300 < seqlen_k 700: out {out.shape}")
    check(q, k, v, out, lse, causal=True, layout="bshd",
          reference=attention_reference, baseline=attention_naive, assert_close=assert_attention_close)
    return 0


def check(q, k, v, out, lse, *, causal, layout, reference, baseline, assert_close):
    """The accuracy rule: error vs float64 at most twice that of a plain bf16 computation, plus atol."""
    import cupy
    import numpy as np

    host = [cupy.asnumpy(x) for x in (q, k, v)]
    ref_out, ref_lse = reference(*host, causal=causal, layout=layout)
    base_out, base_lse = baseline(*host, causal=causal, layout=layout)
    assert_close(out, ref_out, "bf16", baseline=base_out, lse=lse, ref_lse=ref_lse, baseline_lse=base_lse)
    error = np.max(np.abs(cupy.asnumpy(out).astype(np.float64) - ref_out))
    base_error = np.max(np.abs(base_out.astype(np.float64) - ref_out))
    print(f"  max |out - ref| = {error:.2e} (plain bf16 NumPy: {base_error:.2e}): ok")


if __name__ == "__main__":
    sys.exit(main())
