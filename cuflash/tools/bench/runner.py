"""Benchmark on the FlashAttention papers' grid, against torch SDPA when it is installed: the
forward (``mode="fwd"``), the backward (``"bwd"``, FLOPs 2.5x the forward's) or both in one timed
call (``"fwdbwd"``, 3.5x).

Grid: ``total_tokens`` tokens in all (batch = total_tokens // seqlen), hidden size ``hidden``
(heads = hidden // head_dim), seqlen_q = seqlen_k, layout bhsd, random normal inputs. FLOPs come
from :func:`cuflash.reference.attention_flops` (causal counts only the allowed pairs).

Timing is :mod:`.timing`'s; torch SDPA's backends (:mod:`.peers`) are timed in the same rounds.

FP8 (``dtype="fp8"``, forward only): cuflash on inputs quantized per tensor (e4m3 unless told,
bf16 output), and in the same run cuflash's bf16 kernel and torch SDPA (bf16) on the same values;
FLOPs as for bf16, the tables add the ratio FP8 / bf16 of cuflash. :func:`fp8_error_table` gives
FP8's error against the float64 reference (``python -m cuflash bench --fp8-errors``).
"""
from __future__ import annotations

import datetime
import json
import sys
from dataclasses import asdict

from .config import (_BOOL_OVERRIDES, _MODE_FLOPS, _OURS, BF16_PEER, DEFAULT_BWD_PEER, DEFAULT_HEAD_DIMS,
                     DEFAULT_SEQLENS, FP8, MODES, OVERHEAD_PROBLEM, PREPARED_V_PEER, BenchConfig, paper_grid,
                     parse_spec_override)
from .fp8_errors import _run_fp8_errors
from .peers import _peer_entry, _record_torch_peers, _time_interleaved, _torch_calls, import_torch, to_torch
from .report import format_line, markdown_tables, write_plot
from . import timing
from .inputs import _free_device_memory, _record_ours, parse_bench_dtype, random_inputs


class _PeakMemory:
    """Peak bytes held in CuPy's memory pool above its level at entry (a CuPy memory hook)."""

    def __init__(self):
        import cupy
        self._hook = type("_Hook", (cupy.cuda.MemoryHook,), dict(
            name="cuflash-peak", malloc_postprocess=self._malloc, free_postprocess=self._free))()
        self.current = self.peak = 0

    def _malloc(self, **kwargs):
        self.current += kwargs["mem_size"]
        self.peak = max(self.peak, self.current)

    def _free(self, **kwargs):
        self.current -= kwargs["mem_size"]

    def __enter__(self):
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hook.__exit__(*exc)


def backward_extra_bytes(q, k, v, out, lse, dout, causal) -> int:
    """Peak device bytes one cuflash backward allocates beyond its outputs (dq, dk, dv)."""
    import cupy

    import cuflash
    timing._synchronize_all()
    with _PeakMemory() as peak:
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        timing._synchronize_all()
    outputs = sum(int(g.nbytes) for g in grads)
    del grads
    cupy.get_default_memory_pool().free_all_blocks()
    return peak.peak - outputs


def _spec_for(config: BenchConfig, arch: str, overrides: dict):
    from cuflash.core.policy import default_bwd_spec, default_spec
    overrides = dict(overrides)
    family = overrides.pop("family", None)
    deterministic = overrides.pop("deterministic", False)
    if config.mode == "bwd":
        for key in _BOOL_OVERRIDES:
            overrides.pop(key, None)
        spec = default_bwd_spec(config.head_dim, config.dtype, config.causal, arch, deterministic, family)
    else:
        spec = default_spec(config.head_dim, config.dtype, config.causal, arch, family, seqlen=config.seqlen)
    return spec.replace(**overrides) if overrides else spec


