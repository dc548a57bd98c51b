"""Build a kernel specialization, look at its generated CUDA source and compile it offline.

Needs no GPU: NVRTC (installed with CuPy) compiles for any target, and ptxas reports registers,
spills and shared memory. The .cu files go to OUTPUT_DIR, or to a new temporary folder.

    python examples/generate_kernel.py [OUTPUT_DIR]
"""
import sys
import tempfile
from pathlib import Path

import cuflash


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="cuflash-kernels-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"writing the generated sources to {out_dir}")

    spec = cuflash.default_spec(head_dim=128, dtype="bf16", causal=True, arch="sm90a")
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
            report = cuflash.compile_offline(variant)
        except cuflash.CompileError as exc:
            print(exc)
            return 1
        except ImportError:
            print('  not compiled: NVRTC comes with CuPy (pip install "cuflash[cuda13]" or "cuflash[cuda12]")')
            continue
        print(f"  registers {report.registers}, spill stores {report.spill_stores} B, "
              f"spill loads {report.spill_loads} B, stack {report.stack_frame} B, "
              f"shared memory {report.smem_bytes} B, cubin {len(report.cubin)} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
