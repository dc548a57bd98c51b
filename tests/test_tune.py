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


def test_tuner_keeps_the_fastest_spill_free_candidate_per_length_class():
    # hd128, rates at (512, 1k, 2k, 4k, 16k). Short: (128, 96, 3) wins; long: (128, 176, 2) is fastest
    # at 16k only, (128, 128, 3) wins on the geometric mean; (128, 144, 2) would win both but "spills".
    rates = {(128, 128, 2): (500, 500, 500, 500, 600), (128, 176, 2): (300, 300, 300, 300, 900),
             (128, 128, 3): (400, 400, 600, 600, 610), (128, 144, 2): (900, 900, 900, 900, 900),
             (128, 96, 3): (520, 520, 100, 100, 100)}
    lengths = [n for group in tune.TUNE_SEQLENS.values() for n in group]
    assert lengths == [512, 1024, 2048, 4096, 16384]
    warmed, lines, calls = [], [], []

    def timer(spec, seqlen, reps):
        # One round of (128, 128, 2) runs on a fast clock: the median over the rounds ignores it.
        shape = (spec.block_m, spec.block_n, spec.num_stages)
        calls.append((shape, seqlen))
        fast = shape == (128, 128, 2) and calls.count((shape, seqlen)) == 2
        return (2000 if fast else 1) * rates[shape][lengths.index(seqlen)]

    table = tune.tune_wgmma([128], processes=1, timer=timer, warm=warmed.extend, log=lines.append,
                            spill_free=lambda s: s.block_n != 144, rounds=3)
    assert table == {(128, c, length): shape for c in (False, True)
                     for length, shape in (("short", (128, 96, 3)), ("long", (128, 128, 3)))}
    assert len(warmed) == 2 * 4 and len(lines) == 2 * 4
    assert all("TFLOP/s" in line for line in lines)
    # rounds interleave the candidates: every candidate once per length before the next round,
    # each round starting one candidate further on
    assert [shape for shape, _ in calls[:4]] == [(128, 128, 2), (128, 176, 2), (128, 128, 3), (128, 96, 3)]
    assert [shape for shape, _ in calls[20:24]] == [(128, 176, 2), (128, 128, 3), (128, 96, 3), (128, 128, 2)]
    assert len(calls) == 2 * 3 * 4 * 5


def test_writing_one_table_keeps_the_other(tmp_path):
    path = tmp_path / "tuned.py"
    tune.write_table(table={("sm80", 64, False): (128, 64, 4, 3, True)}, wgmma_table={}, path=path)
    tune.write_table(wgmma_table={(128, True, "long"): (128, 176, 2)}, path=path)
    mma, wgmma = tune._read_tables(path)
    assert mma == {("sm80", 64, False): (128, 64, 4, 3, True)}
    assert wgmma == {(128, True, "long"): (128, 176, 2)}


def test_default_spec_prefers_the_tuned_hopper_table_of_the_length_class(monkeypatch):
    from cuflash import tuned_defaults
    monkeypatch.setattr(tuned_defaults, "WGMMA_TABLE", {(128, True, "long"): (128, 176, 2),
                                                        (128, True, "short"): (128, 96, 3)})
    short = spec_mod.SHORT_SEQLEN
    for seqlen in (None, short + 1, 16384):
        tuned = spec_mod.default_spec(128, "bf16", True, "sm90a", seqlen=seqlen)
        assert (tuned.block_m, tuned.block_n, tuned.num_stages, tuned.num_warps) == (128, 176, 2, 12)
    for seqlen in (1, short):
        tuned = spec_mod.default_spec(128, "bf16", True, "sm90a", seqlen=seqlen)
        assert (tuned.block_m, tuned.block_n, tuned.num_stages) == (128, 96, 3)
    plain = spec_mod.default_spec(128, "bf16", False, "sm90a", seqlen=1024)
    assert (plain.block_m, plain.block_n, plain.num_stages) == spec_mod.WGMMA_DEFAULTS[128]
    # the set warmup and the tests compile holds both classes, once each
    specs = spec_mod.all_default_specs("sm90a", ["bf16"], causal=(True,), family="wgmma")
    assert [s.name for s in specs if s.head_dim == 128] == [
        spec_mod.default_spec(128, "bf16", True, "sm90a", seqlen=short).name,
        spec_mod.default_spec(128, "bf16", True, "sm90a").name]
    assert len(specs) == len(set(specs))


def test_select_spec_takes_the_length_class_of_the_longer_sequence(monkeypatch):
    from cuflash import api, dtypes, tuned_defaults
    from cuflash.validate import Problem
    monkeypatch.setattr(tuned_defaults, "WGMMA_TABLE", {(64, True, "long"): (192, 128, 2),
                                                        (64, True, "short"): (128, 128, 4)})
    monkeypatch.setattr(api, "_arch", lambda device_id: "sm90a")
    api._default.cache_clear()
    short = spec_mod.SHORT_SEQLEN

    def problem(sq, sk):
        return Problem(dtype=dtypes.from_tag("bf16"), batch=1, heads=1, heads_k=1, seqlen_q=sq, seqlen_k=sk,
                       head_dim=64, causal=True, scale=0.125, layout="bhsd", device_id=0,
                       q_strides=(0, 0, 64), k_strides=(0, 0, 64), v_strides=(0, 0, 64))

    try:
        assert api.select_spec(problem(short, 100)).block_m == 128
        assert api.select_spec(problem(100, short + 1)).block_m == 192
        assert api.select_spec(problem(short + 1, 100)).block_m == 192
        assert api.select_spec(problem(64, 64)).block_m == 128
    finally:
        api._default.cache_clear()


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
