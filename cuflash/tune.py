"""Choosing the default tile shapes: ``python -m cuflash tune``.

The portable family (``--family mma``, the default): for every (target, head_dim, causal) the
tuner walks an ordered list of candidate tile shapes, fastest first as measured on the H200 (the
README has the timings), and keeps the first that fits the target's shared memory and compiles
without register spills. Compiling needs NVRTC but no GPU. fp16 and bf16 kernels differ only in
the MMA and convert mnemonics and get the same register allocation, so one entry serves both.

The Hopper family (``--family wgmma``, on an sm_90 GPU): for every head dim with tiles of its
own on the warp-specialized kernel (``spec.WGMMA_DEFAULTS``; the others take the next wider
one's, ``spec.wgmma_tile_head_dim``) and both masks, every candidate (block_m, block_n, stages) that fits
and compiles without spills is timed on the benchmark's problems (bf16, 16k tokens, hidden 2048)
and the fastest, by geometric mean over the sequence lengths of a length class, is kept per
class: sequences up to ``spec.SHORT_SEQLEN`` ("short") and longer ones ("long").

Both tables live in ``cuflash/tuned_defaults.py``, which :func:`cuflash.spec.default_spec` reads;
writing one keeps the other.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import pprint
import statistics
import sys
from pathlib import Path

from .bench import rotated
from .spec import HEAD_DIMS, WGMMA_DEFAULTS, KernelSpec

#: Candidates per head-dim range: (largest head_dim, [(block_m, block_n, warps, stages, overlap)]),
#: fastest first. hd64: 128x64 tiles with the QK^T of the next tile overlapping the softmax;
#: hd128: 128x64/128x48 with 4 warps (32 query rows per warp); hd256: 8 warps of 16 rows.
CANDIDATES = (
    (64, [(128, 64, 4, 3, True), (128, 64, 4, 2, False), (128, 32, 4, 3, True), (128, 32, 4, 2, False),
          (64, 64, 4, 2, False), (64, 32, 4, 2, False)]),
    (128, [(128, 64, 4, 2, False), (128, 48, 4, 3, False), (128, 48, 4, 2, False), (128, 32, 4, 3, True),
           (128, 32, 4, 2, False), (64, 64, 4, 2, False), (64, 32, 4, 2, False), (64, 16, 4, 2, False)]),
    (256, [(128, 32, 8, 3, True), (128, 64, 8, 2, False), (128, 48, 8, 2, False), (128, 32, 8, 2, False),
           (64, 32, 4, 2, False), (64, 16, 4, 2, False)]),
)

TABLE_PATH = Path(__file__).with_name("tuned_defaults.py")


def candidates(head_dim: int):
    return next(rows for bound, rows in CANDIDATES if head_dim <= bound)


def choose(key):
    """First spill-free candidate for (arch, head_dim, causal), or None."""
    from .compile import compile_offline

    arch, head_dim, causal = key
    for bm, bn, w, s, overlap in candidates(head_dim):
        try:
            spec = KernelSpec(head_dim, "bf16", causal, bm, bn, w, s, arch, overlap)
        except ValueError:
            continue  # does not fit this target's shared memory
        if not compile_offline(spec).spills:
            return key, (bm, bn, w, s, overlap)
    return key, None


def write_table(table: dict | None = None, wgmma_table: dict | None = None, path: Path = TABLE_PATH) -> None:
    """Write both tables; one left as None keeps what the file holds."""
    current = _read_tables(path)
    table = current[0] if table is None else table
    wgmma_table = current[1] if wgmma_table is None else wgmma_table
    body = pprint.pformat(dict(sorted(table.items())), width=100, sort_dicts=False)
    wgmma_body = pprint.pformat(dict(sorted(wgmma_table.items())), width=100, sort_dicts=False)
    path.write_text(
        '"""Default tile shapes, written by ``python -m cuflash tune``.\n\n'
        "TABLE, the mma family. Key: (arch, head_dim, causal), for fp16 and bf16 alike. Value:\n"
        "(block_m, block_n, num_warps, num_stages, overlap): the fastest candidate that fits the\n"
        "target and compiles without spills.\n\n"
        "WGMMA_TABLE, the warp-specialized Hopper kernel (sm90a). Key: (head_dim, causal, length\n"
        'class: "short" for sequences up to spec.SHORT_SEQLEN, else "long"). Value: (block_m,\n'
        "block_n, num_stages): the fastest spill-free candidate timed on the GPU; head dims it lacks\n"
        "take spec.WGMMA_DEFAULTS, and head dims without tiles of their own the next wider one's\n"
        '(spec.wgmma_tile_head_dim).\n"""\n'
        f"TABLE = {body}\n\n"
        f"WGMMA_TABLE = {wgmma_body}\n")


