"""`draftloop engine doctor`: what the engine will do with a target and a drafter, asked of the engine.

The probe runs in the engine's own Python (the orchestrator never imports the engine): each engine names
its probe in `Engine.doctor_command` (vLLM's ships with draftloop's plugin in the engine environment).
`refusals(report)` lists what in the report the cycle would refuse (the command exits 2 on any).

Config validation cannot wait for the probe (it imports the engine: tens of seconds), so
`eagle3_class_support` answers the one question it needs, whether the engine serves the target's class
with EAGLE-3, from the engine's installed source without importing it: for vLLM, the architecture's
class in its model registry and whether that class (or a base) implements `SupportsEagle3`, else
whether draftloop's plugin (installed there, its `eagle3_enabler` patch on) adds it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import Engine, EngineError, read_json, stored_layer_ids
from draftloop.infra.engines.pairing import DrafterPairingError, check_drafter_pairing
from draftloop.infra.targets.support import TargetRefusedError, check_target

_MARKER = "DRAFTLOOP_DOCTOR "


def run_doctor(
    engine: Engine, target_dir: Path, drafter_dir: Path | None = None, timeout_s: float = 300.0
) -> dict[str, Any]:
    """The engine's answers (version, patches, EAGLE-3 support, captured layer ids) plus draftloop's
    reading of the drafter's ids in both conventions and whether the pair can be served at all."""
    target_dir = Path(target_dir).resolve()
    drafter_dir = Path(drafter_dir).resolve() if drafter_dir is not None else None
    result: dict[str, Any] = {"engine": engine.kind, "python": str(engine.python)}
    argv = engine.doctor_command(target_dir, drafter_dir)
    if argv is None:
        result["probe"] = f"no in-environment probe for {engine.kind}"
        result["engine_version"] = _version_or_none(engine)
    else:
        result.update(_run_probe(engine, argv, timeout_s))
    result["family"] = describe_family(
        read_json(target_dir / "config.json"),
        result.get("patches"),
        target_dir,
        engine.settings.trust_remote_code,
    )
    if drafter_dir is not None:
        result["layer_ids"] = describe_layer_ids(engine, drafter_dir)
        try:
            check_drafter_pairing(target_dir, drafter_dir)
            result["pairing"] = {"ok": True}
        except DrafterPairingError as error:
            result["pairing"] = {"ok": False, "reason": error.reason}
    return result


def _run_probe(engine: Engine, argv: list[str], timeout_s: float) -> dict[str, Any]:
    engine.check_python()
    # The server's own environment (engine.env included, e.g. which plugin patches are enabled), with
    # its scratch files in a folder of its own.
    with tempfile.TemporaryDirectory(prefix="draftloop-doctor-") as scratch:
        env = engine.process_env(Path(scratch))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARKER)]
    if proc.returncode == 0 and lines:
        report: dict[str, Any] = json.loads(lines[-1][len(_MARKER) :])
        return report
    tail = (proc.stderr or proc.stdout).strip()[-3000:]
    missing = re.search(r"No module named '?([\w.]+)", tail)
    if missing is not None:
        raise EngineError(
            f"{missing.group(1)} is not installed in {engine.python}: rebuild the {engine.kind} "
            "environment (make engine-env)"
        )
    raise EngineError(f"engine doctor probe failed (exit {proc.returncode}):\n{tail}")


def _version_or_none(engine: Engine) -> str | None:
    try:
        return engine.version()
    except (EngineError, OSError, subprocess.TimeoutExpired):
        return None


# Patch statuses that leave the engine able to serve the family (see the plugin's PatchResult).
_PATCH_OK = ("applied", "noop", "skipped")


