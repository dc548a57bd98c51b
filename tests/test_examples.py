"""The examples: what each imports from cuflash exists, and generate_kernel.py, which needs no GPU, runs."""
import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.py"))


def _cuflash_imports(path):
    """(module, name or None) for each ``import cuflash...`` and ``from cuflash... import name`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names if alias.name.split(".")[0] == "cuflash")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cuflash":
            yield from ((node.module, alias.name) for alias in node.names)


def test_there_are_examples():
    assert "generate_kernel.py" in [path.name for path in EXAMPLES]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_imports_exist(path):
    imports = list(_cuflash_imports(path))
    assert imports, f"{path.name} imports nothing from cuflash"
    for module_name, name in imports:
        module = importlib.import_module(module_name)
        if name is not None:
            assert hasattr(module, name) or importlib.util.find_spec(f"{module_name}.{name}"), \
                f"{path.name}: from {module_name} import {name}"


def _run_generate_kernel(*argv, cwd, env=None):
    # the checkout's cuflash, as the tests use it (installed or not)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "generate_kernel.py"), *argv],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_generate_kernel_writes_into_the_folder_it_is_given(tmp_path):
    out_dir, cwd = tmp_path / "kernels", tmp_path / "cwd"
    cwd.mkdir()
    stdout = _run_generate_kernel(str(out_dir), cwd=cwd)
    written = sorted(out_dir.glob("*.cu"))
    assert len(written) == 2 and all("__global__" in path.read_text() for path in written)
    assert str(out_dir) in stdout
    assert list(cwd.iterdir()) == []


def test_generate_kernel_without_a_folder_makes_a_temporary_one(tmp_path):
    cwd, temp = tmp_path / "cwd", tmp_path / "temp"
    cwd.mkdir(), temp.mkdir()
    stdout = _run_generate_kernel(cwd=cwd, env=dict(os.environ, TMPDIR=str(temp)))
    match = re.search(r"^writing the generated sources to (.+)$", stdout, re.MULTILINE)
    assert match, stdout
    out_dir = Path(match.group(1))
    assert out_dir.parent == temp and len(list(out_dir.glob("*.cu"))) == 2
    assert list(cwd.iterdir()) == []
