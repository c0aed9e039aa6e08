"""`draftloop diagnose`: is a bad number the drafter's fault or the engine's — for any drafter folder.

One evaluation (evaluate(): the contract check, baseline and speculative servers, the simulator in the
engine's numeric mode along the engine's own output) gives the engine's acceptance and the verdict.
Then the cause: the engine's acceptance is one number; the simulator can reproduce it under each
*reading* of the folder — which target layers feed the drafter's fc. Two sets of readings:

- what the engine does with the folder: its config's ids in the engine's convention, or the engine's
  defaults (2, N//2, N-3) when the config names none;
- what the drafter was trained on: the ids its draftloop record names; without a record, its config's
  ids read in either convention (the reading is stated).

Replaying the engine's output under each reading costs a simulator pass, no server. When a trained
reading accepts clearly more than the engine's, the engine feeds the drafter other layers than it learnt
on: `integration_fault`, the cause named (convention or missing ids) with the export command that fixes
it. An integration fault no reading explains says where engine and reference part first (divergence.py).
When they agree, the evaluation's own verdict stands (`ok`, `weak_drafter`, or `measurement_error`
when the measurement cannot decide).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import Engine, drafter_config_layer_ids, read_json, stored_layer_ids
from draftloop.infra.engines.pairing import (
    ContractIssue,
    DrafterPairingError,
    ServingContract,
    check_drafter_contract,
)
from draftloop.infra.evaluation.benchmark import ServerRun
from draftloop.infra.evaluation.divergence import Divergence, first_divergence
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.report import EvalReport
from draftloop.infra.evaluation.run import evaluate
from draftloop.infra.evaluation.simulator import (
    DrafterReading,
    engine_numeric_mode,
    run_simulator,
    simulator_numeric_mode,
)
from draftloop.infra.evaluation.verdict import (
    SPEEDUP_MEASUREMENT_ERROR,
    VERDICT_FAULT,
    VERDICT_INCONCLUSIVE,
    VERDICT_MODE_MISMATCH,
    VERDICT_OK,
    VERDICT_WEAK,
)
from draftloop.kernels.checkpoint import read_drafter_config
from draftloop.kernels.families.base import family_for_config
from draftloop.kernels.files import DrafterFormatError
from draftloop.kernels.layer_ids import LayerIds

MEASUREMENT_ERROR = "measurement_error"
# Exit codes a script can gate on (0 ok; 2 is a bad input, as everywhere in the CLI).
EXIT_CODES = {VERDICT_OK: 0, VERDICT_WEAK: 3, VERDICT_FAULT: 4, MEASUREMENT_ERROR: 5}
# A trained reading must beat the engine's by this many times the acceptance tolerance to be the cause:
# readings of one drafter differ a little by chance on a few prompts.
CAUSE_MARGIN = 2.0


@dataclass(frozen=True)
class FolderReading:
    """What the folder says of itself: its format, its ids, and whether it carries a training record."""

    path: str
    format: str  # draftloop | vllm | sglang | speculators
    config_ids: list[int] | None  # eagle_aux_hidden_state_layer_ids as written (top level or eagle_config)
    trained_ids: list[int] | None  # layer_input, from the draftloop record
    stated: str  # how the folder was read, for the report
    # Whether its drafter hands on the hidden state after its final norm (EAGLE 3.1's norm_output), as
    # the config says; None when the config cannot be read as a drafter's.
    norm_output: bool | None = None


@dataclass(frozen=True)
class Reading:
    """One reading of the folder: the target layers (layer_input) that feed the drafter's fc."""

    label: str
    capture_ids: tuple[int, ...]
    engine_reads: bool  # what the engine does with the folder
    trained: bool  # a candidate for what the drafter was trained on
    norm_output: bool | None = None  # hand on the state after the final norm or not; None: as the config


@dataclass
class ReadingFigures:
    reading: Reading
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position: list[float | None]


@dataclass(frozen=True)
class Cause:
    name: str  # layer_id_convention | missing_layer_ids | contract:<clause> | unexplained
    explanation: str
    fix: str | None  # a command