def _read_tables(path: Path) -> tuple[dict, dict]:
    if not path.exists():
        return {}, {}
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # our own generated file
    return namespace.get("TABLE", {}), namespace.get("WGMMA_TABLE", {})


# -- the Hopper family: timed on the GPU ------------------------------------------------------------

#: (block_m, block_n, num_stages) tried per head dim; 3 consumer warpgroups when block_m is 192.
WGMMA_CANDIDATES = {
    64: [(192, 128, 2), (192, 128, 3), (192, 96, 4), (128, 128, 2), (128, 128, 4), (128, 192, 3)],
    96: [(128, 128, 2), (128, 176, 2), (128, 128, 3), (128, 96, 3)],
    128: [(128, 128, 2), (128, 176, 2), (128, 144, 2), (128, 128, 3), (128, 96, 3)],
    192: [(128, 96, 2), (128, 112, 2), (128, 64, 3)],
    256: [(128, 80, 2), (128, 64, 2), (128, 48, 3)],
}
#: Sequence lengths the Hopper candidates are timed at, per length class (a class's score is the
#: geometric mean over its lengths), and the rounds: each round times every candidate once per
#: length, and a candidate's rate at a length is its median over the rounds. Interleaving
#: matters: the H200's clock moves by up to ~15% within a run, so candidates timed one after the
#: other were ranked by when they ran.
TUNE_SEQLENS = {"short": (512, 1024), "long": (2048, 4096, 16384)}
TUNE_ROUNDS = 5


def wgmma_spec(head_dim: int, causal: bool, shape) -> KernelSpec:
    bm, bn, stages = shape
    return KernelSpec(head_dim, "bf16", causal, bm, bn, 4 + bm // 16, stages, "sm90a", overlap=True,
                      family="wgmma", warp_specialized=True, pingpong=True)


def wgmma_candidates(head_dim: int, causal: bool) -> list:
    """The candidate specs that fit sm90a's shared memory (compiling weeds out spills later)."""
    specs = []
    for shape in WGMMA_CANDIDATES[head_dim]:
        try:
            specs.append(wgmma_spec(head_dim, causal, shape))
        except ValueError:
            continue
    return specs


def _spill_free(spec) -> bool:
    from .compile import compile_offline
    return not compile_offline(spec).spills


