"""Choosing the default tile shapes: ``python -m cuflash tune``.

For every (target, head_dim, causal) the tuner walks an ordered list of candidate tile
shapes, fastest first as measured on the H200 (the README has the timings), and keeps the first
that fits the target's shared memory and compiles without register spills. The result is
written to ``cuflash/tuned_defaults.py``, the table :func:`cuflash.spec.default_spec` reads.
Compiling needs NVRTC but no GPU. fp16 and bf16 kernels differ only in the MMA and convert
mnemonics and get the same register allocation, so one entry serves both.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import pprint
import sys
from pathlib import Path

from .spec import HEAD_DIMS, KernelSpec

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


def write_table(table: dict, path: Path = TABLE_PATH) -> None:
    body = pprint.pformat(dict(sorted(table.items())), width=100, sort_dicts=False)
    path.write_text(
        '"""Default tile shapes of the mma family, written by ``python -m cuflash tune``.\n\n'
        "Key: (arch, head_dim, causal), for fp16 and bf16 alike. Value: (block_m, block_n,\n"
        'num_warps, num_stages, overlap): the fastest candidate that fits the target and compiles\n'
        'without spills.\n"""\n'
        f"TABLE = {body}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=["sm80", "sm86", "sm89", "sm90a"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--processes", type=int, default=os.cpu_count())
    parser.add_argument("--output", type=Path, default=TABLE_PATH)
    args = parser.parse_args(argv)

    keys = [(a, d, c) for a in args.archs for d in args.head_dims for c in (False, True)]
    table, missing = {}, []
    with concurrent.futures.ProcessPoolExecutor(args.processes) as pool:
        for done, (key, choice) in enumerate(pool.map(choose, keys), 1):
            if choice is None:
                missing.append(key)
            else:
                table[key] = choice
            sys.stderr.write(f"\r{done}/{len(keys)}")
    sys.stderr.write("\n")
    write_table(table, args.output)
    print(f"wrote {len(table)} entries to {args.output}")
    for key in missing:
        print(f"no spill-free candidate for {key}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
