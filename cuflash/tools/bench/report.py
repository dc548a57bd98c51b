"""Reports of a benchmark run: one line per configuration, Markdown tables and a plot."""
from __future__ import annotations

from .config import BF16_PEER, DEFAULT_BWD_PEER, FP8, PREPARED_V_PEER, BenchConfig
from .peers import TORCH_BACKENDS


def _peer_labels():
    """(key, table label) of every peer a result may hold, in table order."""
    return [BF16_PEER, PREPARED_V_PEER, DEFAULT_BWD_PEER] + [(key, label) for key, (_, label) in TORCH_BACKENDS.items()]


def format_line(result: dict) -> str:
    config = BenchConfig(**{f: result[f] for f in BenchConfig.__dataclass_fields__ if f in result})
    label = config.label
    if config.dtype == FP8:
        label = label.replace(f" {FP8} ", f" {FP8} {result.get('fp8_format', 'e4m3')} ", 1)
    if result["ms"] is None:
        line = f"{label}: error: {result['error']}"
    else:
        line = f"{label}: {result['ms']:.3f} ms, {result['tflops']:.1f} TFLOP/s"
        if result.get("extra_bytes") is not None:
            qkv = config.batch * config.heads * config.seqlen * config.head_dim * 2
            line += f", extra memory {result['extra_bytes'] / 2**20:.1f} MiB ({result['extra_bytes'] / qkv:.2f}x q's bytes)"
    for key, peer in result["peers"].items():
        if peer["tflops"] is None:
            line += f" | {key} n/a"
        elif peer["ratio"] is None:
            line += f" | {key} {peer['tflops']:.1f}"
        else:
            line += f" | {key} {peer['tflops']:.1f} ({peer['ratio']:.2f}x)"
    return line


# -- reports ----------------------------------------------------------------------------------
def _fmt(value, digits=0):
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_tables(report: dict) -> str:
    """One TFLOP/s table per (head_dim, causal): implementations as rows, seqlens as columns."""
    results = report["results"]
    gpu = report["environment"].get("gpu") or "GPU"
    lines = []
    groups = []
    for r in results:
        key = (r.get("mode", "fwd"), r["dtype"], r["head_dim"], r["causal"])
        if key not in groups:
            groups.append(key)
    for mode, dtype, head_dim, causal in groups:
        rows = [r for r in results if (r.get("mode", "fwd"), r["dtype"], r["head_dim"], r["causal"])
                == (mode, dtype, head_dim, causal)]
        seqlens = [r["seqlen"] for r in rows]
        fp8_format = rows[0].get("fp8_format", "e4m3")
        note = (f"; FP8 {fp8_format} inputs quantized per tensor, bf16 output; the others bf16"
                if dtype == FP8 else "")
        lines.append(f"**{mode} {dtype} head_dim={head_dim} {'causal' if causal else 'non-causal'}** "
                     f"(TFLOP/s, {gpu}{note})")
        lines.append("")
        lines.append("| impl | " + " | ".join(str(s) for s in seqlens) + " |")
        lines.append("|---|" + "---|" * len(seqlens))
        ours = f"cuflash FP8 {fp8_format}" if dtype == FP8 else "cuflash"
        lines.append(f"| {ours} | " + " | ".join(_fmt(r["tflops"]) for r in rows) + " |")
        for key, label in _peer_labels():
            if any(key in r["peers"] for r in rows):
                cells = [_fmt(r["peers"].get(key, {}).get("tflops")) for r in rows]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if dtype == FP8:
            ratios = [r["peers"].get(BF16_PEER[0], {}).get("ratio") for r in rows]
            lines.append("| FP8 / bf16 (cuflash) | " + " | ".join("–" if x is None else f"{x:.2f}x" for x in ratios)
                         + " |")
            ratios = [r["peers"].get(PREPARED_V_PEER[0], {}).get("ratio") for r in rows]
            if any(x is not None for x in ratios):
                lines.append("| FP8, V from prepare_v / bf16 (cuflash) | "
                             + " | ".join("–" if x is None else f"{x:.2f}x" for x in ratios) + " |")
        ratios = [r["peers"].get(DEFAULT_BWD_PEER[0], {}).get("ratio") for r in rows]
        if any(x is not None for x in ratios):
            lines.append("| deterministic / default (cuflash) | "
                         + " | ".join("–" if x is None else f"{x:.2f}x" for x in ratios) + " |")
        lines.append("")
    overhead = report.get("overhead")
    if overhead:
        lines.append("**Host overhead per call** (b=1, h=1, s=16, d=64, bf16; µs)")
        lines.append("")
        lines.append("| impl | µs per call |")
        lines.append("|---|---|")
        for key, value in overhead["us_per_call"].items():
            lines.append(f"| {key} | {_fmt(value, 1)} |")
        lines.append("")
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> bool:
    """TFLOP/s vs seqlen, one panel per (head_dim, causal). False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    head_dims = sorted({r["head_dim"] for r in results})
    causal_values = sorted({r["causal"] for r in results})
    fig, axes = plt.subplots(len(causal_values), len(head_dims), squeeze=False,
                             figsize=(4.5 * len(head_dims), 3.5 * len(causal_values)))
    for row, causal in enumerate(causal_values):
        for col, head_dim in enumerate(head_dims):
            ax = axes[row][col]
            rows = [r for r in results if r["head_dim"] == head_dim and r["causal"] == causal]
            seqlens = [r["seqlen"] for r in rows]
            series = {"cuflash": [r["tflops"] for r in rows]}
            for key, label in _peer_labels():
                if any(key in r["peers"] for r in rows):
                    series[label] = [r["peers"].get(key, {}).get("tflops") for r in rows]
            for label, values in series.items():
                points = [(s, t) for s, t in zip(seqlens, values) if t is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"hd{head_dim} {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    title = f"{results[0].get('mode', 'fwd')} {results[0]['dtype']}" if results else ""
    fig.suptitle(f"{title} on {report['environment'].get('gpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
