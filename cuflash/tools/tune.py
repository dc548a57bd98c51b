"""``python -m cuflash tune``: measure tile shapes and write them to a tuned file.

The portable family (``--family mma``, the default): for every (target, head_dim, causal) the
tuner walks the ordered candidates of ``policy.MMA_CANDIDATES`` and keeps the first that fits the
target's shared memory and compiles without register spills (NVRTC, no GPU needed). fp16 and
bf16 differ only in mnemonics and get the same registers, so one entry serves both.

The Hopper family (``--family wgmma``, on an sm_90 GPU): for every 16-bit head dim with tiles of
its own and both masks, every shape of ``policy.HOPPER_CANDIDATES`` that fits and compiles
without spills is timed on the benchmark's problems (bf16, 16k tokens, hidden 2048), and the
fastest by geometric mean over a length class's sequence lengths is kept per class.

The result is merged with the entries of ``--output`` if that file exists (else with the
shipped table) and written there, or printed when no ``--output`` is given. The installed
package is never rewritten: cuflash reads a tuned file named by the environment variable
``CUFLASH_TUNED_DEFAULTS``; the shipped ``cuflash/core/tuned_defaults.py`` is updated from a
source checkout on purpose.
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

from cuflash.core import policy
from cuflash.core.spec import HEAD_DIMS, KernelSpec

from .bench import rotated

#: The shipped table (read as the base of a merge; written only from a source checkout).
SHIPPED_TABLE = Path(policy.__file__).with_name("tuned_defaults.py")


def choose(key):
    """First spill-free candidate for (arch, head_dim, causal), or None."""
    from cuflash.core.compile import compile_offline

    arch, head_dim, causal = key
    for bm, bn, w, s, overlap in policy.mma_candidates(head_dim):
        try:
            spec = KernelSpec(head_dim, "bf16", causal, bm, bn, w, s, arch, overlap)
        except ValueError:
            continue  # does not fit this target's shared memory
        if not compile_offline(spec).spills:
            return key, (bm, bn, w, s, overlap)
    return key, None


def render_table(table: dict, wgmma_table: dict) -> str:
    """The text of a tuned file holding both tables (Python literals)."""
    body = pprint.pformat(dict(sorted(table.items())), width=100, sort_dicts=False)
    wgmma_body = pprint.pformat(dict(sorted(wgmma_table.items())), width=100, sort_dicts=False)
    return ('"""Tile shapes written by ``python -m cuflash tune`` (read by cuflash.core.policy).\n\n'
            "TABLE, the portable (mma) family. Key: (arch, head_dim, causal), for fp16 and bf16 alike.\n"
            "Value: (block_m, block_n, num_warps, num_stages, overlap): the first candidate of\n"
            "policy.MMA_CANDIDATES that fits the target and compiles without spills.\n\n"
            "WGMMA_TABLE, the warp-specialized Hopper kernel (sm90a, 16-bit). Key: (head_dim, causal,\n"
            'length class "short" or "long"). Value: (block_m, block_n, num_stages), which replaces the\n'
            "shape of the policy.HOPPER_FORWARD row of that key; the row's other switches stay.\n"
            '"""\n'
            f"TABLE = {body}\n\n"
            f"WGMMA_TABLE = {wgmma_body}\n")


def merged_tables(path: Path | None, table: dict | None = None, wgmma_table: dict | None = None):
    """The entries of ``path`` (the shipped table when it is None or missing) updated with the
    new ones."""
    base = path if path is not None and path.exists() else SHIPPED_TABLE
    current, current_wgmma = policy.read_tuned_file(base)
    return {**current, **(table or {})}, {**current_wgmma, **(wgmma_table or {})}


def _installed_package_file(path: Path) -> bool:
    """Whether ``path`` lies inside the cuflash package of an installation (not a source checkout,
    whose root holds setup.cfg and templates/)."""
    package = Path(policy.__file__).resolve().parents[1]
    checkout = package.parent
    inside = package == path.resolve().parent or package in path.resolve().parents
    return inside and not ((checkout / "setup.cfg").is_file() and (checkout / "templates").is_dir())


def emit(table: dict, wgmma_table: dict, output: Path | None, count: int, what: str) -> int:
    """Write the merged tables to ``output``, or print them; refuse the installed package."""
    merged = merged_tables(output, table, wgmma_table)
    text = render_table(*merged)
    if output is None:
        sys.stdout.write(text)
        print(f"# {count} {what} entries tuned; pass --output PATH to write them, and set "
              f"{policy.TUNED_ENV}=PATH to use them", file=sys.stderr)
        return 0
    if _installed_package_file(output):
        print(f"cuflash tune: error: {output} is inside the installed package; write the table elsewhere "
              f"and set {policy.TUNED_ENV} to it (the shipped table is updated from a source checkout)",
              file=sys.stderr)
        return 2
    output.write_text(text)
    print(f"wrote {count} {what} entries (merged with the existing ones) to {output}")
    return 0