def bench_config(config: BenchConfig, *, arch: str, reps: int = 30, torch=None,
                 overrides: dict | None = None, flush_l2: bool = True, fp8_format: str = "e4m3") -> dict:
    """Time cuflash (and torch SDPA's backends when ``torch`` is given) on one configuration, in
    interleaved rounds (:func:`interleaved_median_ms`); ``config.dtype == "fp8"`` goes to
    :func:`bench_fp8_config`."""
    if config.dtype == FP8:
        return bench_fp8_config(config, arch=arch, reps=reps, torch=torch, overrides=overrides, flush_l2=flush_l2,
                                fp8_format=fp8_format)
    from cuflash.reference import attention_flops

    flops = int(_MODE_FLOPS[config.mode] * attention_flops(config.batch, config.heads, config.seqlen, config.seqlen,
                                                           config.head_dim, config.causal))
    result = dict(asdict(config), direction=config.mode, flops=flops, spec=None, ms=None, tflops=None,
                  error=None, peers={}, extra_bytes=None)
    overrides = dict(overrides or {})
    try:
        spec = _spec_for(config, arch, overrides)
    except (ValueError, TypeError) as exc:
        result["error"] = str(exc)
        return result
    result["spec"] = spec.name
    forced = spec if set(overrides) - {"deterministic"} else None
    _time_config(result, config, forced, overrides, reps, torch, flush_l2)
    _free_device_memory()   # the inputs and outputs went with _time_config's frame
    return result


def _time_config(result, config, forced, overrides, reps, torch, flush_l2):
    import cuflash

    deterministic = bool(overrides.get("deterministic", False))
    q, k, v = random_inputs(config.shape, config.dtype)
    dout = random_inputs(config.shape, config.dtype, seed=1)[0] if config.mode != "fwd" else None
    if config.mode == "fwd":
        def ours_call():
            return cuflash.attention(q, k, v, causal=config.causal, spec=forced)
    elif config.mode == "bwd":
        fwd_out, fwd_lse = cuflash.attention(q, k, v, causal=config.causal, return_lse=True)

        def backward_call(deterministic, spec):
            return lambda: cuflash.attention_backward(dout, q, k, v, fwd_out, fwd_lse, causal=config.causal,
                                                      deterministic=deterministic, spec=spec)
        ours_call = backward_call(deterministic, forced)
    else:
        def with_grad_call(deterministic):
            def call():
                out, backward = cuflash.attention_with_grad(q, k, v, causal=config.causal,
                                                            deterministic=deterministic, family=overrides.get("family"))
                return out, backward(dout)
            return call
        ours_call = with_grad_call(deterministic)
    calls = {_OURS: ours_call}
    if deterministic and forced is None and config.mode != "fwd":  # the default backward in the same rounds
        calls[DEFAULT_BWD_PEER[0]] = backward_call(False, None) if config.mode == "bwd" else with_grad_call(False)

    def output():   # after the timing: the output the peers are checked against, the backward's memory
        if config.mode == "bwd":
            result["extra_bytes"] = backward_extra_bytes(q, k, v, fwd_out, fwd_lse, dout, config.causal)
        return ours_call() if config.mode == "fwd" else None

    torch_calls = _torch_calls(torch, (q, k, v), dout, config) if torch is not None else {}
    timed = _time_interleaved(calls, torch_calls, reps, flush_l2)
    ours = _record_ours(result, timed[_OURS], output)
    if DEFAULT_BWD_PEER[0] in timed:
        result["peers"][DEFAULT_BWD_PEER[0]] = _peer_entry(timed[DEFAULT_BWD_PEER[0]], result["flops"],
                                                           result["tflops"])
    _record_torch_peers(result, torch_calls, timed, ours)


