"""The package's import graph: no circles, and kernels/ stays pure torch.

Every module of the installed packages (pyproject's `packages` and `package-dir`) is parsed with `ast`;
every import statement counts, also those inside functions or `if TYPE_CHECKING:` blocks, because a
circle through a lazy import is still two modules that each need the other.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNELS = "draftloop.kernels"
# Besides the standard library and itself, what kernels/ may import (it runs alone on a GPU machine).
KERNEL_DEPENDENCIES = {"torch", "transformers", "safetensors"}


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages pyproject.toml installs."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders: Mapping[str, str] = setup.get("package-dir", {})
    modules: dict[str, Path] = {}
    for package in setup["packages"]:
        # A package's folder: its own package-dir entry, or its nearest mapped parent's folder + the rest.
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in folders:
                folder = root / folders[head] / Path(*parts[cut:])
                break
        else:
            folder = root / Path(*parts)
        for file in sorted(folder.glob("*.py")):
            name = package if file.stem == "__init__" else f"{package}.{file.stem}"
            modules[name] = file
    return modules


def _imported_names(module: str, file: Path) -> Iterator[tuple[str, int, bool]]:
    """(absolute dotted name, line, member) for every import in `file`.

    `from a import b` yields a, then a.b as a member (b may be a module or just a name in a).
    """
    is_package = file.name == "__init__.py"
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    # Imports under `if TYPE_CHECKING:` never run: annotations only (a variant names the drafter it
    # extends), not an edge of the import graph; lazy imports inside functions do count.
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        for child in ast.walk(statement)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, False
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            yield base, node.lineno, False
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno, True


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (a package's own `__init__` is not an edge)."""
    graph: dict[str, set[str]] = {}
    for module, file in modules.items():
        targets = {name for name, _, _ in _imported_names(module, file) if name in modules}
        graph[module] = {t for t in targets if t != module and modules[t].name != "__init__.py"}
    return graph


def import_circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle (a list of modules, first repeated last) per strongly connected group of modules."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            group: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return [_circle_in(group, graph) for group in groups]


def _circle_in(group: set[str], graph: Mapping[str, set[str]]) -> list[str]:
    """A path inside `group` from its first module back to itself (breadth-first: the shortest one)."""
    start = min(group)
    paths = {target: [start, target] for target in sorted(graph[start] & group)}
    frontier = list(paths)
    while start not in paths:
        next_frontier = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    next_frontier.append(target)
        frontier = next_frontier
    return paths[start]


def kernel_violations(modules: Mapping[str, Path], kernels: str = KERNELS) -> list[str]:
    """`file:line imports name` for each import in `kernels` of anything but its allowed dependencies."""
    allowed = set(sys.stdlib_module_names) | KERNEL_DEPENDENCIES
    found = []
    for module, file in modules.items():
        if module != kernels and not module.startswith(kernels + "."):
            continue
        for name, line, member in _imported_names(module, file):
            if member:
                continue
            top = name.split(".")[0]
            inside = name == kernels or name.startswith(kernels + ".")
            if not inside and top not in allowed:
                found.append(f"{file.relative_to(file.parents[1])}:{line} imports {name}")
    return sorted(set(found))


def test_the_package_has_no_import_circles() -> None:
    modules = package_modules(REPO_ROOT)
    assert {
        "draftloop.cli",
        "draftloop.kernels.drafter",
        "draftloop.tasks.cycle",
        "draftloop.flows.cycle",
    } <= set(modules)
    circles = import_circles(import_graph(modules))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in circles)


def test_kernels_import_only_torch_transformers_safetensors_and_the_stdlib() -> None:
    violations = kernel_violations(package_modules(REPO_ROOT))
    assert not violations, "kernels/ imports outside its dependencies:\n" + "\n".join(violations)


def test_the_checks_find_a_lazy_circle_and_a_kernel_import(tmp_path: Path) -> None:
    """The two checks above on a made-up package: a circle through an import inside a function."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = {"pkg" = "src", "pkg.kernels" = "k"}\n'
        'packages = ["pkg", "pkg.kernels"]\n'
    )
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "__init__.py").write_text("")
    (tmp_path / "src" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "src" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "src" / "c.py").write_text("import pkg.a\nimport pkg.kernels.ops\n")
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "__init__.py").write_text("")
    (tmp_path / "k" / "ops.py").write_text("import torch\nimport json\nfrom .. import a\nimport pydantic\n")
    modules = package_modules(tmp_path)
    assert import_circles(import_graph(modules)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert kernel_violations(modules, "pkg.kernels") == [
        "k/ops.py:3 imports pkg",
        "k/ops.py:4 imports pydantic",
    ]


# What a process that never loads a target model or logs to MLflow must not import: transformers'
# auto model classes pull in generation and scikit-learn (seconds of CPU per process, in every driver
# and every training worker of a cycle); a Ray Train worker reports through files, not MLflow.
_NOT_IMPORTED = {
    "draftloop.infra.training.worker": ("transformers.models.auto.modeling_auto", "sklearn", "mlflow"),
    "draftloop.flows.train_and_eval": ("transformers.models.auto.modeling_auto", "sklearn"),
}


def test_drivers_and_training_workers_import_no_model_classes() -> None:
    import subprocess

    for module, heavy in _NOT_IMPORTED.items():
        probe = f"import sys, {module}; print(' '.join(n for n in {heavy!r} if n in sys.modules))"
        found = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
        ).stdout.split()
        assert not found, f"importing {module} imports {found}"
