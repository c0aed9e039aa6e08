"""Whether the engine serves a target's class with EAGLE-3, read from its installed source in well under a
second, without importing the engine (config validation cannot wait for the doctor's probe, which does).

For vLLM: the architecture's class in its model registry (the tables `_VLLM_MODELS` merges, later ones
winning, as vLLM's own merge does) and whether that class, or a base it inherits from another vLLM
module, implements `SupportsEagle3`; else whether draftloop's plugin is installed in the engine's
environment with its `eagle3_enabler` patch on, which adds it. Another engine kind is not read this way
(None: not refused here).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from draftloop.infra.engines.base import Engine, EngineError


@dataclass(frozen=True)
class ClassSupport:
    """Whether the engine serves a target architecture with EAGLE-3: `support` is "native",
    "plugin:eagle3_enabler", "unsupported" or "unknown" (the source does not say: not refused)."""

    architecture: str | None
    engine_class: str | None  # "<module>.<class>" in the engine's model registry
    support: str
    detail: str
    # vLLM's Transformers modeling backend (the class for architectures without a native one): it takes
    # layer k's input from layer k-1's output, so layer_input id 0 would read the last layer instead.
    transformers_backend: bool = False

    @property
    def refused(self) -> bool:
        return self.support == "unsupported"


# Run in the engine's Python: where vLLM and the plugin are installed, importing neither.
_LOCATE = (
    "import importlib.util as u, json; v = u.find_spec('vllm'); p = u.find_spec('draftloop_vllm_plugin'); "
    "print(json.dumps([list(v.submodule_search_locations)[0] if v else None, p is not None]))"
)


def eagle3_class_support(
    engine: Engine, architectures: Sequence[str], timeout_s: float = 30.0
) -> ClassSupport | None:
    """The engine's EAGLE-3 support for the first of `architectures` it knows, from its installed source;
    None when this engine cannot be read that way (another kind, or its Python or package not found)."""
    if engine.kind != "vllm":
        return None
    try:
        proc = subprocess.run(
            [str(engine.python), "-c", _LOCATE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        vllm_dir, plugin = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, EngineError):
        return None
    if not vllm_dir or not (Path(vllm_dir) / "model_executor" / "models" / "registry.py").is_file():
        return None
    patches = dict(os.environ, **engine.settings.env).get("DRAFTLOOP_PLUGIN_PATCHES", "all").strip().lower()
    enabler = bool(plugin) and (patches in ("", "all") or "eagle3_enabler" in patches.split(","))
    return vllm_class_support(Path(vllm_dir), tuple(architectures), enabler)


def vllm_class_support(vllm_dir: Path, architectures: Sequence[str], enabler: bool) -> ClassSupport:
    """`eagle3_class_support` on a vLLM package folder; `enabler`: the plugin's eagle3_enabler is on."""
    registry = vllm_registry(vllm_dir / "model_executor" / "models" / "registry.py")
    known = [name for name in architectures if name in registry]
    if not known:
        return ClassSupport(
            architectures[0] if architectures else None,
            None,
            "unknown",
            f"vLLM's model registry lists none of {list(architectures)} (it may still load it through its "
            "Transformers backend)",
        )
    architecture = known[0]
    module, class_name = registry[architecture]
    backend = module == "transformers"
    where = f"{module}.{class_name}"
    native = _implements(vllm_dir, vllm_module_path(vllm_dir, module), class_name, "SupportsEagle3", 0)
    if native is None:
        return ClassSupport(architecture, where, "unknown", f"cannot read {where} in {vllm_dir}", backend)
    if native:
        return ClassSupport(architecture, where, "native", f"{class_name} implements SupportsEagle3", backend)
    if enabler:
        detail = f"{class_name} lacks SupportsEagle3; draftloop's plugin (eagle3_enabler) adds it"
        return ClassSupport(architecture, where, "plugin:eagle3_enabler", detail, backend)
    return ClassSupport(
        architecture,
        where,
        "unsupported",
        f"{class_name} lacks SupportsEagle3 and draftloop's plugin patch eagle3_enabler is not installed or "
        "is disabled (DRAFTLOOP_PLUGIN_PATCHES) in the engine environment",
        backend,
    )


