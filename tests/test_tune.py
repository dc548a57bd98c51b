"""The tuner's plumbing, without a GPU: candidates, the choice among timed candidates, the table
file and how default_spec reads it. (Timing itself runs on a Hopper GPU only.)"""
import pytest

from cuflash import spec as spec_mod
from cuflash import tune


@pytest.mark.parametrize("head_dim", sorted(tune.WGMMA_CANDIDATES))
@pytest.mark.parametrize("causal", [False, True])
def test_every_hopper_head_dim_has_fitting_candidates(head_dim, causal):
    specs = tune.wgmma_candidates(head_dim, causal)
    assert specs, f"no candidate fits sm90a at head_dim={head_dim}"
    assert all(s.warp_specialized and s.pingpong and s.num_warps == 4 + s.block_m // 16 for s in specs)
    assert set(tune.WGMMA_CANDIDATES) == set(spec_mod.WGMMA_DEFAULTS)
    default = spec_mod.WGMMA_DEFAULTS[head_dim]
    assert default in tune.WGMMA_CANDIDATES[head_dim], "the hand-set default must stay a candidate"


def test_tuner_keeps_the_fastest_spill_free_candidate_by_geometric_mean():
    # hd128: (128, 176, 2) is fastest at one length only; (128, 128, 3) wins on the geometric mean;
    # (128, 144, 2) would win but "spills".
    # Each candidate is timed once per length in each of three rounds; one round of (128, 128, 2)
    # ran on a fast clock, and the median over the rounds ignores it.
    rates = {(128, 128, 2): (500, 600, 550), (128, 176, 2): (300, 900, 600), (128, 128, 3): (600, 610, 605),
             (128, 144, 2): (900, 900, 900), (128, 96, 3): (100, 100, 100)}
    warmed, lines, calls = [], [], []

    def timer(spec, seqlen, reps):
        shape = (spec.block_m, spec.block_n, spec.num_stages)
        calls.append((shape, seqlen))
        fast = shape == (128, 128, 2) and calls.count((shape, seqlen)) == 2
        return (2000 if fast else 1) * rates[shape][tune.TUNE_SEQLENS.index(seqlen)]

    table = tune.tune_wgmma([128], processes=1, timer=timer, warm=warmed.extend, log=lines.append,
                            spill_free=lambda s: s.block_n != 144, rounds=3)
    assert table == {(128, False): (128, 128, 3), (128, True): (128, 128, 3)}
    assert len(warmed) == 2 * 4 and len(lines) == 2 * 4
    # rounds interleave the candidates: every candidate once per length before the next round
    assert [shape for shape, _ in calls[:4]] == [(128, 128, 2), (128, 176, 2), (128, 128, 3), (128, 96, 3)]
    assert len(calls) == 2 * 3 * 3 * 4
    assert all("TFLOP/s" in line for line in lines)


def test_writing_one_table_keeps_the_other(tmp_path):
    path = tmp_path / "tuned.py"
    tune.write_table(table={("sm80", 64, False): (128, 64, 4, 3, True)}, wgmma_table={}, path=path)
    tune.write_table(wgmma_table={(128, True): (128, 176, 2)}, path=path)
    mma, wgmma = tune._read_tables(path)
    assert mma == {("sm80", 64, False): (128, 64, 4, 3, True)}
    assert wgmma == {(128, True): (128, 176, 2)}


def test_default_spec_prefers_the_tuned_hopper_table(monkeypatch):
    from cuflash import tuned_defaults
    monkeypatch.setattr(tuned_defaults, "WGMMA_TABLE", {(128, True): (128, 176, 2)})
    tuned = spec_mod.default_spec(128, "bf16", True, "sm90a")
    assert (tuned.block_m, tuned.block_n, tuned.num_stages, tuned.num_warps) == (128, 176, 2, 12)
    plain = spec_mod.default_spec(128, "bf16", False, "sm90a")
    assert (plain.block_m, plain.block_n, plain.num_stages) == spec_mod.WGMMA_DEFAULTS[128]


def test_hopper_tuning_names_bad_head_dims_and_needs_a_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        tune.main(["--family", "wgmma", "--head-dims", "80"])
    assert exc.value.code == 2 and "80" in capsys.readouterr().err
    from cuflash.cli import gpu_status
    if not gpu_status()[0]:
        assert tune.main(["--family", "wgmma", "--head-dims", "128"]) == 1
        assert "needs a Hopper" in capsys.readouterr().err


def test_the_cli_hands_tune_its_own_options(capsys):
    from cuflash import cli
    assert cli.main(["tune", "--help"]) == 0
    assert "--family" in capsys.readouterr().out
    assert cli.main(["tune", "--family", "wgmma", "--head-dims", "80"]) == 2
    assert "80" in capsys.readouterr().err
