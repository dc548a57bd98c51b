"""Command line: ``python -m cuflash {info,generate,warmup,demo,bench,tune}``.

Every subcommand imports what it needs inside its function, so ``--help``, ``info`` and
``generate`` work on a machine with no GPU, and ``info`` works even without CuPy.
"""
from __future__ import annotations

import argparse
import sys

#: The problem ``demo`` runs: bf16, batch 4, 16 heads, 2048 tokens, head_dim 128, causal.
DEMO_PROBLEM = dict(dtype="bf16", batch=4, heads=16, seqlen=2048, head_dim=128, causal=True)

#: Target used to show generated or offline-compiled code when no GPU says which one to use.
FALLBACK_ARCH = "sm90a"

from . import machine


def _entry_label(entry) -> str:
    for attr in ("name", "spec_name"):
        value = getattr(entry, attr, None)
        if isinstance(value, str):
            return value
    return str(entry)


def _fail(command: str, message: str, code: int) -> int:
    print(f"cuflash {command}: error: {message}", file=sys.stderr)
    return code


# -- info -------------------------------------------------------------------------------------
def _computed_at(spec) -> str:
    """", computed at N columns" for a kernel that pads the head dim, else nothing."""
    return f", computed at {spec.padded_head_dim} columns" if spec.padded_head_dim != spec.head_dim else ""


def cmd_info(args) -> int:
    env = machine.environment()
    rows = [
        ("cuflash", f"{env['cuflash']} ({machine.cuflash_dir()})"),
        ("python", env["python"]),
        ("numpy", env["numpy"]),
        ("jinja2", env["jinja2"]),
        ("ml_dtypes", env["ml_dtypes"]),
        ("cupy", env["cupy"] or f"not installed; install with {machine.INSTALL_CUPY}"),
        ("NVRTC", env["nvrtc"] or ("not found (it comes with CuPy)" if env["cupy"] is None else "not found")),
        ("CUDA runtime", env["cuda_runtime"] or "unknown"),
        ("CUDA driver", env["driver"] or "none"),
    ]
    available, reason = machine.gpu_status()
    if available:
        rows += [
            ("GPU", f"{env['gpu']} ({env['multiprocessors']} SMs, {env['memory_gib']} GiB)"),
            ("compute capability", env["compute_capability"]),
            ("compile target", env["arch"] or "unsupported (cuflash needs sm_80 or newer)"),
        ]
    else:
        rows += [("GPU", f"none: {reason}"),
                 ("compile target", f"none (offline compiles default to {FALLBACK_ARCH})")]
    if args.head_dim is not None:
        from cuflash.core.policy import default_spec
        arch = env["arch"] if available and env["arch"] else (args.arch or FALLBACK_ARCH)
        try:
            # as cuflash.attention runs it without return_lse, and with it where that differs (FP8)
            spec = default_spec(args.head_dim, args.dtype, args.causal, args.arch or arch, seqlen=args.seqlen,
                                lse=False)
            with_lse = default_spec(args.head_dim, args.dtype, args.causal, args.arch or arch, seqlen=args.seqlen)
        except ValueError as exc:
            print(f"cuflash info: error: {exc}", file=sys.stderr)
            return 2
        rows.append(("kernel for the problem", f"{spec.name} (family {spec.family}, {spec.threads} threads, "
                                                f"{spec.smem_bytes} bytes shared memory{_computed_at(spec)})"))
        if with_lse != spec:
            rows.append(("with return_lse=True", f"{with_lse.name} ({with_lse.smem_bytes} bytes shared memory)"))
        from cuflash.core.policy import default_bwd_spec
        for deterministic in (False, True) if not spec.fp8 else ():  # FP8 attention is forward only
            bwd = default_bwd_spec(args.head_dim, args.dtype, args.causal, args.arch or arch, deterministic)
            label = "backward (deterministic)" if deterministic else "backward"
            rows.append((label, f"{bwd.name} (family {bwd.family}, {bwd.threads} threads, "
                                f"{bwd.smem_bytes} + {bwd.dq_smem_bytes} bytes shared memory{_computed_at(bwd)})"))
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")

    try:
        from cuflash.core import compile as compiler
        directory = compiler.cache_dir()
        entries = list(compiler.cached_entries())
    except Exception as exc:
        print(f"{'cache':<{width}}  unavailable ({type(exc).__name__}: {exc})")
        return 0
    print(f"{'cache dir':<{width}}  {directory}")
    print(f"{'cached kernels':<{width}}  {len(entries)}")
    for entry in entries:
        print(f"  {_entry_label(entry)}")
    return 0


