"""`draftloop engine doctor`: what the engine will do with a target and a drafter, asked of the engine.

The probe runs in the engine's own Python (the orchestrator never imports the engine): each engine names
its probe in `Engine.doctor_command` (vLLM's ships with draftloop's plugin in the engine environment).
`refusals(report)` lists what in the report the cycle would refuse (the command exits 2 on any).
Config validation cannot wait for the probe (it imports the engine): infra/engines/class_support.py
reads the one answer it needs from the engine's source.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
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
    target_config = read_json(target_dir / "config.json")
    trust = engine.settings.trust_remote_code
    result["family"] = describe_family(target_config, result.get("patches"), target_dir, trust)
    try:
        check_target(target_config, folder=target_dir, trust_remote_code=trust)
    except TargetRefusedError as error:
        result["target_refused"] = str(error)
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
    or the engine reported no such patch); name None when the cycle cannot take it (`run_doctor` says why)."""
    from draftloop.kernels.families.base import get_family

    try:
        support = check_target(target_config, folder=target_dir, trust_remote_code=trust_remote_code)
    except TargetRefusedError:
        return {"name": None, "model_type": target_config.get("model_type")}
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
    found: list[str] = [str(report["target_refused"])] if report.get("target_refused") else []
    family = report.get("family") or {}
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
