"""The wheel carries the templates and works outside the source tree.

setup.cfg maps the package ``cuflash.templates`` to the top-level folder ``templates/``; a wheel
that misses a template or header imports fine and fails only at the first kernel, so this test
builds one, installs it into a fresh virtual environment and renders a kernel from there.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import venv
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
def test_wheel_holds_every_template_and_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.name for p in (REPO_ROOT / "templates").glob("*.j2"))
    headers = sorted(p.name for p in (REPO_ROOT / "templates" / "include" / "cuflash").glob("*.cuh"))
    assert templates and headers, "the source tree has no templates or headers to check"
    for name in templates:
        assert f"cuflash/templates/{name}" in names
    for name in headers:
        assert f"cuflash/templates/include/cuflash/{name}" in names
    for module in ("__init__.py", "__main__.py", "cli.py", "spec.py", "render.py"):
        assert f"cuflash/{module}" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "cuflash = cuflash.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_installed_wheel_generates_kernels_outside_the_source_tree(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    # System site-packages provide the dependencies (numpy, jinja2, ml_dtypes) and pip; the venv's
    # own site-packages come first on sys.path, so its cuflash shadows any installed elsewhere.
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # --ignore-installed: a cuflash already in the system site-packages must not satisfy the install.
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
         env=child_env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    program = ("import cuflash; from cuflash.spec import default_spec; "
               "src = cuflash.generate(default_spec(128, 'bf16', True, 'sm90a')); "
               "assert '__global__' in src; print(cuflash.__file__)")
    result = _run([str(python), "-c", program], cwd=elsewhere, env=child_env)
    imported_from = Path(result.stdout.strip().splitlines()[-1]).resolve()
    assert imported_from.is_relative_to(env_dir.resolve()), imported_from
    assert not imported_from.is_relative_to(REPO_ROOT), imported_from

    script = env_dir / "bin" / "cuflash"
    if script.exists():
        result = _run([str(script), "generate", "--head-dim", "64", "--dtype", "fp16", "--arch", "sm80"],
                      cwd=elsewhere, env=child_env)
        assert "fwd_fp16_hd64_" in result.stdout
