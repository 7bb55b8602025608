"""flce's imports: the package imports nothing from the rest of this repository (it can be
vendored alone), imports run one way between its modules (no cycles, lazy imports included), and
no module reaches into another's private names."""

import ast
import sys
from pathlib import Path

FLCE = Path(__file__).resolve().parents[1] / "flce"
ALLOWED_TOP_LEVEL = {"flce", "torch", "triton", *sys.stdlib_module_names}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, including those inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import of {node.module}"
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def module_name(path: Path) -> str:
    return "flce" if path.stem == "__init__" else f"flce.{path.stem}"


def import_graph() -> dict[str, set[str]]:
    """flce module -> the flce modules it imports (`from flce import x` counts as the package)."""
    modules = {module_name(p): p for p in FLCE.glob("*.py")}
    return {name: {target for target, _ in imports(path) if target in modules and target != name}
            for name, path in modules.items()}


def test_flce_imports_nothing_else_from_the_repository():
    outside = [(p.name, target) for p in sorted(FLCE.glob("*.py")) for target, _ in imports(p)
               if target.split(".")[0] not in ALLOWED_TOP_LEVEL]
    assert outside == []


def test_imports_between_flce_modules_have_no_cycle():
    graph = import_graph()
    assert graph["flce.dispatch"] <= {"flce.options"}  # the shared helpers sit low
    done, path = set(), []

    def visit(node):
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for target in sorted(graph[node]):
            if target != "flce":  # a submodule importing the package itself is caught below
                visit(target)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    into_package = sorted(name for name, targets in graph.items()
                          if name != "flce" and "flce" in targets)
    assert into_package == [], "submodules import the package __init__ (a cycle through it)"


def test_no_module_imports_another_modules_private_names():
    private = [(p.name, target, name) for p in sorted(FLCE.glob("*.py"))
               for target, names in imports(p) if target.startswith("flce")
               for name in names if name.startswith("_")]
    assert private == []
