"""The wheel carries the templates and works outside the source tree.

setup.cfg maps the package ``cuflash.templates`` to the top-level folder ``templates/``; a wheel
that misses a template or header imports fine and fails only at the first kernel, so this test
builds one, installs it into a folder of its own and renders a kernel from there, with the
interpreter running the tests (so with the packages it has, in a virtual environment or not).
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Build artefacts and caches stay out of the copy the wheel is built from.
_NOT_SOURCES = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                                      ".pytest_cache", ".whl", "out", "*.so")


def _run(argv, **kwargs):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _backend_builds_wheels_here() -> bool:
    """Whether setuptools in this interpreter can build a wheel without build isolation: it needs
    setuptools >= 70.1 (bdist_wheel built in) or the ``wheel`` package beside an older one."""
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(REPO_ROOT, source, ignore=_NOT_SOURCES)
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(source)]
    if _backend_builds_wheels_here():
        argv.insert(4, "--no-build-isolation")
    _run(argv)
    (built,) = (work / "dist").glob("cuflash-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_every_module_template_and_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.name for p in (REPO_ROOT / "templates").glob("*.j2"))
    headers = sorted(p.name for p in (REPO_ROOT / "templates" / "include" / "cuflash").glob("*.cuh"))
    assert templates and headers, "the source tree has no templates or headers to check"
    for name in templates:
        assert f"cuflash/templates/{name}" in names
    for name in headers:
        assert f"cuflash/templates/include/cuflash/{name}" in names
    for module in ("__init__.py", "__main__.py", "forward.py", "backward.py", "fp8.py", "reference.py", "testing.py",
                   "core/__init__.py", "core/spec.py", "core/policy.py", "core/render.py", "core/compile.py",
                   "core/tuned_defaults.py", "tools/__init__.py", "tools/cli.py", "tools/tune.py",
                   "tools/bench/__init__.py"):
        assert f"cuflash/{module}" in names
    # A subpackage missing from setup.cfg's packages would leave its modules out of the wheel.
    sources = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "cuflash").rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert [name for name in sources if name not in names] == []
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "cuflash = cuflash.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert any(".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE" for n in names), "no LICENSE in the wheel"


@pytest.mark.slow
def test_installed_wheel_generates_kernels_outside_the_source_tree(wheel, tmp_path):
    # Installed into a folder of its own and put first on sys.path through PYTHONPATH, the wheel's
    # cuflash shadows any installed elsewhere, while the dependencies (numpy, jinja2, ml_dtypes)
    # come from the interpreter running the tests: a virtual environment's if that is one.
    target = tmp_path / "site"
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
          str(wheel)], env=child_env)
    child_env["PYTHONPATH"] = str(target)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    program = ("import sys, cuflash; "
               "src = cuflash.generate(cuflash.default_spec(128, 'bf16', True, 'sm90a')); "
               "assert '__global__' in src; "
               "assert not [m for m in sys.modules if m.startswith('cuflash.tools')], 'the library imported tools'; "
               "from cuflash.tools import bench, cli, tune; "
               "print(cuflash.__file__)")
    result = _run([sys.executable, "-c", program], cwd=elsewhere, env=child_env)
    imported_from = Path(result.stdout.strip().splitlines()[-1]).resolve()
    assert imported_from.is_relative_to(target.resolve()), imported_from
    assert not imported_from.is_relative_to(REPO_ROOT), imported_from

    result = _run([sys.executable, "-m", "cuflash", "info"], cwd=elsewhere, env=child_env)
    assert str(imported_from.parent) in result.stdout
    generate = ["generate", "--head-dim", "64", "--dtype", "fp16", "--arch", "sm80"]
    result = _run([sys.executable, "-m", "cuflash", *generate], cwd=elsewhere, env=child_env)
    assert "fwd_fp16_hd64_" in result.stdout
    script = target / ("Scripts/cuflash.exe" if os.name == "nt" else "bin/cuflash")
    if script.exists():
        result = _run([str(script), *generate], cwd=elsewhere, env=child_env)
        assert "fwd_fp16_hd64_" in result.stdout


def test_the_library_does_not_import_the_tools():
    program = ("import sys, cuflash; "
               "print(sorted(m for m in sys.modules if m.startswith('cuflash.tools')))")
    result = _run([sys.executable, "-c", program], cwd=REPO_ROOT)
    assert result.stdout.strip() == "[]"
