"""FP8 attention's error against the float64 reference (``python -m cuflash bench --fp8-errors``)."""
from __future__ import annotations

import json

from .config import DEFAULT_HEAD_DIMS

# -- FP8 error table --------------------------------------------------------------------------
#: Problem of :func:`fp8_error_table`: per-head descales, bf16 output, not causal; the outlier
#: inputs have 4 head-dim channels of q and k 50x larger and a softmax scale of 1 / (50 sqrt(d)).
FP8_ERROR_PROBLEM = dict(batch=1, heads=2, seqlen=1024, granularity="head", out_dtype="bf16", outliers=4,
                         outlier_factor=50.0, seed=5)


def fp8_error_table(attention=None, *, head_dims=DEFAULT_HEAD_DIMS, formats=("e4m3", "e5m2"), xp=None,
                    echo=None, **problem) -> list[dict]:
    """FP8 attention's error against the float64 reference of the float inputs (before
    quantization and rotation), per head dim, format, input kind (``"N(0,1)"`` or ``"outliers"``)
    and rotation.

    ``attention(q, k, v, **kwargs)`` computes the output from FP8 codes with the keyword arguments
    of ``cuflash.attention`` (default: ``cuflash.attention`` on CuPy arrays; pass
    :func:`cuflash.reference.attention_fp8_naive`'s output with ``xp=numpy`` to run on the CPU).
    ``problem`` overrides :data:`FP8_ERROR_PROBLEM`. Each row holds ``max_error`` and
    ``mean_error`` (|out - float64 reference|), ``kernel_max_error`` (against the float64 attention
    of the dequantized inputs: what the kernel adds to quantization) and ``naive_max_error`` (the
    same error of :func:`cuflash.reference.attention_fp8_naive`, the CPU model of the kernel).
    """
    import math

    import numpy as np

    from cuflash.testing import Fp8AttentionProblem, to_numpy

    if attention is None:
        import cupy

        import cuflash
        attention, xp = cuflash.attention, cupy
    xp = np if xp is None else xp
    p = dict(FP8_ERROR_PROBLEM, **problem)
    rows = []
    for head_dim in head_dims:
        for fp8_format in formats:
            for kind in ("N(0,1)", "outliers"):
                for rotate in (False, True):
                    outliers = kind == "outliers"
                    fp8_problem = Fp8AttentionProblem(
                        p["batch"], p["heads"], p["heads"], p["seqlen"], p["seqlen"], head_dim, fp8_format,
                        p["granularity"], p["out_dtype"],
                        scale=1 / (p["outlier_factor"] * math.sqrt(head_dim)) if outliers else None,
                        outliers=p["outliers"] if outliers else 0, outlier_factor=p["outlier_factor"], rotate=rotate)
                    inputs = fp8_problem.make_inputs(xp, seed=p["seed"])
                    out = attention(inputs.q, inputs.k, inputs.v, **fp8_problem.attention_kwargs(inputs))
                    out = to_numpy(out[0] if isinstance(out, tuple) else out).astype(np.float64)
                    want, _ = fp8_problem.float_reference(inputs)
                    dequantized, _ = fp8_problem.reference(inputs)
                    naive, _ = fp8_problem.naive(inputs)
                    error = np.abs(out - want)
                    row = dict(head_dim=head_dim, fp8_format=fp8_format, inputs=kind, rotated=rotate,
                               granularity=p["granularity"], out_dtype=p["out_dtype"], seqlen=p["seqlen"],
                               max_error=float(error.max()), mean_error=float(error.mean()),
                               kernel_max_error=float(np.abs(out - dequantized).max()),
                               naive_max_error=float(np.abs(naive.astype(np.float64) - want).max()))
                    rows.append(row)
                    if echo is not None:
                        echo(format_fp8_error_line(row))
    return rows


def format_fp8_error_line(row: dict) -> str:
    rotated = "rotated" if row["rotated"] else "plain"
    return (f"fp8 {row['fp8_format']} hd{row['head_dim']} {row['inputs']} {rotated}: max error {row['max_error']:.4f}, "
            f"mean {row['mean_error']:.5f}, vs dequantized {row['kernel_max_error']:.4f}, "
            f"naive model max {row['naive_max_error']:.4f}")


def fp8_error_markdown(rows: list[dict], gpu: str | None = None) -> str:
    """The FP8 error table of docs/fp8.md: one row per (head dim, format, inputs, rotation)."""
    if not rows:
        return ""
    first = rows[0]
    lines = [f"**FP8 attention error against the float64 reference** ({gpu or 'GPU'}; {first['granularity']} "
             f"descales, {first['out_dtype']} output, seqlen {first['seqlen']}, non-causal)", "",
             "| head dim | format | inputs | rotation | max error | mean error | max error vs dequantized "
             "| naive model max error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['head_dim']} | {r['fp8_format']} | {r['inputs']} | {'yes' if r['rotated'] else 'no'} "
                     f"| {r['max_error']:.4f} | {r['mean_error']:.5f} | {r['kernel_max_error']:.4f} "
                     f"| {r['naive_max_error']:.4f} |")
    lines.append("")
    return "\n".join(lines)


def _run_fp8_errors(args) -> int:
    """``python -m cuflash bench --fp8-errors``: the error table on this GPU."""
    from ..machine import environment
    rows = fp8_error_table(head_dims=args.head_dims, echo=print)
    table = fp8_error_markdown(rows, environment().get("gpu"))
    print()
    print(table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(problem=FP8_ERROR_PROBLEM, rows=rows), handle, indent=2)
        print(f"wrote {args.json}")
    if args.md:
        with open(args.md, "w") as handle:
            handle.write(table + "\n")
        print(f"wrote {args.md}")
    return 0