def bench_fp8_config(config: BenchConfig, *, arch: str, reps: int = 30, torch=None, overrides: dict | None = None,
                     flush_l2: bool = True, fp8_format: str = "e4m3") -> dict:
    """Time cuflash's FP8 forward on one configuration (``config.dtype == "fp8"``): inputs drawn in
    bf16 and quantized per tensor to ``fp8_format``, bf16 output. In the same run: cuflash's bf16
    kernel on the bf16 inputs (peer :data:`BF16_PEER`, whose ``ratio`` is FP8 / bf16) and, when
    ``torch`` is given, torch SDPA's backends on them, all timed in interleaved rounds
    (:func:`interleaved_median_ms`). ``max_abs_diff`` of a peer is against the FP8 output."""
    from cuflash.reference import attention_flops

    flops = attention_flops(config.batch, config.heads, config.seqlen, config.seqlen, config.head_dim, config.causal)
    result = dict(asdict(config), direction=config.mode, flops=flops, fp8_format=fp8_format, spec=None, ms=None,
                  tflops=None, error=None, peers={}, extra_bytes=None)
    if config.mode != "fwd":
        result["error"] = f"FP8 attention has a forward only (mode={config.mode!r})"
        return result
    overrides = dict(overrides or {})
    overrides.pop("deterministic", None)
    try:
        spec = _spec_for(BenchConfig(config.head_dim, config.seqlen, config.causal, config.batch, config.heads,
                                     fp8_format, "fwd"), arch, overrides)
    except (ValueError, TypeError) as exc:
        result["error"] = str(exc)
        return result
    result["spec"] = spec.name
    _time_fp8(result, config, spec if overrides else None, reps, torch, flush_l2, fp8_format)
    _free_device_memory()   # the inputs and outputs went with _time_fp8's frame
    return result


def _time_fp8(result, config, forced, reps, torch, flush_l2, fp8_format):
    import cuflash

    from cuflash.fp8 import quantize_fp8

    flops = result["flops"]
    q, k, v = random_inputs(config.shape, "bf16")
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = (quantize_fp8(x, fp8_format, "tensor") for x in (q, k, v))

    def fp8_call():
        return cuflash.attention(q8, k8, v8, causal=config.causal, fp8_format=fp8_format, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale, out_dtype="bf16", spec=forced)

    def bf16_call():
        return cuflash.attention(q, k, v, causal=config.causal)

    def prepared_call():
        return cuflash.attention(q8, k8, prepared, causal=config.causal, fp8_format=fp8_format, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale, out_dtype="bf16", spec=forced)

    calls = {_OURS: fp8_call, BF16_PEER[0]: bf16_call}
    try:
        prepared = cuflash.prepare_v(v8)
        prepared_call()
        calls[PREPARED_V_PEER[0]] = prepared_call
    except (TypeError, ValueError):  # a kernel that reads V itself (or inputs off the GPU)
        pass
    torch_calls = _torch_calls(torch, (q, k, v), None, config) if torch is not None else {}
    timed = _time_interleaved(calls, torch_calls, reps, flush_l2)
    ours = _record_ours(result, timed[_OURS], fp8_call)
    bf16 = result["peers"][BF16_PEER[0]] = _peer_entry(timed[BF16_PEER[0]], flops, result["tflops"], ours, bf16_call)
    if PREPARED_V_PEER[0] in timed:
        peer = _peer_entry(timed[PREPARED_V_PEER[0]], flops, None, ours, prepared_call)
        if peer["tflops"] and bf16["tflops"]:   # FP8 on the prepared V over cuflash bf16
            peer["ratio"] = peer["tflops"] / bf16["tflops"]
        result["peers"][PREPARED_V_PEER[0]] = peer
    _record_torch_peers(result, torch_calls, timed, ours)


