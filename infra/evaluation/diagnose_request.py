"""What `draftloop diagnose` and the `diagnose` deployment are asked: one typed request, checked up front
(a bad input is refused by name before any server starts), then run (infra/evaluation/diagnose.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from draftloop.infra.engines.base import get_engine
from draftloop.infra.evaluation.diagnose import Diagnosis, clean_run_dir, diagnose
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.prompt_file import PromptFileError, read_prompts_file
from draftloop.infra.runtime.config import EngineConfig, EvaluationConfig, GateConfig

if TYPE_CHECKING:
    from draftloop.infra.registry.external import ExternalVersion

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN_PROMPTS = REPO_ROOT / "draftloop" / "data" / "prompts.jsonl"


class DiagnoseInputError(ValueError):
    """A request that cannot be diagnosed: `field` names the input, the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def not_a_drafter(folder: Path) -> str | None:
    """Why `folder` is no EAGLE-3 drafter (no config, no weights, no fc fusing the aux layers), else
    None. A config without layer ids is a drafter still: what the engine does then is a diagnosis."""
    from safetensors import safe_open

    if not (folder / "config.json").is_file():
        return f"{folder} is not a drafter folder (no config.json)"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return f"{folder} holds no .safetensors weights"
    names: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                names.update(handle.keys())
        except Exception as error:  # a truncated file raises safetensors' own SafetensorError
            return f"{path}: cannot read ({error})"
    if not any(name.split(".")[-2:] == ["fc", "weight"] for name in names):
        return (
            f"{folder} is no EAGLE-3 drafter: its weights have no fc.weight (the layer fusing the aux states)"
        )
    return None


class DiagnoseRequest(BaseModel):
    """One diagnosis: the pair, the engine that serves it, and how it is measured."""

    target: Path
    drafter: Path
    engine: Literal["vllm", "sglang"] = "vllm"
    prompts: Path | None = None  # JSONL or text, one prompt per line (None: the shipped set)
    num_prompts: int = Field(default=8, ge=1)
    k: int = Field(default=3, ge=1)
    max_tokens: int = Field(default=32, ge=1)
    concurrency: list[int] = Field(default_factory=lambda: [1])
    python: str | None = None  # the engine's Python (None: the repository's .venvs/<engine>)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_model_len: int = Field(default=1024, ge=16)
    # A thinking target's reasoning parser (e.g. deepseek_r1): the servers start with it and the smoke
    # request must return reasoning and content apart. None: not a thinking target.
    reasoning_parser: str | None = None
    min_acceptance_length: float = Field(default=1.5, ge=1.0)  # under it a drafter run right is weak
    out: Path = Path(".draftloop/diagnose")
    # Register the drafter as an external baseline version of this registered model (None: do not).
    register_as: str | None = None
    alias: str | None = None  # the alias the baseline version gets (e.g. baseline; gate.beat names it)
    tracking_uri: str = "sqlite:///.draftloop/mlflow.db"
    artifact_root: str = ".draftloop/mlartifacts"
    experiment: str = "draftloop"

    def prompt_texts(self) -> list[str]:
        try:
            return read_prompts_file(self.prompts or BUILTIN_PROMPTS)[: self.num_prompts]
        except PromptFileError as error:
            raise DiagnoseInputError("prompts", str(error)) from None

    def check(self) -> list[str]:
        """Refuse what cannot be diagnosed, by name (DiagnoseInputError); the prompts to use."""
        if not (self.target / "config.json").is_file():
            raise DiagnoseInputError("target", f"{self.target} is not a model folder (no config.json)")
        problem = not_a_drafter(self.drafter)
        if problem is not None:
            raise DiagnoseInputError("drafter", problem)
        return self.prompt_texts()

    def run(self) -> Diagnosis:
        prompts = self.check()
        try:
            section = EvaluationConfig(
                max_tokens=self.max_tokens,
                concurrency=self.concurrency,
                repeats=3,  # ABBA pairs with the baseline: a speedup interval, not one ratio
                warmup_rounds=0,
                gate=GateConfig(min_acceptance_length=self.min_acceptance_length),
            )
        except ValueError as error:
            raise DiagnoseInputError("concurrency", str(error).splitlines()[-1]) from None
        settings = EngineConfig(
            kind=self.engine, dtype=self.dtype, max_model_len=self.max_model_len
        ).settings(trust_remote_code=False)
        python = self.python or str(REPO_ROOT / ".venvs" / self.engine / "bin" / "python")
        engine = get_engine(
            self.engine, replace(settings, python=python, reasoning_parser=self.reasoning_parser)
        )
        plan = EvaluationPlan.from_sections(section, num_speculative_tokens=self.k, trust_remote_code=False)
        clean_run_dir(self.out)
        return diagnose(engine, plan, self.target, self.drafter, prompts, self.out)

    def register(self, diagnosis: Diagnosis) -> ExternalVersion | None:
        """The diagnosed drafter as an external baseline version in the registry (`register_as`)."""
        if self.register_as is None:
            return None
        from draftloop.infra.registry.external import register_external
        from draftloop.infra.registry.runs import Tracker

        tracker = Tracker(self.tracking_uri, self.artifact_root, self.experiment)
        return register_external(tracker, self.register_as, diagnosis, self.engine, self.k, self.alias)