# -- the Hopper family: timed on the GPU ------------------------------------------------------------

#: Sequence lengths the Hopper candidates are timed at, per length class (a class's score is the
#: geometric mean over its lengths), and the rounds: each round times every candidate once per
#: length, and a candidate's rate at a length is its median over the rounds, so that the clock's
#: drift within a run does not rank candidates by when they ran.
TUNE_SEQLENS = {"short": (512, 1024), "long": (2048, 4096, 16384)}
TUNE_ROUNDS = 5


def wgmma_spec(head_dim: int, causal: bool, shape) -> KernelSpec:
    bm, bn, stages = shape
    return KernelSpec(head_dim, "bf16", causal, bm, bn, 4 + bm // 16, stages, "sm90a", overlap=True,
                      family="wgmma", warp_specialized=True, pingpong=True)


def wgmma_candidates(head_dim: int, causal: bool) -> list:
    """The candidate specs that fit sm90a's shared memory (compiling weeds out spills later)."""
    specs = []
    for shape in policy.HOPPER_CANDIDATES[head_dim]:
        try:
            specs.append(wgmma_spec(head_dim, causal, shape))
        except ValueError:
            continue
    return specs


def _spill_free(spec) -> bool:
    from cuflash.core.compile import compile_offline
    return not compile_offline(spec).spills


def _tflops(spec: KernelSpec, seqlen: int, reps: int) -> float:
    """TFLOP/s of one spec on the benchmark's problem at one sequence length (GPU), timed as the
    benchmark times a share (:func:`cuflash.tools.bench.event_timer`)."""
    import cupy

    import cuflash
    from cuflash.core.dtypes import from_tag

    from .bench import cuda_event_times_ms, event_timer
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
    """Time every candidate in interleaved rounds, in the order of :func:`cuflash.tools.bench.rotated`;
    return {(head_dim, causal, length class): (block_m, block_n, num_stages)}."""
    specs = {(d, c): [s for s in wgmma_candidates(d, c) if spill_free(s)]
             for d in head_dims for c in (False, True)}
    if warm is None:
        from cuflash.core.compile import warmup
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cuflash tune",
        description="Measure tile shapes and print them, or write them to --output merged with the "
                    "entries already there. cuflash reads such a file when CUFLASH_TUNED_DEFAULTS "
                    "names it; the installed package is never rewritten.")
    parser.add_argument("--family", choices=("mma", "wgmma"), default="mma",
                        help="mma: the first spill-free tiles per target, compiled offline (default); "
                             "wgmma: time the Hopper kernel's candidates on this GPU (sm_90)")
    parser.add_argument("--archs", nargs="+", default=["sm80", "sm86", "sm89", "sm90a"],
                        help="mma: the targets to tune (default sm80 sm86 sm89 sm90a)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=None,
                        help="head dims to tune (default: every one; wgmma: those with tiles of their own)")
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="parallel compile processes")
    parser.add_argument("--reps", type=int, default=10, help="wgmma: timed repetitions per candidate")
    parser.add_argument("--output", type=Path, default=None,
                        help="write the merged table to this file (default: print it)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.family == "wgmma":
        head_dims = args.head_dims or sorted(policy.HOPPER_CANDIDATES)
        unknown = sorted(set(head_dims) - set(policy.HOPPER_CANDIDATES))
        if unknown:
            parser.error(f"--head-dims {unknown}: the warp-specialized kernel's candidates cover "
                         f"{sorted(policy.HOPPER_CANDIDATES)}")
        from cuflash.core.compile import device_arch

        from .machine import gpu_status
        available, reason = gpu_status()
        if not available or device_arch() != "sm90a":
            print(f"cuflash tune --family wgmma: needs a Hopper (sm_90) GPU ({reason or 'this one is not'})",
                  file=sys.stderr)
            return 1
        table = tune_wgmma(head_dims, args.processes, args.reps)
        return emit({}, table, args.output, len(table), "Hopper")

    unknown = sorted(set(args.head_dims or ()) - set(HEAD_DIMS))
    if unknown:
        parser.error(f"--head-dims {unknown}: head dims are multiples of 8 from 8 to 256")
    from cuflash.core.spec import ARCHS
    bad_archs = sorted(set(args.archs) - set(ARCHS))
    if bad_archs:
        parser.error(f"--archs {bad_archs}: choose from {list(ARCHS)}")
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
    code = emit(table, {}, args.output, len(table), "portable")
    for key in missing:
        print(f"no spill-free candidate for {key}", file=sys.stderr)
    return code or (1 if missing else 0)


if __name__ == "__main__":
    sys.exit(main())