def measure_overhead(torch=None, calls: int = 2000) -> dict:
    """Warm host time per call on a tiny problem, where launch overhead dominates."""
    import cuflash
    p = OVERHEAD_PROBLEM
    q, k, v = random_inputs((p["batch"], p["heads"], p["seqlen"], p["head_dim"]), p["dtype"])
    us = {"cuflash": timing.host_overhead_us(lambda: cuflash.attention(q, k, v), calls=calls)}
    if torch is not None:
        qt, kt, vt = (to_torch(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        try:
            import cuflash.torch as bridge
            us["cuflash.torch"] = timing.host_overhead_us(lambda: bridge.attention(qt, kt, vt), calls=calls)
        except Exception:
            us["cuflash.torch"] = None
        try:
            us["torch SDPA"] = timing.host_overhead_us(lambda: sdpa(qt, kt, vt), calls=calls)
        except Exception:
            us["torch SDPA"] = None
    return dict(problem=p, calls=calls, us_per_call=us)


def run_benchmark(head_dims=DEFAULT_HEAD_DIMS, seqlens=DEFAULT_SEQLENS, causal=(False, True),
                  dtype="bf16", total_tokens=16384, hidden=2048, reps=30, use_torch=True,
                  spec_override=None, overhead=False, grid=True, flush_l2=True, mode="fwd", echo=print,
                  fp8_format="e4m3") -> dict:
    """Run the benchmark and return its report (the ``--json`` content); ``echo`` gets each line.
    ``dtype="fp8"`` times FP8 inputs of ``fp8_format`` (see :func:`bench_fp8_config`)."""
    from ..machine import environment
    from cuflash.core.compile import device_arch

    overrides = parse_spec_override(spec_override) if isinstance(spec_override, str) else dict(spec_override or {})
    torch = import_torch() if use_torch else None
    env = environment()
    if torch is not None:
        env["torch"] = torch.__version__
        env["cudnn"] = torch.backends.cudnn.version()
    arch = device_arch()
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        environment=env,
        settings=dict(mode=mode, dtype=dtype, total_tokens=total_tokens, hidden=hidden, reps=reps,
                      **(dict(fp8_format=fp8_format, fp8_granularity="tensor", fp8_out_dtype="bf16")
                         if dtype == FP8 else {}),
                      spec_override=overrides or None, arch=arch, flush_l2=flush_l2,
                      timing=f"median of CUDA event pairs in {timing.BENCH_ROUNDS} interleaved rounds of rotating order, "
                      f"each share after {timing.BENCH_HEAT_MS:g} ms of the same implementation's GPU work"
                      + (", L2 flushed before each" if flush_l2 else "")),
        results=[],
        overhead=None,
    )
    if use_torch and torch is None:
        echo("torch with CUDA is not importable: timing cuflash alone")
    if grid:
        for config in paper_grid(head_dims, seqlens, causal, dtype, total_tokens, hidden, mode):
            result = bench_config(config, arch=arch, reps=reps, torch=torch, overrides=overrides,
                                  flush_l2=flush_l2, fp8_format=fp8_format)
            report["results"].append(result)
            echo(format_line(result))
    if overhead:
        report["overhead"] = measure_overhead(torch)
        for key, value in report["overhead"]["us_per_call"].items():
            echo(f"host overhead {key}: " + ("n/a" if value is None else f"{value:.1f} µs per call"))
    return report


def add_arguments(parser):
    parser.add_argument("--mode", choices=MODES + ("decode", "varlen"), default="fwd",
                        help="fwd, bwd (FLOPs 2.5x the forward) or fwdbwd (3.5x); decode: KV-cache attention's "
                             "bandwidth (bf16, hd128, 32/8 heads) beside torch SDPA; varlen: packed sequences of "
                             "random lengths against a dense batch of the mean length; default fwd")
    parser.add_argument("--deterministic", action="store_true", help="bwd/fwdbwd: the deterministic backward, timed beside the default one")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(DEFAULT_HEAD_DIMS),
                        help="head dims of the grid (default: 64 128 256)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS),
                        help="sequence lengths of the grid (default: 512 to 16384)")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                        help="causal, non-causal or both (default: both)")
    parser.add_argument("--dtype", default="bf16",
                        help="fp16, bf16, fp32 or fp8 (default bf16); fp8: inputs quantized per tensor, bf16 output, "
                             "timed beside cuflash bf16 and torch SDPA bf16 (forward only)")
    parser.add_argument("--fp8-format", choices=("e4m3", "e5m2"), default="e4m3",
                        help="format of --dtype fp8 (default e4m3)")
    parser.add_argument("--fp8-errors", action="store_true",
                        help="print FP8 attention's error against the float64 reference (e4m3 and e5m2, "
                             "--head-dims, N(0,1) and outlier inputs, with and without the rotation) instead of timing")
    parser.add_argument("--total-tokens", type=int, default=16384, help="batch = total_tokens // seqlen")
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per config (median)")
    parser.add_argument("--no-torch", action="store_true", help="do not time torch SDPA even if installed")
    parser.add_argument("--no-flush-l2", action="store_true", help="keep L2 warm between repetitions")
    parser.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    parser.add_argument("--md", metavar="PATH", help="write the Markdown tables to this file")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    parser.add_argument("--spec-override", metavar="K=V,...",
                        help="force tile parameters: block_m=..,block_n=..,num_warps=..,num_stages=..")
    parser.add_argument("--family", choices=("mma", "wgmma", "simt"),
                        help="time this kernel family instead of the default one")
    parser.add_argument("--overhead", action="store_true",
                        help="also measure warm host overhead per call on a tiny problem")
    parser.add_argument("--no-grid", action="store_true", help="skip the grid, or decode's table (with --overhead)")
    parser.add_argument("--mods", action="store_true",
                        help="time attention variants instead of the grid: softcap, ALiBi, sliding window and "
                             "document mask, forward and backward, beside plain cuflash and FlexAttention (hd128 "
                             "N=16384 unless --head-dims / --seqlens are given; TFLOP/s over attended pairs)")


