"""The command line, called in-process through ``cuflash.tools.cli.main``.

Most tests run on any machine. The "no GPU" tests check what a machine without a usable CUDA
device gets and skip where one is present; the ``gpu`` tests do the reverse.
"""
import importlib
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash.core.policy import default_spec
from cuflash.tools import bench, cli, machine

REPO_ROOT = Path(__file__).resolve().parent.parent


def _gpu_present() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


GPU = _gpu_present()
needs_no_gpu = pytest.mark.skipif(GPU, reason="a CUDA GPU is present; this checks the no-GPU path")
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")


def test_help_lists_subcommands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("info", "generate", "warmup", "demo", "bench", "tune"):
        assert command in out


def test_tune_parses_its_own_options(capsys):
    assert cli.main(["tune", "--help"]) == 0
    assert "--output" in capsys.readouterr().out
    assert cli.main(["tune", "--head-dims", "100"]) == 2
    assert "--head-dims [100]" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "cuflash", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout


def test_unknown_subcommand_is_a_usage_error(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


# -- generate ---------------------------------------------------------------------------------
def test_generate_prints_source_named_after_the_spec(capsys):
    code = cli.main(["generate", "--head-dim", "128", "--dtype", "bf16", "--causal", "--arch", "sm90a"])
    assert code == 0
    out = capsys.readouterr().out
    assert default_spec(128, "bf16", True, "sm90a").name in out
    assert "__global__" in out


def test_generate_applies_tile_overrides(capsys):
    code = cli.main(["generate", "--head-dim", "64", "--dtype", "fp16", "--arch", "sm80",
                     "--block-m", "64", "--block-n", "32", "--num-warps", "4", "--num-stages", "3"])
    assert code == 0
    expected = default_spec(64, "fp16", False, "sm80").replace(block_m=64, block_n=32, num_warps=4, num_stages=3)
    assert expected.name in capsys.readouterr().out


def test_generate_writes_a_file(tmp_path, capsys):
    target = tmp_path / "kernel.cu"
    code = cli.main(["generate", "--head-dim", "96", "--dtype", "fp32", "--arch", "sm80", "-o", str(target)])
    assert code == 0
    name = default_spec(96, "fp32", False, "sm80").name
    assert name in target.read_text()
    out = capsys.readouterr().out
    assert str(target) in out and name in out


@pytest.mark.parametrize("argv, named", [
    (["--head-dim", "100"], "head_dim=100"),
    (["--head-dim", "512"], "head_dim=512"),
    (["--head-dim", "128", "--dtype", "fp64"], "fp64"),
    (["--head-dim", "128", "--arch", "sm70"], "sm70"),
    (["--head-dim", "128", "--block-n", "20"], "block_n=20"),
])
def test_generate_rejects_bad_values_with_exit_2(argv, named, capsys):
    if "--arch" not in argv:
        argv = [*argv, "--arch", "sm90a"]
    code = cli.main(["generate", *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert named in err
    assert "Traceback" not in err


def test_generate_the_readme_command(capsys):
    argv = ["generate", "--head-dim", "64", "--dtype", "fp16", "--block-m", "64", "--block-n", "64",
            "--num-stages", "3", "--overlap", "1"]
    assert cli.main([*argv, "--arch", "sm80"]) == 0
    expected = default_spec(64, "fp16", False, "sm80").replace(block_m=64, block_n=64, num_stages=3, overlap=True)
    assert expected.name in capsys.readouterr().out


def test_generate_without_arch_names_the_default_target_when_it_rejects(monkeypatch, capsys):
    # Without a GPU the target is sm90a, whose warp-specialized kernel takes no 64-row tile.
    monkeypatch.setattr(machine, "gpu_status", lambda: (False, "no GPU in this test"))
    argv = ["generate", "--head-dim", "64", "--dtype", "fp16", "--block-m", "64", "--block-n", "64",
            "--num-stages", "3", "--overlap", "1"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "block_m=64" in captured.err and cli.FALLBACK_ARCH in captured.err and "--arch" in captured.err
    assert "Traceback" not in captured.err


def test_every_option_has_help():
    import argparse
    (commands,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name in ("info", "generate", "warmup", "demo"):
        undocumented = [o.option_strings for o in commands.choices[name]._actions if o.option_strings and not o.help]
        assert undocumented == [], name


def test_warmup_help_states_the_defaults(capsys):
    assert cli.main(["warmup", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "default: fp16 bf16 fp32" in out and "default: both" in out and "default: all, 8 to 256" in out


# -- without CuPy ------------------------------------------------------------------------------
@pytest.fixture
def no_cupy(monkeypatch):
    """``import cupy`` (and of its submodules) raises ImportError, as where CuPy is not installed."""
    for name in [n for n in sys.modules if n == "cupy" or n.startswith("cupy.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "cupy", None)


def test_demo_without_cupy_says_what_is_missing(no_cupy, capsys):
    assert cli.main(["demo"]) == 1
    captured = capsys.readouterr()
    assert "CuPy is not installed" in captured.err and "NVRTC" in captured.err
    assert 'pip install "cuflash[cuda13]"' in captured.err and '"cuflash[cuda12]"' in captured.err
    assert "Traceback" not in captured.err and "None" not in captured.out + captured.err


def test_info_without_cupy_stays_clean(no_cupy, capsys):
    import cuflash
    assert cli.main(["info"]) == 0
    captured = capsys.readouterr()
    install = re.escape('not installed; install with pip install "cuflash[cuda13]"')
    assert re.search(rf"^cupy\s+{install}", captured.out, re.MULTILINE)
    assert re.search(r"^NVRTC\s+not found", captured.out, re.MULTILINE)
    assert f"({Path(cuflash.__file__).resolve().parent})" in captured.out
    assert captured.err == ""
    assert cli.main(["info", "--head-dim", "128", "--arch", "sm90a"]) == 0  # choosing kernels needs no CuPy
    assert "fwd_bf16_hd128_" in capsys.readouterr().out


def test_generate_and_warmup_without_cupy(no_cupy, tmp_path, capsys):
    target = tmp_path / "kernel.cu"
    assert cli.main(["generate", "--head-dim", "64", "--arch", "sm80", "-o", str(target)]) == 0
    assert "__global__" in target.read_text()
    assert cli.main(["warmup", "--head-dims", "64"]) == 1
    err = capsys.readouterr().err
    assert "CuPy" in err and "cuflash[cuda13]" in err and "Traceback" not in err


# -- info / warmup / demo / bench without a GPU ------------------------------------------------
@needs_no_gpu
def test_info_without_gpu_says_so(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GPU" in out and "none" in out
    assert "cache dir" in out and "cached kernels" in out
    import cuflash
    assert re.search(rf"^cuflash\s+{re.escape(cuflash.__version__)} ", out, re.MULTILINE)


@needs_no_gpu
def test_warmup_without_gpu_exits_1(capsys):
    assert cli.main(["warmup", "--head-dims", "64", "--dtypes", "bf16"]) == 1
    assert "GPU" in capsys.readouterr().err


@needs_no_gpu
def test_demo_without_gpu_compiles_offline(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU" in out
    assert default_spec(128, "bf16", True, "sm90a").name in out
    assert "registers per thread" in out
    assert "max |out difference|" in out


@needs_no_gpu
def test_bench_without_gpu_exits_1(capsys):
    assert cli.main(["bench", "--head-dims", "64", "--seqlens", "512"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    for mode in ("decode", "varlen"):
        assert cli.main(["bench", "--mode", mode]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_varlen_lengths_add_up_within_their_range():
    import numpy as np

    from cuflash.tools.bench.decode import varlen_lengths
    for seed in range(20):
        lens = varlen_lengths(np.random.default_rng(seed))
        assert 16384 - 100 < sum(lens) <= 16384 and all(100 <= n <= 4000 for n in lens)


# -- benchmark helpers that need no GPU --------------------------------------------------------
def _bench_modules():
    """cuflash.tools.bench and each of its submodules."""
    return [bench] + [importlib.import_module(f"{bench.__name__}.{info.name}")
                      for info in pkgutil.iter_modules(bench.__path__)]


def _bench_attribute(name):
    """``name`` from whichever bench module defines it."""
    (value,) = {id(getattr(m, name)): getattr(m, name) for m in _bench_modules() if hasattr(m, name)}.values()
    return value


def _patch_bench(monkeypatch, name, value):
    """Replace ``name`` in every bench module that holds it, so calls between the modules see the fake."""
    holders = [m for m in _bench_modules() if hasattr(m, name)]
    assert holders, f"no bench module has {name}"
    for module in holders:
        monkeypatch.setattr(module, name, value)


def test_paper_grid_follows_the_flashattention_papers():
    grid = bench.paper_grid(head_dims=(64, 128), seqlens=(512, 4096, 16384), causal=(False, True))
    assert len(grid) == 2 * 3 * 2
    by_key = {(c.head_dim, c.seqlen, c.causal): c for c in grid}
    config = by_key[(128, 4096, True)]
    assert (config.batch, config.heads) == (4, 16)
    assert by_key[(64, 16384, False)].batch == 1 and by_key[(64, 16384, False)].heads == 32
    assert all(c.batch * c.seqlen == 16384 for c in grid)


def test_parse_spec_override():
    assert bench.parse_spec_override("block_m=64, block_n=32,num_warps=4,num_stages=3") == dict(
        block_m=64, block_n=32, num_warps=4, num_stages=3)
    assert bench.parse_spec_override(None) == {}
    with pytest.raises(ValueError, match="head_dim"):
        bench.parse_spec_override("head_dim=64")
    with pytest.raises(ValueError, match="block_m"):
        bench.parse_spec_override("block_m=big")


def test_bench_split_reps_over_rounds():
    assert bench.split_reps(30, 5) == [6] * 5 and bench.split_reps(32, 5) == [7, 7, 6, 6, 6]
    assert bench.split_reps(2, 5) == [1, 1] and bench.split_reps(1, 5) == [1]
    for reps in range(1, 40):
        shares = bench.split_reps(reps, bench.BENCH_ROUNDS)
        assert sum(shares) == reps and min(shares) >= 1 and max(shares) - min(shares) <= 1


def test_bench_interleaved_rounds_with_fake_timers():
    order = []

    def timer(name, fail_at_call=None):
        values = iter(range(1, 100))   # the repetitions' ms: 1, 2, 3, ... in the order timed
        calls = 0

        def time(reps):
            nonlocal calls
            calls += 1
            order.append((name, reps))
            if calls == fail_at_call:
                raise RuntimeError("no kernel\nsecond line")
            return [next(values) for _ in range(reps)]
        return time

    timed = bench.interleaved_median_ms({"a": timer("a"), "b": timer("b", fail_at_call=2), "c": timer("c")},
                                        reps=7, rounds=3)
    # 3 + 2 + 2 repetitions, each round starting one further on; "b" raised in the second round (its
    # first share there) and was left out of the third.
    assert order == [("a", 3), ("b", 3), ("c", 3), ("b", 2), ("c", 2), ("a", 2), ("c", 2), ("a", 2)]
    # The median over all 7 repetitions (1..7), not the median of the rounds' medians (2, 4.5, 6.5).
    assert timed["a"] == timed["c"] == 4
    assert isinstance(timed["b"], RuntimeError) and str(timed["b"]).startswith("no kernel")
    assert list(timed) == ["a", "b", "c"]


def test_bench_event_timer_heats_each_share_on_the_last_call_time():
    seen = []
    ms = iter([[2.0], [2.0] * 4, [0.5] * 2, [100.0] * 2, [1.0]])

    def times_ms(fn, reps, warmup, flush_l2):
        seen.append((reps, warmup, flush_l2))
        return next(ms)

    timer = bench.event_timer(times_ms, lambda: None, flush_l2=False, heat_ms=10.0)
    assert timer(4) == [2.0] * 4 and timer(2) == [0.5] * 2 and timer(2) == [100.0] * 2 and timer(1) == [1.0]
    # First use: 3 warm-up calls and one timed call (2 ms); then before each share 10 ms of calls
    # at the median of the share before (2, 2, 0.5 and 100 ms), and at least one call.
    assert seen == [(1, 3, False), (4, 5, False), (2, 5, False), (2, 20, False), (1, 1, False)]
    tiny = bench.event_timer(lambda fn, reps, warmup, flush_l2: seen.append(warmup) or [0.0] * reps, lambda: None)
    tiny(1), tiny(1)
    assert seen[-1] == _bench_attribute("_MAX_HEAT_CALLS")


def test_bench_config_times_cuflash_and_torch_peers_interleaved(monkeypatch):
    import numpy as np

    import cuflash
    order = []
    fail = {}

    def attention(q, k, v, *, causal=False, spec=None):
        if "cuflash" in fail:
            raise fail["cuflash"]
        return np.full(q.shape, 0.25, dtype=np.float32)

    def torch_sdpa(torch, key, q, k, v, causal, mode="fwd", dout=None):
        if key == "cudnn":
            raise RuntimeError("no cuDNN kernel\nfor these inputs")
        return lambda: np.full(q.shape, 0.5, dtype=np.float32)

    def fake_times(label, ms):
        def times(fn, reps=30, warmup=3, flush_l2=True):
            order.append(label)
            fn()
            return [ms] * reps
        return times

    monkeypatch.setattr(cuflash, "attention", attention)
    _patch_bench(monkeypatch, "random_inputs", lambda shape, tag, seed=0: tuple(
        np.random.default_rng(seed + i).standard_normal(shape, dtype=np.float32) for i in range(3)))
    _patch_bench(monkeypatch, "_torch_sdpa", torch_sdpa)
    for name in ("to_torch", "_from_torch"):
        _patch_bench(monkeypatch, name, lambda x: x)
    _patch_bench(monkeypatch, "_synchronize_all", lambda: None)
    _patch_bench(monkeypatch, "_free_device_memory", lambda: None)
    _patch_bench(monkeypatch, "cuda_event_times_ms", fake_times("cuflash", 2.0))
    _patch_bench(monkeypatch, "torch_event_times_ms", fake_times("torch", 4.0))
    config = bench.BenchConfig(128, 1024, True, 16, 16, "bf16")
    result = bench.bench_config(config, arch="sm90a", reps=10, torch=object())
    # cuflash and torch flash alternate over the rounds, in the order (cuflash, flash, cudnn) turned
    # one further each round, each first timing one call for its heat; cuDNN's call, which could not
    # be built, raised in the first round and was left out of the others.
    assert bench.BENCH_ROUNDS == 5
    assert order == (["cuflash", "cuflash", "torch", "torch", "torch"] + ["torch", "cuflash"] + ["cuflash", "torch"]
                     + ["cuflash", "torch"] + ["torch", "cuflash"])
    assert result["error"] is None and result["ms"] == 2.0
    assert result["tflops"] == pytest.approx(result["flops"] / 2.0 / 1e9)
    flash, cudnn = result["peers"]["flash"], result["peers"]["cudnn"]
    assert flash["ms"] == 4.0 and flash["ratio"] == pytest.approx(2.0) and flash["max_abs_diff"] == 0.25
    assert flash["error"] is None
    assert cudnn == dict(ms=None, tflops=None, ratio=None, max_abs_diff=None, error="RuntimeError: no cuDNN kernel")
    assert bench.format_line(result).endswith("| flash {:.1f} (2.00x) | cudnn n/a".format(flash["tflops"]))

    # cuflash failing: its error (the whole message, as before), the peer still timed in every round.
    order.clear()
    fail["cuflash"] = ValueError("no kernel\nfor this shape")
    result = bench.bench_config(config, arch="sm90a", reps=10, torch=object())
    assert result["error"] == "ValueError: no kernel\nfor this shape" and result["ms"] is None
    assert order == ["cuflash", "torch", "torch", "torch"] + ["torch"] * (bench.BENCH_ROUNDS - 1)
    flash = result["peers"]["flash"]
    assert flash["ms"] == 4.0 and flash["ratio"] is None and flash["max_abs_diff"] is None


def test_bench_times_the_deterministic_backward_beside_the_default_one(monkeypatch):
    import numpy as np

    import cuflash
    calls = []

    def attention(q, k, v, *, causal=False, return_lse=False, spec=None):
        return np.zeros(q.shape, np.float32), np.zeros(q.shape[:3], np.float32)

    def attention_backward(dout, q, k, v, out, lse, *, causal=False, deterministic=False, spec=None):
        calls.append(deterministic)
        return q, k, v

    def fake_times(fn, reps=30, warmup=3, flush_l2=True):
        before = len(calls)
        fn()
        return [3.0 if calls[before] else 2.0] * reps

    monkeypatch.setattr(cuflash, "attention", attention)
    monkeypatch.setattr(cuflash, "attention_backward", attention_backward)
    _patch_bench(monkeypatch, "random_inputs", lambda shape, tag, seed=0: tuple(
        np.random.default_rng(seed + i).standard_normal(shape, dtype=np.float32) for i in range(3)))
    _patch_bench(monkeypatch, "backward_extra_bytes", lambda *args: 0)
    _patch_bench(monkeypatch, "_synchronize_all", lambda: None)
    _patch_bench(monkeypatch, "_free_device_memory", lambda: None)
    _patch_bench(monkeypatch, "cuda_event_times_ms", fake_times)
    config = bench.BenchConfig(128, 1024, True, 16, 16, "bf16", "bwd")
    result = bench.bench_config(config, arch="sm90a", reps=10, overrides={"deterministic": True})
    assert result["ms"] == 3.0 and set(calls) == {True, False}
    peer = result["peers"]["cuflash-default"]
    assert peer["ms"] == 2.0 and peer["ratio"] == pytest.approx(2.0 / 3.0)
    assert "| cuflash-default" in bench.format_line(result) and "(0.67x)" in bench.format_line(result)
    tables = bench.markdown_tables(dict(environment=dict(gpu="Test GPU"), results=[result], overhead=None))
    assert "| cuflash, not deterministic |" in tables and "| deterministic / default (cuflash) | 0.67x |" in tables
    # without --deterministic, no such peer
    calls.clear()
    result = bench.bench_config(config, arch="sm90a", reps=10)
    assert "cuflash-default" not in result["peers"] and set(calls) == {False}


def _fake_result(seqlen, tflops, flash, cudnn):
    config = bench.BenchConfig(head_dim=128, seqlen=seqlen, causal=True, batch=16384 // seqlen, heads=16, dtype="bf16")
    result = dict(config.__dict__, direction="fwd", flops=1, spec="fwd_bf16_hd128_causal_m128n64w4s2_sm90a",
                  ms=1.234, tflops=tflops, error=None, peers={})
    for key, value in (("flash", flash), ("cudnn", cudnn)):
        result["peers"][key] = dict(ms=None if value is None else 2.0, tflops=value,
                                    ratio=None if value is None else tflops / value,
                                    max_abs_diff=None, error=None if value else "RuntimeError: no kernel")
    return result


def test_report_formatting():
    results = [_fake_result(4096, 612.5, 345.1, 600.2), _fake_result(8192, 620.0, 350.0, None)]
    line = bench.format_line(results[0])
    assert line == ("fwd bf16 hd128 causal N=4096 b=4 h=16: 1.234 ms, 612.5 TFLOP/s "
                    "| flash 345.1 (1.77x) | cudnn 600.2 (1.02x)")
    assert bench.format_line(results[1]).endswith("| cudnn n/a")
    report = dict(environment=dict(gpu="Test GPU"), results=results, overhead=None)
    tables = bench.markdown_tables(report)
    assert "**fwd bf16 head_dim=128 causal** (TFLOP/s, Test GPU)" in tables
    assert "| impl | 4096 | 8192 |" in tables
    assert "| cuflash | 612 | 620 |" in tables or "| cuflash | 613 | 620 |" in tables
    assert "| torch SDPA cuDNN | 600 | – |" in tables
    json.dumps(report)


# -- with a GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
def test_info_with_gpu(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "compute capability" in out and "compile target" in out


@pytest.mark.gpu
@needs_gpu
def test_demo_with_gpu_checks_against_reference(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert ": ok" in out and "TFLOP/s" in out


@pytest.mark.gpu
@needs_gpu
def test_bench_with_gpu_writes_json_and_markdown(tmp_path, capsys):
    json_path, md_path = tmp_path / "bench.json", tmp_path / "bench.md"
    code = cli.main(["bench", "--head-dims", "64", "--seqlens", "256", "--causal", "yes", "--reps", "2",
                     "--total-tokens", "1024", "--no-torch", "--json", str(json_path), "--md", str(md_path)])
    assert code == 0
    report = json.loads(json_path.read_text())
    (result,) = report["results"]
    assert result["spec"].startswith("fwd_bf16_hd64_causal")
    assert result["tflops"] > 0
    assert "| cuflash |" in md_path.read_text()
    assert "fwd bf16 hd64 causal N=256 b=4 h=32" in capsys.readouterr().out


def test_info_names_the_kernel_of_a_problem(capsys):
    assert cli.main(["info", "--head-dim", "128", "--dtype", "bf16", "--causal", "--arch", "sm90a"]) == 0
    out = capsys.readouterr().out
    assert "fwd_bf16_hd128_causal_" in out and "family wgmma" in out
    assert cli.main(["info", "--head-dim", "96", "--arch", "sm80"]) == 0
    assert "family mma" in capsys.readouterr().out
    assert cli.main(["info", "--head-dim", "80", "--arch", "sm90a"]) == 0  # Hopper pads it to 128 columns
    out = capsys.readouterr().out
    assert "fwd_bf16_hd80_" in out and "family wgmma" in out and "computed at 128 columns" in out
    assert "bwd_bf16_hd80_m64n128w8s2_wgmma_tma_sm90a (family wgmma" in out  # and so does its backward
    assert out.count("computed at 128 columns") == 3
    # FP8 is forward only: no backward line; 96 runs the Hopper kernel at 128 columns, 72 the portable one
    assert cli.main(["info", "--head-dim", "96", "--dtype", "e4m3", "--arch", "sm90a"]) == 0
    out = capsys.readouterr().out
    assert "fwd_e4m3obf16_hd96_" in out and "computed at 128 columns" in out and "backward" not in out
    assert cli.main(["info", "--head-dim", "72", "--dtype", "e5m2", "--arch", "sm90a"]) == 0
    assert "fwd_e5m2obf16_hd72_" in (out := capsys.readouterr().out) and "family mma" in out
