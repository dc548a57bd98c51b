"""The package's layout holds: imports go one way (tools -> entry points -> core), none forms a
cycle, and no module grows past what one reader holds in mind. Parsed, not imported: every import
statement counts, those inside functions too."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cuflash"

#: The layer of a module: 0 the pipeline (cuflash.core), 1 the entry points, 2 the tools.
ENTRY_POINTS = {"cuflash", "cuflash.forward", "cuflash.backward", "cuflash.fp8", "cuflash.reference",
                "cuflash.simulate", "cuflash.testing", "cuflash.problems", "cuflash.torch", "cuflash.torch_interop",
                "cuflash.torch_varlen", "cuflash.torch_mods", "cuflash.torch_kvcache",
                "cuflash.jax", "cuflash.mods", "cuflash.serving", "cuflash.kvcache", "cuflash.sparsity",
                "cuflash.varlen"}
TOOLS = {"cuflash.__main__"}
MAX_LINES = 620


def _modules() -> dict:
    """{dotted name: path} of every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _layer(name: str) -> int:
    if name.startswith("cuflash.core"):
        return 0
    if name in ENTRY_POINTS:
        return 1
    if name.startswith("cuflash.tools") or name in TOOLS:
        return 2
    raise AssertionError(f"{name} belongs to no layer: place it in cuflash/core, cuflash/tools or ENTRY_POINTS")


def _resolve(module: str, path: Path, node) -> list[str]:
    """The package modules an import statement of ``module`` names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
        names = [[] for _ in bases]
    else:
        if node.level:
            base = package.split(".")
            base = base[:len(base) - node.level + 1]
            bases = [".".join(base + ([node.module] if node.module else []))]
        else:
            bases = [node.module]
        names = [[alias.name for alias in node.names]]
    found = []
    for base, imported in zip(bases, names):
        if not base.startswith("cuflash"):
            continue
        subs = [f"{base}.{n}" for n in imported if f"{base}.{n}" in MODULES]
        found += subs or ([base] if base in MODULES else [])
    return found


def _edges() -> dict:
    edges = {}
    for module, path in MODULES.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(t for t in _resolve(module, path, node) if t != module)
        edges[module] = targets
    return edges


EDGES = _edges()


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_go_one_way():
    wrong = sorted(f"{a} imports {b}" for a, targets in EDGES.items() for b in targets if _layer(b) > _layer(a))
    assert not wrong, "the library must not import the tools, nor the pipeline the entry points:\n" + "\n".join(wrong)


def test_no_import_cycles():
    # the package's __init__ re-exports the entry points: its edges are not part of the flow
    edges = {a: {b for b in targets if b != "cuflash"} for a, targets in EDGES.items() if a != "cuflash"}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_too_long(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines: split it"


def test_the_checker_sees_wrong_way_imports():
    """The parser resolves relative and function-level imports (a guard on the guard)."""
    assert "cuflash.core.spec" in EDGES["cuflash.core.policy"]
    assert "cuflash.core.compile" in EDGES["cuflash.fp8"]  # imported inside a function
    assert "cuflash.forward" in EDGES["cuflash.backward"]
    assert _layer("cuflash.tools.bench.runner") == 2 and _layer("cuflash.core.launch") == 0