# -- generate ---------------------------------------------------------------------------------
_TILE_OPTIONS = ("block_m", "block_n", "num_warps", "num_stages", "overlap")


def _default_arch() -> str:
    available, _ = machine.gpu_status()
    if available:
        try:
            from cuflash.core.compile import device_arch
            return device_arch()
        except Exception:
            pass
    return FALLBACK_ARCH


def cmd_generate(args) -> int:
    from cuflash.core.policy import default_bwd_spec, default_spec
    arch = args.arch or _default_arch()
    # Without --arch the target is implicit, so a rejection names it and the way to pick another.
    chosen = "" if args.arch else f" (target {arch}, as no --arch was given; pick another with e.g. --arch sm80)"
    overrides = {name: getattr(args, name) for name in _TILE_OPTIONS if getattr(args, name) is not None}
    if "overlap" in overrides:
        overrides["overlap"] = bool(overrides["overlap"])
    try:
        if args.backward or args.deterministic:
            overrides.pop("overlap", None)
            spec = default_bwd_spec(args.head_dim, args.dtype, args.causal, arch, args.deterministic)
        else:
            spec = default_spec(args.head_dim, args.dtype, args.causal, arch, lse=not args.no_lse)
        if overrides:
            spec = spec.replace(**overrides)
        from cuflash import generate
        source = generate(spec)
    except (ValueError, TypeError) as exc:
        return _fail("generate", f"{exc}{chosen}", 2)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(source)
        print(f"wrote {spec.name} ({len(source.splitlines())} lines) to {args.output}")
    else:
        sys.stdout.write(source if source.endswith("\n") else source + "\n")
    return 0


# -- warmup -----------------------------------------------------------------------------------
def cmd_warmup(args) -> int:
    available, reason = machine.gpu_status()
    if not available:
        install = f". Install CuPy with {machine.INSTALL_CUPY}" if machine.environment()["cupy"] is None else ""
        return _fail("warmup", f"needs a CUDA GPU to pick the target and fill the cache: {reason}{install}", 1)
    from cuflash.core import compile as compiler
    from cuflash.core.policy import CLASS_SEQLENS, default_spec
    arch = compiler.device_arch()
    try:
        specs = [default_spec(d, t, c, arch, seqlen=n) for t in args.dtypes for d in args.head_dims
                 for c in machine.causal_modes(args.causal) for n in CLASS_SEQLENS]
        if args.backward:
            from cuflash.core.policy import default_bwd_spec
            specs += [default_bwd_spec(d, t, c, arch, det) for t in args.dtypes for d in args.head_dims
                      for c in machine.causal_modes(args.causal) for det in (False, True)]
        specs = list(dict.fromkeys(specs))
    except (ValueError, TypeError) as exc:
        return _fail("warmup", str(exc), 2)
    print(f"compiling {len(specs)} kernels for {arch} into {compiler.cache_dir()}")
    try:
        names = compiler.warmup(specs, processes=args.processes, progress=True)
    except compiler.CompileError as exc:
        return _fail("warmup", str(exc), 1)
    print(f"{len(names)} kernels are in the cache")
    return 0


# -- demo -------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    missing = machine.missing_compiler(machine.environment())
    if missing:
        return _fail("demo", f"{missing} (the demo compiles a kernel, with or without a GPU). "
                             f"Install it with {machine.INSTALL_CUPY}.", 1)
    available, reason = machine.gpu_status()
    if available:
        return _demo_gpu()
    print(f"No CUDA GPU is usable here: {reason}.")
    print("Showing what runs without one.\n")
    return _demo_offline()


