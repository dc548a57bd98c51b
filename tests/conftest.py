"""Shared test setup: Hypothesis profiles, GPU detection, kernel warm-up and output poisoning.

Tests marked ``gpu`` skip cleanly on machines without a usable CUDA device.
"""
import os

import pytest

from cuflash.testing import register_hypothesis_profiles

register_hypothesis_profiles(load=os.environ.get("CUFLASH_HYPOTHESIS_PROFILE", "ci"))
# JAX (tests/test_jax_*.py) takes most of a GPU's memory when it starts, unless told not to: the
# CuPy tests after it would run short.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


GPU = _gpu_available()


def pytest_configure(config):
    # on a GPU the run ends with its slowest tests (the suite's time is kept under about 8 minutes)
    if GPU and getattr(config.option, "durations", None) is None:
        config.option.durations = 25
    if GPU:
        _time_the_loads()


#: (test id, kernel name, seconds) of every kernel a GPU test loaded slowly (compiled, most likely):
#: kernels no warm table holds, listed at the end of the run.
_SLOW_LOADS: list = []
_SLOW_LOAD_S = 1.0
_current_test = ["(setup)"]


def _time_the_loads() -> None:
    import time

    from cuflash.core import compile as compile_mod

    load = compile_mod._load

    def timed(spec):
        start = time.perf_counter()
        kernel = load(spec)
        seconds = time.perf_counter() - start
        if seconds > _SLOW_LOAD_S:
            _SLOW_LOADS.append((_current_test[0], spec.name, seconds))
        return kernel

    compile_mod._load = timed


def pytest_runtest_setup(item):
    _current_test[0] = f"{item.nodeid}, setup"


def pytest_runtest_call(item):
    _current_test[0] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    if _SLOW_LOADS:
        total = sum(s for _, _, s in _SLOW_LOADS)
        terminalreporter.section(f"kernels compiled inside tests: {len(_SLOW_LOADS)}, {total:.0f} s "
                                 f"(a warm table would compile them in parallel)")
        for test, name, seconds in sorted(_SLOW_LOADS, key=lambda x: -x[2])[:40]:
            terminalreporter.write_line(f"{seconds:6.1f} s  {name}  ({test})")


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _default_specs(arch):
    """Every default specialization of the target, both families, FP8 included."""
    from cuflash.core.policy import all_default_specs, all_fp8_portable_specs, all_fp8_specs

    return (all_default_specs(arch) + all_default_specs(arch, family="mma") + all_fp8_specs(arch)
            + all_fp8_portable_specs(arch))


def _bwd_specs(arch):
    """Every default backward specialization of the target, the portable ones too."""
    from cuflash.core.policy import all_default_bwd_specs, all_default_specs, default_bwd_spec

    portable = [default_bwd_spec(d, t, c, arch, det, family="mma") for d in (64, 128, 256)
                for t in ("fp16", "bf16") for c in (False, True) for det in (False, True)]
    return all_default_specs(arch) + all_default_bwd_specs(arch) + portable


def _kvcache_specs(arch):
    """The KV-cache and varlen specializations the serving tests use."""
    from cuflash.core.policy import decode_spec

    specs = [decode_spec(d, t, t, paged, rows, arch) for d in (64, 72, 128, 256) for t in ("bf16", "fp16")
             for paged in (False, True) for rows in (16, 32, 64)]
    specs += [decode_spec(128, t, c, paged, rows, arch) for t in ("bf16", "fp16") for c in ("e4m3", "e5m2")
              for paged in (False, True) for rows in (16, 32)]
    specs += [decode_spec(d, "bf16", c, False, rows, arch) for d in (64, 128) for c in ("e4m3", "e5m2")
              for rows in (16, 32, 64)]  # FP8 contiguous caches with more rows
    specs += [decode_spec(d, t, t, False, rows, arch, varlen=True) for d in (64, 72, 128, 256)
              for t in ("bf16", "fp16") for rows in (16, 32, 64)]
    specs += [decode_spec(128, t, t, paged, rows, arch, packed_q=True)  # packed queries over a cache
              for t in ("bf16", "fp16") for paged in (False, True) for rows in (16, 32, 64)]
    specs += [decode_spec(d, t, t, paged, rows, arch, packed_q=True)
              for d, t, paged, rows in ((64, "fp16", False, 32), (64, "fp16", False, 16), (256, "bf16", True, 64),
                                        (256, "bf16", True, 16))]
    specs += [decode_spec(128, t, t, False, rows, arch, leftpad=True)  # left-padded caches
              for t in ("bf16", "fp16") for rows in (16, 32, 64)]
    if arch == "sm90a":  # the Hopper varlen forward, at both length classes
        from cuflash.varlen import hopper_spec
        specs += [hopper_spec(d, t, c, n, arch) for d in (64, 72, 96, 128, 256) for t in ("bf16", "fp16")
                  for c in (False, True) for n in (700, 4096)]
        specs += [hopper_spec(d, "bf16", c, 1500, arch).replace(local=True) for d in (64, 128, 256)
                  for c in (False, True)]  # windows on it
        from cuflash.core.policy import default_bwd_spec  # the one-launch varlen backward
        specs += [default_bwd_spec(d, t, c, arch, False, family="wgmma").replace(varlen=True)
                  for d in (64, 96, 128, 256) for t in ("bf16", "fp16") for c in (False, True)]
        specs += [default_bwd_spec(d, "bf16", c, arch, False, family="wgmma").replace(varlen=True, local=True)
                  for d in (64, 128, 256) for c in (False, True)]
    return list(dict.fromkeys(specs))