@lru_cache(maxsize=8)
def vllm_registry(path: Path) -> dict[str, tuple[str, str]]:
    """architecture -> (module under model_executor/models, class), as vLLM's `_VLLM_MODELS` merges its
    tables (later tables win)."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    order: list[str] = []
    for node in _parse(path.read_text(encoding="utf-8")).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        value = getattr(node, "value", None)
        if not isinstance(target, ast.Name) or not isinstance(value, ast.Dict):
            continue
        table: dict[str, tuple[str, str]] = {}
        for key, item in zip(value.keys, value.values, strict=True):
            if key is None and isinstance(item, ast.Name) and target.id == "_VLLM_MODELS":
                order.append(item.id)
            elif isinstance(key, ast.Constant) and isinstance(item, ast.Tuple) and len(item.elts) == 2:
                module, class_name = item.elts
                if isinstance(module, ast.Constant) and isinstance(class_name, ast.Constant):
                    table[str(key.value)] = (str(module.value), str(class_name.value))
        tables[target.id] = table
    merged: dict[str, tuple[str, str]] = {}
    for name in order or list(tables):
        merged.update(tables.get(name, {}))
    return merged


def vllm_module_path(vllm_dir: Path, module: str) -> Path:
    """The file of a registry module name ("llama", or absolute "vllm.x.y")."""
    if module.startswith("vllm."):
        base = vllm_dir.joinpath(*module.split(".")[1:])
    else:
        base = vllm_dir.joinpath("model_executor", "models", *module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@lru_cache(maxsize=256)
def _parsed(path: Path) -> ast.Module | None:
    try:
        return _parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _parse(source: str) -> ast.Module:
    """ast.parse, once more after a spurious SystemError: CPython 3.11 can raise "AST constructor recursion
    depth mismatch" (CPython gh-106905) when another thread of the process builds an AST at the same time
    (seen once in a Prefect worker's flow run, on 3.11.7); the source itself is fine."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def _implements(vllm_dir: Path, path: Path, class_name: str, interface: str, depth: int) -> bool | None:
    """Whether `class_name` of the module file `path` has `interface` among its bases, following bases
    defined there or imported from other vLLM modules; None when the class cannot be found."""
    tree = _parsed(path)
    if tree is None or depth > 12:
        return None
    imports: dict[str, Path] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            source = _import_source(vllm_dir, path, node)
            for alias in node.names:
                if source is not None:
                    imports[alias.asname or alias.name] = source
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name != class_name:
            continue
        for statement in node.body:  # `supports_eagle3 = True` set on the class itself
            if isinstance(statement, ast.Assign | ast.AnnAssign):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                named = any(isinstance(t, ast.Name) and t.id == "supports_eagle3" for t in targets)
                if named and isinstance(statement.value, ast.Constant) and statement.value.value is True:
                    return True
        for base in node.bases:
            name = (
                base.id
                if isinstance(base, ast.Name)
                else base.attr
                if isinstance(base, ast.Attribute)
                else None
            )
            if name is None:
                continue
            if name == interface:
                return True
            where = (
                path
                if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body)
                else imports.get(name)
            )
            if where is not None and _implements(vllm_dir, where, name, interface, depth + 1):
                return True
        return False
    source = imports.get(class_name)  # re-exported from another module
    return _implements(vllm_dir, source, class_name, interface, depth + 1) if source is not None else None


def _import_source(vllm_dir: Path, path: Path, node: ast.ImportFrom) -> Path | None:
    """The file a `from X import ...` of a vLLM module reads, when X is inside vLLM."""
    if node.level:
        package = path.parent
        for _ in range(node.level - 1):
            package = package.parent
        base = package.joinpath(*(node.module or "").split(".")) if node.module else package
    elif node.module and node.module.startswith("vllm."):
        base = vllm_dir.joinpath(*node.module.split(".")[1:])
    else:
        return None
    if base.is_dir():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None