def _demo_gpu() -> int:
    import cupy

    import cuflash
    from . import bench
    from cuflash.core.compile import device_arch
    from cuflash.reference import attention_flops
    from cuflash.core.policy import default_spec

    p = DEMO_PROBLEM
    arch = device_arch()
    spec = default_spec(p["head_dim"], p["dtype"], p["causal"], arch, seqlen=p["seqlen"])
    env = machine.environment()
    print(f"cuflash demo on {env['gpu']} ({arch}): {p['dtype']}, batch {p['batch']}, heads {p['heads']}, "
          f"seqlen {p['seqlen']}, head_dim {p['head_dim']}, {'causal' if p['causal'] else 'non-causal'}")
    print(f"kernel: {spec.name}")

    q, k, v = bench.random_inputs((p["batch"], p["heads"], p["seqlen"], p["head_dim"]), p["dtype"])

    def run():
        return cuflash.attention(q, k, v, causal=p["causal"], return_lse=True)

    seconds, (out, lse) = bench.first_call_seconds(run)
    print(f"first call (compile or load from cache, then run): {seconds:.2f} s")

    batch_index, heads = 0, [0, p["heads"] - 1]
    host = [cupy.asnumpy(x[batch_index:batch_index + 1, heads]) for x in (q, k, v)]
    got_out = cupy.asnumpy(out[batch_index:batch_index + 1, heads])
    got_lse = cupy.asnumpy(lse[batch_index:batch_index + 1, heads])
    out_error, lse_error, verdict = _check_against_reference(got_out, got_lse, host, p)
    print(f"vs float64 reference on batch {batch_index}, heads {heads}: "
          f"max |out - ref| = {out_error:.3e}, max |lse - ref| = {lse_error:.3e}: {verdict}")

    ms = bench.cuda_event_median_ms(lambda: cuflash.attention(q, k, v, causal=p["causal"]), reps=20)
    flops = attention_flops(p["batch"], p["heads"], p["seqlen"], p["seqlen"], p["head_dim"], p["causal"])
    print(f"median of 20 runs: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
    return 0 if verdict == "ok" else 1


def _check_against_reference(out, lse, host_inputs, problem) -> tuple[float, float, str]:
    """Max errors of ``out``/``lse`` vs the float64 reference, and "ok" or the accuracy rule's complaint.

    The rule (cuflash.testing): error at most twice that of the same computation written plainly
    in the input precision, plus a small atol.
    """
    import numpy as np

    from cuflash.reference import attention_naive, attention_reference
    from cuflash.testing import assert_attention_close

    options = dict(causal=problem["causal"], scale=None, layout="bhsd")
    ref_out, ref_lse = attention_reference(*host_inputs, **options)
    naive_out, naive_lse = attention_naive(*host_inputs, **options)
    out_error = float(np.max(np.abs(out.astype(np.float64) - ref_out)))
    finite = np.isfinite(ref_lse)
    lse_error = float(np.max(np.abs(lse.astype(np.float64)[finite] - ref_lse[finite])))
    try:
        assert_attention_close(out, ref_out, problem["dtype"], baseline=naive_out,
                               lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    except AssertionError as exc:
        return out_error, lse_error, "MISMATCH: " + (str(exc).splitlines() or ["outside tolerance"])[0]
    return out_error, lse_error, "ok"


def _demo_offline() -> int:
    import numpy as np

    from cuflash.core.compile import CompileError, compile_offline
    from cuflash.core.policy import default_spec

    p = DEMO_PROBLEM
    spec = default_spec(p["head_dim"], p["dtype"], p["causal"], FALLBACK_ARCH, seqlen=p["seqlen"])
    nvrtc = machine.environment()["nvrtc"]
    print(f"1. The demo's kernel, compiled offline for sm_90a with NVRTC {nvrtc}:")
    try:
        report = compile_offline(spec)
    except CompileError as exc:
        print(f"   compile failed: {exc}")
        return 1
    except Exception as exc:  # NVRTC failing outside the compile itself (a CUDA error) is no CompileError
        print(f"   NVRTC failed: {type(exc).__name__}: {exc}")
        return 1
    cubin = getattr(report, "cubin", b"") or b""
    print(f"   {spec.name}")
    print(f"   registers per thread: {report.registers}")
    print(f"   spill stores / loads: {report.spill_stores} / {report.spill_loads} bytes")
    print(f"   stack frame: {report.stack_frame} bytes")
    print(f"   shared memory: {report.smem_bytes} bytes")
    print(f"   cubin: {len(cubin)} bytes")

    from cuflash.reference import attention_reference
    from cuflash.simulate import simulate_tiled
    batch, heads, seqlen_q, seqlen_k, head_dim = 1, 2, 113, 239, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim))
    k = rng.standard_normal((batch, heads, seqlen_k, head_dim))
    v = rng.standard_normal((batch, heads, seqlen_k, head_dim))
    print(f"\n2. The kernel's tiled online softmax, simulated in NumPy (block_m={spec.block_m}, "
          f"block_n={spec.block_n}) vs the float64 reference,\n   on b={batch} h={heads} "
          f"seqlen_q={seqlen_q} seqlen_k={seqlen_k} head_dim={head_dim} causal:")
    tiled_out, tiled_lse = simulate_tiled(q, k, v, causal=True, scale=None, layout="bhsd",
                                          block_m=spec.block_m, block_n=spec.block_n)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True, scale=None, layout="bhsd")
    out_diff = float(np.max(np.abs(np.asarray(tiled_out) - ref_out)))
    finite = np.isfinite(ref_lse)
    lse_diff = float(np.max(np.abs(np.asarray(tiled_lse)[finite] - ref_lse[finite])))
    print(f"   max |out difference| = {out_diff:.3e}, max |lse difference| = {lse_diff:.3e}")
    print("\nOn a machine with a CUDA GPU (sm_80 or newer) the demo runs the kernel, checks it and times it.")
    return 0