@dataclass
class Diagnosis:
    verdict: str  # ok | weak_drafter | integration_fault | measurement_error
    reasons: list[str]
    folder: FolderReading
    cause: Cause | None = None
    engine: dict[str, Any] | None = None  # acceptance_rate, mean_acceptance_length, per_position
    simulator: dict[str, Any] | None = None  # the same, the drafter as the engine reads it
    readings: list[ReadingFigures] = field(default_factory=list)
    speedup: dict[str, Any] = field(default_factory=dict)  # concurrency -> speedup, interval, status
    divergence: Divergence | None = None  # where engine and reference first part (an unexplained fault)
    served_command: str | None = None
    smoke_text: str | None = None
    report_path: str | None = None
    report: EvalReport | None = field(default=None, repr=False)  # the evaluation (eval_report.json)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict[str, Any]:
        data = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "report"}
        return json.loads(json.dumps(data, default=_plain)) | {"exit_code": self.exit_code}


def _plain(value: Any) -> Any:
    return asdict(value)


def read_folder(drafter_dir: Path) -> FolderReading:
    """How the folder describes itself (DrafterFormatError-free: load_drafter judges the weights)."""
    config = read_json(drafter_dir / "config.json")
    ids = drafter_config_layer_ids(config)
    trained = stored_layer_ids(config)
    if config.get("speculators_model_type"):
        fmt = "speculators"
    elif isinstance(config.get("eagle_config"), dict):
        fmt = "sglang"  # SGLang/SpecForge: ids nested in eagle_config
    else:
        fmt = "draftloop" if trained is not None else "vllm"
    if trained is not None:
        stated = f"{fmt} format, draftloop record: trained on layer_input {list(trained.as_input())}"
    else:
        stated = f"{fmt} format, no draftloop record: its ids read in both conventions"
    if ids is None:
        stated += "; its config names no aux layer ids"
    try:  # (the variant does not depend on the ids' convention)
        options = read_drafter_config(drafter_dir, "layer_input").variant_options
        norm_output: bool | None = bool(options.get("norm_output", False))
    except DrafterFormatError:
        norm_output = None
    return FolderReading(
        str(drafter_dir), fmt, ids, list(trained.as_input()) if trained is not None else None, stated,
        norm_output,
    )  # fmt: skip


def readings_of(engine: Engine, folder: FolderReading, depth: int) -> list[Reading]:
    """The engine's reading of the folder and the candidates for what the drafter was trained on."""
    defaults = tuple(LayerIds.default_for_depth(depth).ids)  # what draftloop trains on without ids
    if folder.config_ids is not None:
        served = LayerIds.parse(folder.config_ids, engine.layer_id_convention).as_input()
        engine_label = f"{engine.kind} reads {folder.config_ids} as {engine.layer_id_convention}"
    else:
        served = engine.fallback_capture_ids(depth)
        engine_label = f"{engine.kind}'s defaults (2, N//2, N-3): the config names no ids"
    readings = [Reading(engine_label, tuple(served), engine_reads=True, trained=False)]
    if folder.trained_ids is not None:
        candidates = [("as trained (draftloop record)", tuple(folder.trained_ids))]
    elif folder.config_ids is not None:
        candidates = [
            (
                f"{folder.config_ids} as {convention}",
                tuple(LayerIds.parse(folder.config_ids, convention).as_input()),
            )
            for convention in ("layer_input", "layer_output")
        ]
    else:
        candidates = [("the common defaults (no ids anywhere)", defaults)]
    for label, ids in candidates:
        if ids == tuple(served):  # the engine reads it one way it may have been trained on
            merged = f"{readings[0].label}, {label}" if folder.trained_ids is not None else readings[0].label
            readings[0] = Reading(merged, ids, engine_reads=True, trained=True)
        elif all(0 <= i < depth for i in ids):
            readings.append(Reading(label, ids, engine_reads=False, trained=True))
    if folder.trained_ids is None and folder.norm_output is not None:
        # A published folder: nothing records which hidden state its drafter learnt to hand on; a config
        # that says the other one makes the engine feed every later draft step a state it never saw.
        flipped = not folder.norm_output
        label = (
            f"the hidden state handed on {'after' if flipped else 'before'} the final norm "
            f"(norm_output {str(flipped).lower()}; the config says {str(folder.norm_output).lower()})"
        )
        readings.append(Reading(label, readings[0].capture_ids, False, True, norm_output=flipped))
    return readings


