"""Host-side pieces of ``python -m cuflash bench --mods``: attended-pair counts and the command line."""
import numpy as np
import pytest

from cuflash.tools import cli
from cuflash.tools.bench import mods as bench_mods


def _brute_force_pairs(variant, seqlen, window, lengths):
    """Allowed (query, key) pairs of ``variant``, counted on the full boolean mask."""
    q_idx, kv_idx = np.arange(seqlen)[:, None], np.arange(seqlen)[None, :]
    ids = np.repeat(np.arange(len(lengths)), lengths)
    mask = {"plain": np.ones((seqlen, seqlen), dtype=bool), "softcap": np.ones((seqlen, seqlen), dtype=bool),
            "causal": q_idx >= kv_idx, "alibi": q_idx >= kv_idx, "sinks": q_idx >= kv_idx,
            "window": (q_idx >= kv_idx) & (q_idx - kv_idx < window),
            "document": (ids[:, None] == ids[None, :]) & (q_idx >= kv_idx)}[variant]
    return int(mask.sum())


@pytest.mark.parametrize("seqlen", [8, 17, 113, 239, 1023])
@pytest.mark.parametrize("window", [1, 5, 64, 2000])
def test_attended_pairs_match_the_mask(seqlen, window):
    lengths = bench_mods.document_lengths(seqlen, seed=seqlen)
    for variant in bench_mods.VARIANTS:
        assert bench_mods.attended_pairs(variant, seqlen, window, lengths) == _brute_force_pairs(
            variant, seqlen, window, lengths), variant


def test_document_lengths_are_fixed_positive_and_add_up():
    for seqlen in (8, 9, 1000, 16384):
        lengths = bench_mods.document_lengths(seqlen)
        assert len(lengths) == bench_mods.DOCUMENTS and sum(lengths) == seqlen and min(lengths) >= 1
        assert lengths == bench_mods.document_lengths(seqlen)
    with pytest.raises(ValueError, match="documents"):
        bench_mods.document_lengths(7)


def test_parser_accepts_mods():
    args = cli.build_parser().parse_args(["bench", "--mods", "--reps", "5", "--json", "mods.json"])
    assert args.mods and args.reps == 5 and args.json == "mods.json"
    assert not cli.build_parser().parse_args(["bench"]).mods


def test_format_of_a_row():
    row = dict(direction="fwd", dtype="bf16", head_dim=128, seqlen=16384, batch=1, heads=16, label="softcap 30",
               baseline="plain", ms=2.0, tflops=550.0, vs_plain=0.9, error=None,
               flex=dict(tflops=400.0, ratio=1.375, max_abs_diff=1e-3, error=None))
    line = bench_mods.format_mods_row(row)
    assert "550.0 TFLOP/s  0.90x plain | flex 400.0 (1.38x)" in line
    failed = dict(row, ms=None, tflops=None, vs_plain=None, error="TypeError: no score_mod\ndetails",
                  flex=dict(tflops=None, ratio=None, max_abs_diff=None, error="RuntimeError: no triton"))
    assert bench_mods.format_mods_row(failed).endswith(
        "error: TypeError: no score_mod | flex error: RuntimeError: no triton")