def describe_family(
    target_config: dict[str, Any],
    applied: list[dict[str, str]] | None,
    target_dir: Path | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """The target's family ("generic": no module, the default decoder-only path) and, for each engine
    patch it declares, what the engine's plugin did (`ok` False: a patch it needs failed, was disabled,
    or the engine reported no such patch); `refused` with the reason when the cycle cannot take it."""
    from draftloop.kernels.families.base import get_family

    try:
        support = check_target(target_config, folder=target_dir, trust_remote_code=trust_remote_code)
    except TargetRefusedError as error:
        return {"name": None, "model_type": target_config.get("model_type"), "refused": str(error)}
    family = get_family(support.family)
    statuses = {patch["name"]: patch for patch in applied or []}
    needs = []
    for name in family.engine_patches:
        patch = statuses.get(name)
        status = patch["status"] if patch is not None else "not reported"
        needs.append({"name": name, "status": status, "ok": status in _PATCH_OK})
    return {
        "name": family.name,
        "model_type": support.model_type,
        "drafter_attention": family.drafter_attention,
        "engine_patches": needs,
    }


def refusals(report: dict[str, Any]) -> list[str]:
    """What in a doctor report the cycle would refuse, one line each (empty: it can run)."""
    found: list[str] = []
    family = report.get("family") or {}
    if family.get("refused"):
        found.append(str(family["refused"]))
    for need in family.get("engine_patches") or []:
        if not need["ok"]:
            found.append(
                f"the {family.get('name')} family needs engine patch {need['name']}, "
                f"which is {need['status']}"
            )
    eagle3 = report.get("eagle3") or {}
    if eagle3.get("support") == "unsupported":
        found.append(
            f"the engine serves the target's class {eagle3.get('class') or report.get('target')} without "
            f"EAGLE-3 ({eagle3.get('detail') or 'no SupportsEagle3 and no plugin patch'})"
        )
    ids = report.get("layer_ids") or {}
    if ids.get("consistent") is False:
        found.append("the engine would capture other layers than the drafter was trained on")
    drafter = report.get("drafter")
    if isinstance(drafter, dict) and drafter.get("in_range") is False:
        found.append("some of the drafter's aux layer ids are out of range for this target")
    pairing = report.get("pairing")
    if isinstance(pairing, dict) and not pairing.get("ok", True):
        found.append(f"drafter refused: {pairing.get('reason')}")
    return found


def describe_layer_ids(engine: Engine, drafter_dir: Path) -> dict[str, Any]:
    """Engine-convention ids from the drafter's config, the same in draftloop's convention, and the
    ids the drafter was trained on (its draftloop block); `consistent` False = an export bug."""
    engine_ids = engine.drafter_layer_ids(drafter_dir)
    trained = stored_layer_ids(read_json(Path(drafter_dir) / "config.json"))
    info: dict[str, Any] = {
        "engine_convention": engine.layer_id_convention,
        "engine_ids": list(engine_ids.ids) if engine_ids is not None else None,
        "layer_input_ids": list(engine_ids.as_input()) if engine_ids is not None else None,
        "trained_layer_input_ids": list(trained.as_input()) if trained is not None else None,
    }
    if engine_ids is not None and trained is not None:
        info["consistent"] = engine_ids.as_input() == trained.as_input()
    return info


def format_report(report: dict[str, Any]) -> str:
    """Human-readable doctor output."""
    lines = [
        f"engine: {report.get('engine')} {report.get('vllm_version') or report.get('engine_version') or ''}"
    ]
    for patch in report.get("patches", []):
        lines.append(f"  patch {patch['name']}: {patch['status']} ({patch['detail']})")
    family = report.get("family") or {}
    if family.get("name") is None:
        lines.append(f"target family: none for model_type {family.get('model_type')!r}")
    elif family["name"] == "generic":
        lines.append(
            "target family: generic decoder-only path "
            f"(no module for model_type {family.get('model_type')!r})"
        )
    else:
        needs = family.get("engine_patches") or []
        listed = ", ".join(f"{need['name']} ({need['status']})" for need in needs) or "none"
        lines.append(f"target family {family['name']}: engine patches needed: {listed}")
        for need in needs:
            if not need["ok"]:
                lines.append(f"  WARNING: the family needs patch {need['name']}, which is {need['status']}")
    eagle3 = report.get("eagle3")
    if eagle3:
        lines.append(f"target class {eagle3.get('class')}: EAGLE-3 {eagle3.get('support')}")
    ids = report.get("layer_ids")
    if ids:
        lines.append(
            f"aux layer ids: engine ({ids['engine_convention']}) {ids['engine_ids']} = layer_input "
            f"{ids['layer_input_ids']}; trained on layer_input {ids['trained_layer_input_ids']}"
        )
        if ids.get("consistent") is False:
            lines.append("  WARNING: the engine will capture other layers than the drafter was trained on")
    drafter = report.get("drafter")
    if isinstance(drafter, dict) and drafter.get("in_range") is False:
        lines.append("  WARNING: some aux layer ids are out of range for this target")
    for refusal in refusals(report):
        lines.append(f"REFUSED: {refusal}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# EAGLE-3 support of the target's class, read from the engine's installed source (no engine import)


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
    registry = _vllm_registry(vllm_dir / "model_executor" / "models" / "registry.py")
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
    native = _implements(vllm_dir, _module_path(vllm_dir, module), class_name, "SupportsEagle3", 0)
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
def _vllm_registry(path: Path) -> dict[str, tuple[str, str]]:
    """architecture -> (module under model_executor/models, class), as vLLM's `_VLLM_MODELS` merges its
    tables (later tables win)."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    order: list[str] = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
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


def _module_path(vllm_dir: Path, module: str) -> Path:
    """The file of a registry module name ("llama", or absolute "vllm.x.y")."""
    if module.startswith("vllm."):
        base = vllm_dir.joinpath(*module.split(".")[1:])
    else:
        base = vllm_dir.joinpath("model_executor", "models", *module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@lru_cache(maxsize=256)
def _parsed(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


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