# -- bench ------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from . import bench
    return bench.run(args)


def cmd_tune(args) -> int:
    from . import tune
    return tune.main(args.tune_args)


# -- parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .bench import add_arguments as add_bench_arguments

    parser = argparse.ArgumentParser(
        prog="python -m cuflash",
        description="FlashAttention for CuPy: inspect, generate, compile and benchmark the kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    info = sub.add_parser("info", help="GPU, CUDA, CuPy and NVRTC versions, compile target and cache; "
                                       "with --head-dim, the kernel a problem runs")
    info.add_argument("--head-dim", type=int, help="also say which kernel (and family) this problem uses")
    info.add_argument("--dtype", default="bf16", help="fp16, bf16, fp32, e4m3 or e5m2 (default bf16)")
    info.add_argument("--causal", action="store_true", help="a causal problem (default: non-causal)")
    info.add_argument("--seqlen", type=int, help="the longer of the query and key lengths (the Hopper kernel's "
                                                "tiles depend on it; default: long)")
    info.add_argument("--arch", help=f"target tag (default: this GPU's, else {FALLBACK_ARCH})")
    info.set_defaults(handler=cmd_info)

    gen = sub.add_parser("generate", help="print or write the CUDA source of one kernel specialization")
    gen.add_argument("--head-dim", type=int, required=True, help="multiple of 8 from 8 to 256")
    gen.add_argument("--dtype", default="bf16", help="fp16, bf16, fp32, e4m3 or e5m2 (default bf16)")
    gen.add_argument("--causal", action="store_true", help="the causal kernel (default: non-causal)")
    gen.add_argument("--arch", help=f"target tag such as sm80 or sm90a (default: this GPU's, else {FALLBACK_ARCH})")
    for name in _TILE_OPTIONS:
        gen.add_argument("--" + name.replace("_", "-"), dest=name, type=int,
                         help="override the default spec's " + name + (" (0 or 1)" if name == "overlap" else ""))
    gen.add_argument("--no-lse", action="store_true", help="the forward kernel of calls without return_lse (the "
                     "Hopper FP8 kernel then sums P on the tensor cores; the same kernel elsewhere)")
    gen.add_argument("--backward", action="store_true", help="the backward kernels instead of the forward")
    gen.add_argument("--deterministic", action="store_true", help="the deterministic backward (implies --backward)")
    gen.add_argument("-o", "--output", help="write the source to this file instead of stdout")
    gen.set_defaults(handler=cmd_generate)

    from cuflash.core.spec import HEAD_DIMS
    warm = sub.add_parser("warmup", help="compile the default kernels for this GPU into the disk cache")
    warm.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS), metavar="D",
                      help=f"head dims to compile (default: all, {HEAD_DIMS[0]} to {HEAD_DIMS[-1]})")
    warm.add_argument("--dtypes", nargs="+", default=["fp16", "bf16", "fp32"], metavar="DTYPE",
                      help="input dtypes to compile: fp16, bf16, fp32, e4m3, e5m2 (default: fp16 bf16 fp32)")
    warm.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                      help="causal kernels, non-causal ones or both (default: both)")
    warm.add_argument("--processes", type=int, default=None, help="parallel compile processes (default: CPU count)")
    warm.add_argument("--backward", action="store_true", help="also the backward kernels (both dQ modes)")
    warm.set_defaults(handler=cmd_warmup)

    demo = sub.add_parser("demo", help="run, check and time one attention call (offline compile without a GPU)")
    demo.set_defaults(handler=cmd_demo)

    bench_parser = sub.add_parser("bench", help="forward / backward benchmark on the FlashAttention papers' grid")
    add_bench_arguments(bench_parser)
    bench_parser.set_defaults(handler=cmd_bench)

    tune = sub.add_parser("tune", add_help=False,
                          help="choose default tile shapes (fastest spill-free candidate per target)")
    tune.add_argument("tune_args", nargs=argparse.REMAINDER)
    tune.set_defaults(handler=cmd_tune)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:  # tune parses its own options (argparse's REMAINDER drops leading ones)
        from . import tune
        try:
            return tune.main(argv[1:])
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 2
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    return args.handler(args)


__all__ = ["main", "build_parser"]
