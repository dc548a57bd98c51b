"""Time one configuration of the FlashAttention papers' grid from Python.

The same as ``python -m cuflash bench --head-dims 128 --seqlens 4096 --causal yes``; torch SDPA is
timed beside cuflash when torch is installed.

    python examples/benchmark.py
"""
import sys

from cuflash.tools import bench
from cuflash.tools.machine import gpu_status


def main() -> int:
    available, reason = gpu_status()
    if not available:
        print(f"skipped: benchmarking needs a CUDA GPU ({reason})")
        return 0
    report = bench.run_benchmark(head_dims=(128,), seqlens=(4096,), causal=(True,), dtype="bf16",
                                 total_tokens=16384, hidden=2048, reps=30)
    (result,) = report["results"]
    print(f"\nkernel {result['spec']} on {report['environment']['gpu']}: "
          f"{result['ms']:.3f} ms, {result['tflops']:.1f} TFLOP/s")
    print(bench.markdown_tables(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
