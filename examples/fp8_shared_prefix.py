"""FP8 attention over a shared prefix: K and V quantized once, V prepared once, many query chunks.

A long context (a document, a system prompt) is kept in FP8 and attended by several chunks of
queries. The Hopper FP8 kernel reads V transposed; ``cuflash.prepare_v`` makes that layout once,
so the calls that follow do not rearrange V again. Each chunk is checked against the float64
reference of the dequantized inputs.

    python examples/fp8_shared_prefix.py
"""
import sys


def main() -> int:
    from cuflash.tools.machine import gpu_status

    available, reason = gpu_status()
    if not available:
        print(f"skipped: this example needs a CUDA GPU ({reason})")
        return 0

    import cupy

    import cuflash
    from cuflash.reference import attention_fp8_naive, attention_fp8_reference
    from cuflash.testing import assert_attention_close

    batch, heads, heads_k, head_dim, prefix = 2, 16, 4, 128, 4096
    rng = cupy.random.default_rng(0)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=cupy.float32)

    # The prefix, quantized once with one descale per (batch, kv head); V prepared once.
    (k8, k_descale), (v8, v_descale) = (cuflash.quantize_fp8(randn(batch, heads_k, prefix, head_dim), "e4m3", "head")
                                        for _ in range(2))
    v_operand = cuflash.prepare_v(v8)

    for chunk, length in enumerate((300, 1000, 57)):
        q8, q_descale = cuflash.quantize_fp8(randn(batch, heads, length, head_dim), "e4m3", "head")
        kwargs = dict(fp8_format="e4m3", q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        try:
            out, lse = cuflash.attention(q8, k8, v_operand, return_lse=True, out_dtype="bf16", **kwargs)
        except ValueError as exc:  # not the Hopper FP8 kernel (another GPU): it reads V as it is
            print(f"V itself, not prepared: {exc}")
            v_operand = v8
            out, lse = cuflash.attention(q8, k8, v_operand, return_lse=True, out_dtype="bf16", **kwargs)

        host = dict(q=q8.get(), k=k8.get(), v=v8.get())
        host_scales = {name: value.get() for name, value in kwargs.items() if name.endswith("descale")}
        ref, ref_lse = attention_fp8_reference(**host, fp8_format="e4m3", **host_scales)
        naive, _ = attention_fp8_naive(**host, fp8_format="e4m3", **host_scales)
        assert_attention_close(out, ref, "e4m3", baseline=naive, lse=lse, ref_lse=ref_lse)
        error = float(abs(out.astype(cupy.float32).get() - ref).max())
        print(f"chunk {chunk}: {length} queries x {prefix} keys, {heads}/{heads_k} heads: "
              f"max error {error:.4f} against the float64 reference (naive FP8: {abs(naive - ref).max():.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
