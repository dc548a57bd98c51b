"""The tuner's plumbing, without a GPU: candidates, the choice among timed candidates, the tuned
file (printed, or written where the user says, merged, never into the installed package) and how
the policy reads it through CUFLASH_TUNED_DEFAULTS. (Timing itself runs on a Hopper GPU only.)"""

import pytest

from cuflash.core import policy
from cuflash.tools import tune


@pytest.fixture
def tuned_file(monkeypatch, tmp_path):
    """Point CUFLASH_TUNED_DEFAULTS at a fresh file; the policy rereads it."""
    path = tmp_path / "tuned.py"

    def use(table=None, wgmma_table=None):
        path.write_text(tune.render_table(table or {}, wgmma_table or {}))
        monkeypatch.setenv(policy.TUNED_ENV, str(path))
        policy.tuned_tables.cache_clear()
        return path
    yield use
    monkeypatch.delenv(policy.TUNED_ENV, raising=False)
    policy.tuned_tables.cache_clear()


@pytest.mark.parametrize("head_dim", sorted(policy.HOPPER_CANDIDATES))
@pytest.mark.parametrize("causal", [False, True])
def test_every_hopper_head_dim_has_fitting_candidates(head_dim, causal):
    specs = tune.wgmma_candidates(head_dim, causal)
    assert specs, f"no candidate fits sm90a at head_dim={head_dim}"
    assert all(s.warp_specialized and s.pingpong and s.num_warps == 4 + s.block_m // 16 for s in specs)


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


def test_tuning_merges_into_the_file_the_user_names(tmp_path, capsys):
    path = tmp_path / "tuned.py"
    assert tune.emit({("sm80", 64, False): (64, 32, 4, 2, False)}, {}, path, 1, "portable") == 0
    table, wgmma = policy.read_tuned_file(path)
    shipped, _ = policy.read_tuned_file(tune.SHIPPED_TABLE)
    assert len(table) == len(shipped) and table[("sm80", 64, False)] == (64, 32, 4, 2, False)
    assert table[("sm80", 128, True)] == shipped[("sm80", 128, True)] and wgmma == {}
    assert tune.emit({}, {(128, True, "long"): (128, 176, 2)}, path, 1, "Hopper") == 0
    table, wgmma = policy.read_tuned_file(path)
    assert table[("sm80", 64, False)] == (64, 32, 4, 2, False) and wgmma == {(128, True, "long"): (128, 176, 2)}


def test_tuning_prints_without_output_and_never_rewrites_the_installed_package(capsys, monkeypatch, tmp_path):
    before = tune.SHIPPED_TABLE.read_text()
    assert tune.emit({("sm80", 64, False): (64, 32, 4, 2, False)}, {}, None, 1, "portable") == 0
    out = capsys.readouterr()
    assert "TABLE = {" in out.out and "('sm80', 64, False): (64, 32, 4, 2, False)" in out.out
    assert policy.TUNED_ENV in out.err and tune.SHIPPED_TABLE.read_text() == before
    # an installed package (no setup.cfg and templates/ beside it) refuses to be written
    package = tmp_path / "site-packages" / "cuflash"
    (package / "core").mkdir(parents=True)
    monkeypatch.setattr(policy, "__file__", str(package / "core" / "policy.py"))
    target = package / "core" / "tuned_defaults.py"
    assert tune.emit({}, {}, target, 0, "portable") == 2
    assert "installed package" in capsys.readouterr().err and not target.exists()


def test_the_policy_reads_the_tuned_file_named_by_the_environment(tuned_file):
    tuned_file({("sm80", 64, False): (64, 32, 4, 2, False)},
               {(128, True, "long"): (128, 176, 2), (128, True, "short"): (128, 96, 3)})
    assert policy.default_spec(64, "bf16", False, "sm80").block_m == 64
    short = policy.SHORT_SEQLEN
    for seqlen in (None, short + 1, 16384):
        tuned = policy.default_spec(128, "bf16", True, "sm90a", seqlen=seqlen)
        assert (tuned.block_m, tuned.block_n, tuned.num_stages, tuned.num_warps) == (128, 176, 2, 12)
        assert tuned.pingpong  # the row's other switches stay
    for seqlen in (1, short):
        tuned = policy.default_spec(128, "bf16", True, "sm90a", seqlen=seqlen)
        assert (tuned.block_m, tuned.block_n, tuned.num_stages) == (128, 96, 3)
    plain = policy.default_spec(128, "bf16", False, "sm90a", seqlen=1024)
    row = policy.hopper_rule("16bit", 128, False, "short").schedule
    assert (plain.block_m, plain.block_n, plain.num_stages) == (row.block_m, row.block_n, row.num_stages)
    # the set warmup and the tests compile holds both classes, once each
    specs = policy.all_default_specs("sm90a", ["bf16"], causal=(True,), family="wgmma")
    assert [s.name for s in specs if s.head_dim == 128] == [
        policy.default_spec(128, "bf16", True, "sm90a", seqlen=short).name,
        policy.default_spec(128, "bf16", True, "sm90a").name]
    assert len(specs) == len(set(specs))


def test_a_bad_tuned_file_is_named(monkeypatch, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("TABLE = {(")
    monkeypatch.setenv(policy.TUNED_ENV, str(bad))
    policy.tuned_tables.cache_clear()
    try:
        with pytest.raises(ValueError, match="bad.py"):
            policy.default_spec(64, "bf16", False, "sm80")
    finally:
        monkeypatch.delenv(policy.TUNED_ENV)
        policy.tuned_tables.cache_clear()


def test_select_spec_takes_the_length_class_of_the_longer_sequence(monkeypatch, tuned_file):
    from cuflash import forward
    from cuflash.core import dtypes
    from cuflash.core.validate import Problem
    tuned_file({}, {(64, True, "long"): (192, 128, 2), (64, True, "short"): (128, 128, 4)})
    monkeypatch.setattr(forward, "_arch", lambda device_id: "sm90a")
    forward._default.cache_clear()
    short = policy.SHORT_SEQLEN

    def problem(sq, sk):
        return Problem(dtype=dtypes.from_tag("bf16"), batch=1, heads=1, heads_k=1, seqlen_q=sq, seqlen_k=sk,
                       head_dim=64, causal=True, scale=0.125, layout="bhsd", device_id=0,
                       q_strides=(0, 0, 64), k_strides=(0, 0, 64), v_strides=(0, 0, 64))

    try:
        assert forward.select_spec(problem(short, 100)).block_m == 128
        assert forward.select_spec(problem(100, short + 1)).block_m == 192
        assert forward.select_spec(problem(short + 1, 100)).block_m == 192
        assert forward.select_spec(problem(64, 64)).block_m == 128
    finally:
        forward._default.cache_clear()


def test_tune_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and "--output" in out and "CUFLASH_TUNED_DEFAULTS" in out


def test_hopper_tuning_names_bad_head_dims_and_needs_a_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        tune.main(["--family", "wgmma", "--head-dims", "80"])
    assert exc.value.code == 2 and "80" in capsys.readouterr().err
    from cuflash.tools.machine import gpu_status
    if not gpu_status()[0]:
        assert tune.main(["--family", "wgmma", "--head-dims", "128"]) == 1
        assert "needs a Hopper" in capsys.readouterr().err


def test_the_cli_hands_tune_its_own_options(capsys):
    from cuflash.tools import cli
    assert cli.main(["tune", "--help"]) == 0
    assert "--family" in capsys.readouterr().out
    assert cli.main(["tune", "--family", "wgmma", "--head-dims", "80"]) == 2
    assert "80" in capsys.readouterr().err