def _tflops(spec: KernelSpec, seqlen: int, reps: int) -> float:
    """TFLOP/s of one spec on the benchmark's problem at one sequence length (GPU), timed as the
    benchmark times a share (:func:`cuflash.bench.event_timer`: after ``BENCH_HEAT_MS`` of its own
    calls, so that it runs on the clock of its own load)."""
    import cupy

    import cuflash
    from .bench import cuda_event_times_ms, event_timer
    from .dtypes import from_tag
    d = spec.head_dim
    batch, heads = max(16384 // seqlen, 1), max(2048 // d, 1)
    q, k, v = (cupy.random.standard_normal((batch, heads, seqlen, d), dtype=cupy.float32)
               .astype(from_tag("bf16").numpy) for _ in range(3))
    ms = statistics.median(event_timer(cuda_event_times_ms, lambda: cuflash.attention(q, k, v, causal=spec.causal,
                                                                                       spec=spec))(reps))
    flops = 4 * batch * heads * seqlen * seqlen * d / (2 if spec.causal else 1)
    return flops / ms / 1e9


def tune_wgmma(head_dims, processes: int, reps: int = 10, timer=_tflops, spill_free=_spill_free,
               warm=None, log=print, rounds: int = TUNE_ROUNDS) -> dict:
    """Time every candidate in interleaved rounds, in the order of :func:`cuflash.bench.rotated`;
    return {(head_dim, causal, length class): (block_m,
    block_n, num_stages)}."""
    specs = {(d, c): [s for s in wgmma_candidates(d, c) if spill_free(s)]
             for d in head_dims for c in (False, True)}
    if warm is None:
        from .compile import warmup
        warm = lambda all_specs: warmup(all_specs, processes=processes, progress=False)  # noqa: E731
    warm([s for row in specs.values() for s in row])
    lengths = [n for group in TUNE_SEQLENS.values() for n in group]
    table = {}
    for key, row in specs.items():
        samples = {(spec, n): [] for spec in row for n in lengths}
        for round_index in range(rounds):
            for n in lengths:
                for spec in rotated(row, round_index):
                    samples[spec, n].append(timer(spec, n, reps))
        rate = {(spec, n): statistics.median(samples[spec, n]) for spec in row for n in lengths}
        for spec in row:
            log(f"hd{key[0]} {'causal' if key[1] else 'full'} m{spec.block_m}n{spec.block_n}s{spec.num_stages}: "
                + " ".join(f"{n}={rate[spec, n]:.1f}" for n in lengths) + " TFLOP/s")
        for length, group in TUNE_SEQLENS.items():
            if row:
                best = max(row, key=lambda spec: sum(math.log(rate[spec, n]) for n in group))
                table[(*key, length)] = (best.block_m, best.block_n, best.num_stages)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("mma", "wgmma"), default="mma",
                        help="mma: spill-free tiles per target, offline (default); wgmma: time the Hopper "
                             "kernel's candidates on this GPU (sm_90)")
    parser.add_argument("--archs", nargs="+", default=["sm80", "sm86", "sm89", "sm90a"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=None)
    parser.add_argument("--processes", type=int, default=os.cpu_count())
    parser.add_argument("--reps", type=int, default=10, help="wgmma: timed repetitions per candidate")
    parser.add_argument("--output", type=Path, default=TABLE_PATH)
    args = parser.parse_args(argv)

    if args.family == "wgmma":
        head_dims = args.head_dims or sorted(WGMMA_DEFAULTS)
        unknown = sorted(set(head_dims) - set(WGMMA_CANDIDATES))
        if unknown:
            parser.error(f"--head-dims {unknown}: the warp-specialized kernel's candidates cover {sorted(WGMMA_CANDIDATES)}")
        from .cli import gpu_status
        from .compile import device_arch
        available, reason = gpu_status()
        if not available or device_arch() != "sm90a":
            print(f"cuflash tune --family wgmma: needs a Hopper (sm_90) GPU ({reason or 'this one is not'})",
                  file=sys.stderr)
            return 1
        table = tune_wgmma(head_dims, args.processes, args.reps)
        write_table(wgmma_table={**_read_tables(args.output)[1], **table}, path=args.output)
        print(f"wrote {len(table)} Hopper entries to {args.output}")
        return 0

    head_dims = args.head_dims or list(HEAD_DIMS)
    keys = [(a, d, c) for a in args.archs for d in head_dims for c in (False, True)]
    table, missing = {}, []
    with concurrent.futures.ProcessPoolExecutor(args.processes) as pool:
        for done, (key, choice) in enumerate(pool.map(choose, keys), 1):
            if choice is None:
                missing.append(key)
            else:
                table[key] = choice
            sys.stderr.write(f"\r{done}/{len(keys)}")
    sys.stderr.write("\n")
    write_table(table=table, path=args.output)
    print(f"wrote {len(table)} entries to {args.output}")
    for key in missing:
        print(f"no spill-free candidate for {key}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
