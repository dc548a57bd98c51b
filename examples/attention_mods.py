"""Attention variants as Python functions: trace them, see the CUDA they become, check them
against the float64 reference (no GPU needed) and, on a GPU, run them in the kernels.

    python examples/attention_mods.py
"""
import sys

import numpy as np

import cuflash.mods as mods
from cuflash import reference


def main() -> int:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 64, 32)) for _ in range(3))
    slopes = np.asarray([2.0 ** -(i + 1) for i in range(4)], dtype=np.float32)

    def alibi_softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * mods.tanh(score / 20.0) - slopes[h] * (q_idx - kv_idx)

    window = mods.sliding_window(16)
    graph = mods.trace_score_mod(alibi_softcap)
    print(f"{len(graph.nodes)} nodes, digest {graph.digest}")
    print(mods.cuda_source(graph).split("#endif\n")[-1])

    out, lse = reference.attention_reference(q, k, v, score_mod=alibi_softcap, mask_mod=window)
    qi, ki = np.arange(64)[:, None], np.arange(64)[None, :]
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(32)
    scores = 20.0 * np.tanh(scores / 20.0) - slopes.astype(np.float64)[None, :, None, None] * (qi - ki)
    scores = np.where((qi >= ki) & (qi - ki < 16), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = p / p.sum(-1, keepdims=True) @ v
    error = float(np.abs(out - want).max())
    print(f"reference with mods against the same attention written in NumPy: max |difference| {error:.2e}")
    if error >= 1e-12:
        return 1
    return on_the_gpu(q, k, v, slopes, window)


def on_the_gpu(q, k, v, slopes_host, window) -> int:
    """The same mods in cuflash's kernels (fp16), checked with cuflash.testing's accuracy rule."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the part above is the example
        print("no GPU: the kernels were not run")
        return 0
    import cuflash
    from cuflash.testing import assert_attention_close

    slopes = cupy.asarray(slopes_host)

    def alibi_softcap(score, b, h, q_idx, kv_idx):  # the mod above, capturing the CuPy array
        return 20.0 * mods.tanh(score / 20.0) - slopes[h] * (q_idx - kv_idx)

    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    out = cuflash.attention(*(cupy.asarray(x) for x in (q16, k16, v16)), score_mod=alibi_softcap, mask_mod=window)
    ref, _ = reference.attention_reference(q16, k16, v16, score_mod=alibi_softcap, mask_mod=window)
    naive, _ = reference.attention_naive(q16, k16, v16, score_mod=alibi_softcap, mask_mod=window)
    assert_attention_close(out, ref, "fp16", baseline=naive)
    print("cuflash.attention with the mods matches the reference")

    # FlashAttention's spelling of a window and a cap: the same mods, the window's block mask made once
    out = cuflash.attention(*(cupy.asarray(x) for x in (q16, k16, v16)), causal=True, window_size=(15, 0),
                            softcap=20.0)
    same = dict(causal=True, score_mod=mods.softcap(20.0), mask_mod=window)
    assert_attention_close(out, reference.attention_reference(q16, k16, v16, **same)[0], "fp16",
                           baseline=reference.attention_naive(q16, k16, v16, **same)[0])
    print("window_size=(15, 0) and softcap=20 match the same mods")
    return 0


if __name__ == "__main__":
    sys.exit(main())