def _view(drafter_dir: Path, view: Path, config: dict[str, Any]) -> Path:
    """A folder of `config` beside the drafter's weights (linked): the same drafter, read otherwise."""
    view.mkdir(parents=True, exist_ok=True)
    (view / "config.json").write_text(json.dumps(config, indent=2))
    for weights in drafter_dir.glob("*.safetensors"):
        target = view / weights.name
        if not target.exists():
            target.symlink_to(weights.resolve())
    return view


def _loadable_view(drafter_dir: Path, work: Path, ids: Sequence[int]) -> Path:
    """The folder with `ids` (layer_input) written into its config, for a config that names none: the
    simulator needs some ids to build the drafter; each reading feeds it its own layers anyway."""
    config = read_json(drafter_dir / "config.json") | {"eagle_aux_hidden_state_layer_ids": list(ids)}
    return _view(drafter_dir, work / "drafter-view", config)


def _norm_output_view(drafter_dir: Path, work: Path, ids: Sequence[int], norm_output: bool) -> Path:
    """The folder read as a published vLLM folder whose drafter hands on the state after its final norm
    (`norm_output`) or before it; its ids (layer_input) and other variant fields as the folder's."""
    options = read_drafter_config(drafter_dir, "layer_input").variant_options
    config = {k: v for k, v in read_json(drafter_dir / "config.json").items() if k != "draftloop"}
    config |= {
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "fc_norm": bool(options.get("fc_norm", False)),
        "norm_before_fc": bool(options.get("norm_before_fc", False)),
        "norm_output": norm_output,
    }
    return _view(drafter_dir, work / f"drafter-view-norm-output-{str(norm_output).lower()}", config)


def _engine_figures(report: EvalReport) -> dict[str, Any] | None:
    counters = report.engine_acceptance
    if not counters:
        return None
    drafts, tokens = float(counters["num_drafts"]), float(counters["num_draft_tokens"])
    accepted = float(counters["num_accepted_tokens"])
    return {
        "acceptance_rate": accepted / tokens if tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position": [count / drafts for count in counters.get("accepted_per_position", [])]
        if drafts
        else [],
    }


def _served_command(report: EvalReport) -> str | None:
    log = report.speculative.log_path
    if not log or not Path(log).is_file():
        return None
    first = Path(log).read_text(errors="replace").splitlines()[:1]
    return first[0].removeprefix("# draftloop: ") if first else None


def _export_fix(folder: FolderReading, engine: Engine, convention: str | None) -> str:
    flag = f" --convention {convention}" if convention else ""
    out = f"{folder.path}-{engine.kind}"
    return f"draftloop export --drafter {folder.path} --engine {engine.kind}{flag} --out {out}"


def find_cause(
    engine: Engine,
    folder: FolderReading,
    figures: list[ReadingFigures],
    engine_rate: float | None,
    tolerance: float,
) -> Cause | None:
    """The cause of a gap between the engine's reading and the best trained one (None: no such gap)."""
    served = next(f for f in figures if f.reading.engine_reads)
    trained = [f for f in figures if f.reading.trained and f.acceptance_rate is not None]
    if not trained or served.acceptance_rate is None:
        return None
    best = max(trained, key=lambda f: f.acceptance_rate or 0.0)
    if best is served or (best.acceptance_rate or 0.0) - served.acceptance_rate <= CAUSE_MARGIN * tolerance:
        return None
    if best.reading.norm_output is not None:
        return Cause(
            "final_norm",
            f"{engine.kind} hands the drafter's next step the state "
            f"{'after' if folder.norm_output else 'before'} its final norm, as the config's norm_output "
            f"{str(folder.norm_output).lower()} says (the simulator gives {served.acceptance_rate:.3f} for "
            f"that reading); read as {best.reading.label}, it accepts {best.acceptance_rate:.3f}",
            f'set "norm_output": {str(best.reading.norm_output).lower()} in {folder.path}/config.json',
        )
    explained = engine_rate is not None and abs(engine_rate - served.acceptance_rate) <= tolerance
    matched = (
        f"the engine's acceptance {engine_rate:.3f} matches this reading's {served.acceptance_rate:.3f}"
        if explained and engine_rate is not None
        else f"the simulator gives {served.acceptance_rate:.3f} for this reading"
    )
    gap = (
        f"{engine.kind} feeds the drafter target layers {list(served.reading.capture_ids)} (layer_input; "
        f"{served.reading.label}) — {matched} — while read as {best.reading.label} it was trained on "
        f"{list(best.reading.capture_ids)}, where it accepts {best.acceptance_rate:.3f}"
    )
    if folder.config_ids is None:
        return Cause("missing_layer_ids", gap, _export_fix(folder, engine, None))
    if folder.trained_ids is not None:
        return Cause(
            "layer_id_convention",
            gap + " (ids exported in the wrong convention)",
            _export_fix(folder, engine, None),
        )
    convention = "layer_output" if "layer_output" in best.reading.label else "layer_input"
    return Cause(
        "layer_id_convention",
        f"{gap}: the folder's ids are in the {convention} convention",
        _export_fix(folder, engine, convention),
    )


