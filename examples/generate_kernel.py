"""Build a kernel specialization, look at its generated CUDA source and compile it offline.

Needs no GPU: NVRTC compiles for any target, and ptxas reports registers, spills and shared memory.

    python examples/generate_kernel.py [OUTPUT_DIR]
"""
import sys
from pathlib import Path

import cuflash
from cuflash.compile import CompileError, compile_offline
from cuflash.spec import default_spec


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
    out_dir.mkdir(parents=True, exist_ok=True)

    spec = default_spec(head_dim=128, dtype="bf16", causal=True, arch="sm90a")
    print(f"default spec: {spec.name}")
    print(f"  {spec}")

    # The same problem with a deeper K/V pipeline: a different specialization, a different kernel.
    variants = [spec, spec.replace(num_stages=3)]
    for variant in variants:
        source = cuflash.generate(variant)
        path = out_dir / f"{variant.name}.cu"
        path.write_text(source)
        print(f"\n{variant.name}: {len(source.splitlines())} lines of CUDA written to {path}")
        try:
            report = compile_offline(variant)
        except CompileError as exc:
            print(exc)
            return 1
        print(f"  registers {report.registers}, spill stores {report.spill_stores} B, "
              f"spill loads {report.spill_loads} B, stack {report.stack_frame} B, "
              f"shared memory {report.smem_bytes} B, cubin {len(report.cubin)} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
