"""Fuzz cuflash.attention against the float64 reference with Hypothesis.

Problems come from cuflash.testing.attention_problems: awkward sequence lengths, seqlen_q != seqlen_k
both ways, grouped-query heads, both layouts, strided views, custom scales.

    python examples/fuzz_with_hypothesis.py [--examples N]
"""
import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50)
    args = parser.parse_args()

    from cuflash.tools.machine import gpu_status

    available, reason = gpu_status()
    if not available:
        print(f"skipped: fuzzing runs the kernels and needs a CUDA GPU ({reason})")
        return 0
    try:
        from hypothesis import HealthCheck, given, settings
    except ImportError:
        print('skipped: needs Hypothesis (pip install ".[test]")')
        return 0

    import cupy

    import cuflash
    from cuflash.testing import assert_attention_close, attention_problems

    seen = []

    # A few head dims and the 16-bit dtypes keep the number of compiled kernels small;
    # deadline=None because the first call of each specialization compiles.
    @settings(max_examples=args.examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(attention_problems(head_dims=(64, 80, 128), dtypes=("fp16", "bf16"), max_seqlen=600))
    def attention_matches_reference(problem):
        q, k, v = problem.make_inputs(cupy, seed=len(seen))
        out, lse = cuflash.attention(q, k, v, causal=problem.causal, scale=problem.scale,
                                     layout=problem.layout, return_lse=True)
        ref_out, ref_lse = problem.reference(q, k, v)
        base_out, base_lse = problem.naive(q, k, v)
        assert_attention_close(out, ref_out, problem.dtype, baseline=base_out,
                               lse=lse, ref_lse=ref_lse, baseline_lse=base_lse)
        seen.append(problem.name)

    attention_matches_reference()
    print(f"{len(seen)} problems passed, for example:")
    for name in seen[:10]:
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