def _fallback_too_short(engine: Engine, folder: FolderReading, served: Reading, depth: int) -> Cause | None:
    """A config without ids on a target too shallow for the engine's three defaults to be distinct."""
    fused = len(folder.trained_ids or folder.config_ids or (0, 0, 0))  # EAGLE-3's fc fuses three
    if folder.config_ids is not None or len(served.capture_ids) == fused:
        return None
    trained = (
        f"; its draftloop record says it was trained on {folder.trained_ids}" if folder.trained_ids else ""
    )
    return Cause(
        "missing_layer_ids",
        f"{folder.path}/config.json names no eagle_aux_hidden_state_layer_ids, so {engine.kind} captures "
        f"its defaults (2, N//2, N-3) = {(2, depth // 2, depth - 3)} of a {depth}-layer target: "
        f"{len(served.capture_ids)} distinct layers {list(served.capture_ids)} for an fc that fuses "
        f"{fused}{trained}",
        _export_fix(folder, engine, None)
        if folder.trained_ids
        else "write the layers it was trained on as eagle_aux_hidden_state_layer_ids in its config.json",
    )


# Contract clauses that are a known way of serving a drafter other than it was trained, by cause name.
CONTRACT_CAUSES = {
    "d2t": "d2t_as_ids",
    "max_position_embeddings": "rope_shorter_than_served",
    "rope_theta": "rope_mismatch",
    "rope_scaling": "rope_mismatch",
    "final_norm": "final_norm",
    "target_dtype": "served_dtype",
}


def contract_cause(issue: ContractIssue, folder: FolderReading) -> Cause:
    """A broken contract clause as a diagnosis cause, with the fix where one command gives it."""
    name = CONTRACT_CAUSES.get(issue.check, f"contract:{issue.check}")
    fix = None
    if issue.check == "drafter_config" and folder.config_ids is None and folder.trained_ids is None:
        name = "missing_layer_ids"  # the engine falls back to its defaults; nothing says what it learnt on
        fix = "write the layers it was trained on as eagle_aux_hidden_state_layer_ids in its config.json"
    if name == "rope_shorter_than_served":
        fix = (
            "serve at most the drafter's max_position_embeddings tokens (--max-model-len), or train it longer"
        )
    return Cause(name, f"refused before serving: {issue}", fix)


def _overall(report: EvalReport, judge_speedup: bool) -> tuple[str, list[str]]:
    """The evaluation's verdict in diagnose's four: an undecidable measurement is measurement_error.
    Speedups measured against a baseline of another run (`judge_speedup` False) are reported, not judged:
    load that changed between the two runs moves the ratio."""
    verdict, reasons = report.verdict, list(report.reasons)
    if verdict in (VERDICT_MODE_MISMATCH, VERDICT_INCONCLUSIVE):
        return MEASUREMENT_ERROR, reasons
    if not judge_speedup:
        return verdict, [*reasons, "speedup not judged: the baseline was measured in another run"]
    errors = [level for level in report.speedup_levels if level.status == SPEEDUP_MEASUREMENT_ERROR]
    if verdict == VERDICT_OK and errors:
        return MEASUREMENT_ERROR, reasons + [
            f"speedup at concurrency {level.concurrency}: {'; '.join(level.reasons)}" for level in errors
        ]
    return verdict, reasons