def _run_decode(args) -> int:
    from ..machine import environment
    from .decode import decode_overhead, decode_rows, varlen_rows

    torch = None if args.no_torch else import_torch()
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  environment=environment(), settings=dict(mode=args.mode, reps=args.reps, flush_l2=True),
                  decode=[] if args.no_grid and args.overhead else
                  decode_rows(torch, reps=args.reps) if args.mode == "decode" else varlen_rows(args.reps),
                  overhead=None)
    if args.overhead:
        report["overhead"] = decode_overhead(torch)
        for key, value in report["overhead"].items():
            print(f"host overhead {key}: " + ("n/a" if value is None else f"{value:.1f} µs per call"))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {args.json}")
    return 1 if any(r["error"] for r in report["decode"] if r["variant"].startswith("cuflash")) else 0


def run(args) -> int:
    """``python -m cuflash bench``."""
    from ..machine import causal_modes, gpu_status
    available, reason = gpu_status()
    if not available:
        print(f"cuflash bench: error: needs a CUDA GPU: {reason}", file=sys.stderr)
        return 1
    if getattr(args, "fp8_errors", False):
        return _run_fp8_errors(args)
    if args.mode in ("decode", "varlen"):
        return _run_decode(args)
    if getattr(args, "mods", False):
        from .mods import run_mods
        return run_mods(args)
    try:
        dtype = parse_bench_dtype(args.dtype, args.mode)
        spec_override = parse_spec_override(args.spec_override)
        if args.family:
            spec_override["family"] = args.family
        if args.deterministic:
            spec_override["deterministic"] = True
    except ValueError as exc:
        print(f"cuflash bench: error: {exc}", file=sys.stderr)
        return 2
    report = run_benchmark(head_dims=args.head_dims, seqlens=args.seqlens, causal=causal_modes(args.causal),
                           dtype=dtype, total_tokens=args.total_tokens, hidden=args.hidden, reps=args.reps,
                           use_torch=not args.no_torch, spec_override=spec_override,
                           overhead=args.overhead, grid=not args.no_grid, flush_l2=not args.no_flush_l2,
                           mode=args.mode, fp8_format=args.fp8_format)
    tables = markdown_tables(report)
    print()
    print(tables)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {args.json}")
    if args.md:
        with open(args.md, "w") as handle:
            handle.write(tables + "\n")
        print(f"wrote {args.md}")
    if args.plot and report["results"]:
        if write_plot(report, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("warning: matplotlib is not importable; no plot written", file=sys.stderr)
    return 1 if any(r["error"] for r in report["results"]) else 0