#: The session-wide warm fixtures' kernels by fixture name. Test modules hold tables of their own:
#: WARM (functions of the device's target) and WARM_HOPPER (of no argument, sm_90a only).
WARM = {"warm_kernels": _default_specs, "warm_bwd_kernels": _bwd_specs, "warm_kvcache_kernels": _kvcache_specs}


def _warm(specs_of_arch) -> None:
    import cuflash
    from cuflash.core.compile import device_arch

    cuflash.warmup(specs_of_arch(device_arch()), progress=False)


@pytest.fixture(scope="session")
def warm_kernels():
    """Compile every default specialization of this GPU once, in parallel processes, so the
    tests themselves only load cubins from the disk cache."""
    _warm(_default_specs)


@pytest.fixture(scope="session")
def warm_bwd_kernels():
    """Compile every default backward specialization of this GPU once, in parallel processes."""
    _warm(_bwd_specs)


@pytest.fixture(scope="session")
def warm_kvcache_kernels():
    """Compile the KV-cache and varlen specializations the serving tests use, in parallel processes."""
    _warm(_kvcache_specs)


def _warm_tables(items) -> list:
    """The functions of the target giving the kernels of every warm fixture that the selected GPU
    tests use (this file's WARM and their modules' WARM / WARM_HOPPER), each once."""
    wanted = {}
    for item in items:
        if "gpu" not in item.keywords or getattr(item, "module", None) is None:
            continue
        hopper = {name: (lambda arch, f=f: f() if arch == "sm90a" else [])
                  for name, f in getattr(item.module, "WARM_HOPPER", {}).items()}
        for owner, table in (("conftest", WARM), (item.module.__name__, getattr(item.module, "WARM", {})),
                             (item.module.__name__, hopper)):
            for name in item.fixturenames:
                if name in table:
                    wanted.setdefault((owner, name), table[name])
    return list(wanted.values())


_WARM_TABLES = pytest.StashKey[list]()


def pytest_collection_finish(session):
    if GPU:  # the tests that will run, after -k and -m took theirs out
        session.config.stash[_WARM_TABLES] = _warm_tables(session.items)


@pytest.fixture(scope="session", autouse=True)
def _warm_the_session(request):
    """Before the first test: the kernels of all the warm fixtures the selected GPU tests use, in
    one pool of parallel processes (one pool keeps every core busy where a fixture's own few
    kernels would not); each fixture then finds its kernels compiled. A failure here is left to
    the fixtures that need the kernel, which compile it again and report it."""
    tables = request.config.stash.get(_WARM_TABLES, [])
    if not tables:
        return
    import warnings

    import cuflash
    from cuflash.core.compile import device_arch

    arch, specs = device_arch(), []
    try:
        for specs_of in tables:
            specs += specs_of(arch)
        cuflash.warmup(specs, progress=False)
    except Exception as exc:  # noqa: BLE001 - the fixtures report it
        warnings.warn(f"the session's kernel warm-up stopped ({type(exc).__name__}: {exc}); "
                      f"the fixtures compile what it left")


@pytest.fixture
def poison():
    """``poison(nbytes)``: leave a freed, all-ones block of that size in CuPy's memory pool, so
    the next allocation of that size (the kernel's output) starts as NaN, not as zeros."""
    import cupy

    def _poison(*arrays_nbytes):
        for nbytes in arrays_nbytes:
            if nbytes:
                block = cupy.empty(nbytes, dtype=cupy.uint8)
                block.fill(0xFF)
                del block
        cupy.cuda.Device().synchronize()

    return _poison