def diagnose(
    engine: Engine,
    plan: EvaluationPlan,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    run_dir: Path,
    *,
    baseline: ServerRun | None = None,
) -> Diagnosis:
    """Serve and simulate `drafter_dir` on `target_dir` (see the module's docstring). `baseline`: the
    target's server measured before on the same prompts (evaluate()'s; skips the baseline server)."""
    target_dir, drafter_dir, run_dir = Path(target_dir).resolve(), Path(drafter_dir).resolve(), Path(run_dir)
    folder = read_folder(drafter_dir)
    depth = int(read_json(target_dir / "config.json").get("num_hidden_layers") or 0)
    readings = readings_of(engine, folder, depth)
    served = readings[0]
    # The evaluation's simulator reads the folder as the engine does (its verdict: did the engine run
    # the drafter the way it reads the folder?); the trained readings come after.
    view = _loadable_view(drafter_dir, run_dir, served.capture_ids) if folder.config_ids is None else None
    as_served = DrafterReading(
        convention=None if folder.trained_ids is not None else "layer_input",
        capture_ids=LayerIds(served.capture_ids, "layer_input"),
        folder=view,
    )
    serving = ServingContract.from_engine(engine)
    broken = [i for i in check_drafter_contract(target_dir, drafter_dir, serving) if i.severity == "error"]
    if broken:  # the pairing cannot work as served: named in seconds, before any server starts
        return Diagnosis(
            VERDICT_FAULT, [str(issue) for issue in broken], folder, contract_cause(broken[0], folder)
        )
    short = _fallback_too_short(engine, folder, served, depth)
    if short is not None:  # the server would start, then fail at its first request
        return Diagnosis(VERDICT_FAULT, [short.explanation], folder, short)
    try:
        report = evaluate(
            engine, plan, target_dir, drafter_dir, prompts, run_dir, reading=as_served, baseline=baseline
        )
    except DrafterPairingError as error:  # a clause the check above passed, refused on the way in
        return Diagnosis(
            VERDICT_FAULT,
            [f"{error.field}: {error.reason}"],
            folder,
            Cause("contract", f"refused before serving: {error.reason}", None),
        )
    follow = report.speculative.output_token_ids
    replay = follow if len(follow) == len(prompts) and all(follow) else None
    attention = family_for_config(read_json(target_dir / "config.json")).drafter_attention
    mode = simulator_numeric_mode(engine_numeric_mode(engine.settings, target_dir, attention), attention)
    figures: list[ReadingFigures] = []
    for reading in readings:
        if reading is served and report.simulator is not None:
            sim = report.simulator
            figures.append(
                ReadingFigures(
                    reading,
                    sim.get("acceptance_rate"),
                    sim.get("mean_acceptance_length"),
                    sim.get("per_position") or [],
                )
            )
            continue
        if reading.norm_output is not None:
            flipped = _norm_output_view(drafter_dir, run_dir, reading.capture_ids, reading.norm_output)
            simulated = DrafterReading(convention="layer_input", folder=flipped)
        else:
            simulated = DrafterReading(
                convention=as_served.convention,
                capture_ids=LayerIds(reading.capture_ids, "layer_input"),
                folder=view,
            )
        result = run_simulator(
            target_dir,
            drafter_dir,
            prompts,
            plan.num_speculative_tokens,
            plan.max_tokens,
            mode=mode,
            follow_token_ids=replay,
            trust_remote_code=plan.trust_remote_code,
            reading=simulated,
        )
        figures.append(
            ReadingFigures(
                reading, result.acceptance_rate, result.mean_acceptance_length, result.per_position
            )
        )
    engine_rate = report.consistency.get("engine_rate") if report.consistency else None
    cause = find_cause(engine, folder, figures, engine_rate, report.acceptance_tolerance)
    verdict, reasons = _overall(report, judge_speedup=baseline is None)
    if cause is not None:
        verdict, reasons = (
            VERDICT_FAULT,
            [cause.explanation, *[r for r in reasons if r not in (cause.explanation,)]],
        )
    divergence: Divergence | None = None
    if cause is None and verdict == VERDICT_FAULT:
        divergence = first_divergence(
            report.baseline, report.speculative, report.mismatched_prompts, report.simulator,
            report.engine_acceptance, report.acceptance_tolerance,
        )  # fmt: skip
        where = f"; they part first at {divergence.describe()}" if divergence is not None else ""
        cause = Cause(
            "unexplained",
            f"no known cause reproduces the engine's acceptance (readings tried above){where}",
            None,
        )
    return Diagnosis(
        verdict,
        reasons,
        folder,
        cause,
        engine=_engine_figures(report),
        simulator=_figures_json(report.simulator),
        readings=figures,
        divergence=divergence,
        speedup={str(level.concurrency): asdict(level) for level in report.speedup_levels},
        served_command=_served_command(report),
        smoke_text=report.speculative.smoke_content,
        report_path=str(run_dir / "eval_report.json"),
        report=report,
    )


