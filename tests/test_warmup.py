"""cuflash.warmup skips what this process has compiled or loaded; the warm tables of the GPU test
modules (conftest.py's session warm-up) name fixtures that exist, and the session's build their
specs for both targets. No GPU."""
import importlib
import pathlib

import pytest

import conftest

MODULES = sorted(p.stem for p in pathlib.Path(__file__).parent.glob("test_*_gpu.py"))


def _tables(module):
    return [(kind, name, f) for kind in ("WARM", "WARM_HOPPER") for name, f in getattr(module, kind, {}).items()]


@pytest.mark.parametrize("name", MODULES)
def test_each_entry_names_a_fixture_of_its_module(name):
    cupy = pytest.importorskip("cupy")  # the GPU modules import it
    del cupy
    module = importlib.import_module(name)
    for kind, fixture, f in _tables(module):
        assert callable(f), (kind, fixture)
        assert hasattr(getattr(module, fixture, None), "__wrapped__") or fixture in conftest.WARM, (kind, fixture)


def test_the_session_tables_build_their_specs_for_both_targets():
    for fixture, f in conftest.WARM.items():
        for arch in ("sm90a", "sm80"):
            specs = f(arch)
            assert specs and all(hasattr(s, "name") for s in specs), (fixture, arch)


def test_warmup_starts_no_process_for_specs_compiled_or_loaded_here(monkeypatch, tmp_path):
    import concurrent.futures

    from cuflash.core import compile as compile_mod
    from cuflash.core.policy import default_spec

    def no_pool(*args, **kwargs):
        raise AssertionError("a process pool was started")

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_pool)
    warmed, loaded = default_spec(64, "bf16", False, "sm90a"), default_spec(128, "fp16", True, "sm90a")
    monkeypatch.setattr(compile_mod, "_warmed", {(str(tmp_path), warmed)})
    monkeypatch.setattr(compile_mod, "_memo", {(loaded, 0): object()})
    assert compile_mod.warmup([warmed, loaded, warmed], progress=False) == [warmed.name, loaded.name]
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "elsewhere"))  # another cache: compiled again
    with pytest.raises(AssertionError, match="process pool"):
        compile_mod.warmup([warmed], progress=False)


def test_warmup_submits_the_larger_kernels_first():
    from cuflash.core import compile as compile_mod
    from cuflash.core.policy import default_bwd_spec, default_spec

    specs = [default_spec(64, "bf16", False, "sm80"), default_spec(256, "bf16", False, "sm90a"),
             default_bwd_spec(64, "bf16", False, "sm90a", False), default_spec(128, "bf16", False, "sm90a")]
    order = sorted(specs, key=compile_mod._compile_weight, reverse=True)
    assert order == [specs[2], specs[1], specs[3], specs[0]]