def _figures_json(simulator: dict[str, Any] | None) -> dict[str, Any] | None:
    if not simulator:
        return None
    return {key: simulator.get(key) for key in ("acceptance_rate", "mean_acceptance_length", "per_position")}


def clean_run_dir(run_dir: Path) -> None:
    """A diagnosis's scratch folder, emptied before it starts (servers' logs of an earlier one)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)


def _rate(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def format_diagnosis(diagnosis: Diagnosis) -> str:
    """The verdict first, then engine and simulator side by side, the readings, the cause and its fix."""
    lines = [f"verdict: {diagnosis.verdict}"]
    lines += [f"  - {reason}" for reason in diagnosis.reasons]
    lines.append(f"folder: {diagnosis.folder.path} ({diagnosis.folder.format}; {diagnosis.folder.stated})")
    engine, simulator = diagnosis.engine or {}, diagnosis.simulator or {}
    lines.append(f"{'':28}{'engine':>10}{'simulator':>11}")
    for label, key in (
        ("acceptance rate", "acceptance_rate"),
        ("mean acceptance length", "mean_acceptance_length"),
    ):
        lines.append(f"{label:28}{_rate(engine.get(key)):>10}{_rate(simulator.get(key)):>11}")
    positions = max(len(engine.get("per_position") or []), len(simulator.get("per_position") or []))
    for index in range(positions):
        engine_value = (engine.get("per_position") or [None] * positions)[index]
        simulator_value = (simulator.get("per_position") or [None] * positions)[index]
        lines.append(f"{'  position ' + str(index):28}{_rate(engine_value):>10}{_rate(simulator_value):>11}")
    if diagnosis.readings:
        lines.append("readings (the simulator along the engine's output):")
        for figures in diagnosis.readings:
            marks = ", ".join(
                m
                for m, on in (("engine", figures.reading.engine_reads), ("trained", figures.reading.trained))
                if on
            )
            layers = list(figures.reading.capture_ids)
            lines.append(
                f"  layers {layers} ({figures.reading.label}; {marks}): acceptance "
                f"{_rate(figures.acceptance_rate)}, AL {_rate(figures.mean_acceptance_length)}"
            )
    for level, speedup in diagnosis.speedup.items():
        lines.append(
            f"speedup at concurrency {level}: {_rate(speedup.get('speedup'), 2)}x "
            f"[{_rate(speedup.get('low'), 2)}, {_rate(speedup.get('high'), 2)}] {speedup.get('status')} "
            f"({speedup.get('method')})"
        )
    if diagnosis.cause is not None:
        lines.append(f"cause: {diagnosis.cause.name}: {diagnosis.cause.explanation}")
        if diagnosis.cause.fix:
            lines.append(f"fix: {diagnosis.cause.fix}")
    if diagnosis.served_command:
        lines.append(f"served: {diagnosis.served_command}")
    if diagnosis.smoke_text is not None:
        lines.append(f"smoke request: {diagnosis.smoke_text!r}")
    return "\n".join(lines)
