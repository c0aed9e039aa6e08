"""The typed experiment config (configs/*.yaml) and its validation.

`ExperimentConfig.load(path, overrides)` parses the YAML, applies dotted-key overrides, checks the
schema (unknown fields are errors) and then checks the config against the world before anything is
created or loaded: the target's depth and hidden size come from its config.json (never its weights) or,
for a zoo recipe not yet built, from the recipe; aux layer ids must fit that depth; a drafter to
fine-tune must match the target's hidden size; the engine and its Python must exist; the storage root
must be writable (local) or its bucket must exist (S3); what the target can or cannot do, in seconds
(infra/targets/support.py). With the target folder at hand, a drafter to fine-tune must keep the drafter
contract (infra/engines/pairing.py: its tensors, RoPE, aux ids' convention) before any stage runs. Every
failure is a `ConfigError(field, reason)`.

Relative local paths resolve at load time against the config file's folder (the repository for its own
configs/*.yaml), whatever the cwd (`base_dir` overrides), so the config means the same in every process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from draftloop.infra.engines.base import (
    EngineConfigError,
    EngineSettings,
    convention_for,
    engine_class,
    is_loopback,
)
from draftloop.infra.engines.pairing import FineTuneContract, check_drafter_contract
from draftloop.infra.targets import zoo
from draftloop.infra.targets.support import TargetRefusedError, refuse_unsupported_target, target_model_config
from draftloop.kernels.data import RankSplit
from draftloop.kernels.drafter import DrafterConfig
from draftloop.kernels.families.base import (
    TargetFamily,
    UnknownFamilyError,
    config_value,
    family_for_config,
    language_model_config,
)
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.train import LrSchedule, TrainConfig

EAGLE3_NUM_AUX_LAYERS = 3


class ConfigError(ValueError):
    """A user error in the experiment config: `field` is the dotted field name (or the file)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(_Section):
    path: str
    create: str | None = None  # zoo recipe that builds `path` when it is missing
    seed: int = 0
    # Run the Python code a model folder ships (transformers' and the engine's trust_remote_code) only
    # when the config names the target as trusted.
    trust_remote_code: bool = False


class DataConfig(_Section):
    prompts: str = "builtin"
    num_samples: int = Field(default=256, ge=1)
    eval_prompts: int = Field(default=16, ge=1)
    max_length: int = Field(default=256, ge=8)
    over_length: Literal["skip", "truncate"] = "skip"  # a prompt with no room for an answer (any row)
    eval_prompt_max_tokens: int | None = Field(default=None, ge=1)  # eval prompts' cap; null = max_length
    max_shortfall_fraction: float = Field(default=1.0, ge=0.0, le=1.0)  # more of num_samples missing: error
    chat_template: str = "auto"
    # auto: each file's format from its rows; prompt {id, prompt}; sharegpt {conversations: [{from, value}]};
    # openai {messages: [{role, content}]} (JSONL or parquet, local or S3; infra/synthesis/prompts.py)
    format: Literal["auto", "prompt", "sharegpt", "openai"] = "auto"
    # skip: a bad row goes to rejected.jsonl (file, line, reason); fail: the first bad row ends the run
    on_bad_row: Literal["skip", "fail"] = "skip"
    # skipped rows beyond this share of all rows still end the run
    max_rejected_fraction: float = Field(default=0.1, ge=0.0, le=1.0)


class SynthesisConfig(_Section):
    backend: Literal["in_process", "engine"] = "in_process"
    max_new_tokens: int = Field(default=96, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    concurrency: int = Field(default=8, ge=1)
    num_gpus: float = Field(default=0, ge=0)
    # engine backend: tries per chat request before the conversation is rejected (rejected.jsonl)
    max_attempts: int = Field(default=3, ge=1)
    # a thinking target's reasoning parser (e.g. deepseek_r1): the synthesis server's and the evaluation's
    # (their smoke requests check reasoning and content come apart); null = not a thinking target
    reasoning_parser: str | None = None
    # engine backend: extra fields of every chat request (e.g. {"thinking_token_budget": 64} on vLLM)
    extra_body: dict[str, Any] = Field(default_factory=dict)


class ExtractionConfig(_Section):
    # in_process: the Hugging Face target in Ray actors; engine: the engine server computes them
    backend: Literal["in_process", "engine"] = "in_process"
    aux_layer_ids: list[int] | None = None  # null = the default for the target's depth
    # layer_input | layer_output, or an engine's name for the convention that engine reads.
    layer_id_convention: str = "layer_input"
    samples_per_shard: int = Field(default=64, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    num_actors: int = Field(default=1, ge=1)
    num_gpus_per_actor: float = Field(default=0, ge=0)
    # offline: the extract stage stores every hidden state; online: no extract stage, the train stage
    # streams them from producer actors to its workers through Ray's object store, none stored; hybrid:
    # online, and epoch 0 also stores shards up to storage_budget, which later epochs read back.
    mode: Literal["offline", "online", "hybrid"] = "offline"
    storage_budget: ByteSize | None = None  # hybrid only: bytes of hidden states it may store ("200GB")
    # online/hybrid: bytes produced and not yet trained; null = a quarter of Ray's object store
    max_bytes_in_flight: ByteSize | None = None
    # online/hybrid: a custom Ray resource of the nodes that hold the target: producers run there only
    producer_resource: str | None = None

    @field_validator("layer_id_convention")
    @classmethod
    def _known_convention(cls, value: str) -> str:
        return convention_for(value)

    @model_validator(mode="after")
    def _budget_only_for_hybrid(self) -> ExtractionConfig:
        if self.mode == "hybrid" and self.storage_budget is None:
            raise ValueError("storage_budget: mode hybrid needs a storage budget (bytes, e.g. '200GB')")
        if self.mode != "hybrid" and self.storage_budget is not None:
            raise ValueError(f"storage_budget: only mode hybrid stores under a budget (mode is {self.mode})")
        return self


AdamBeta = Annotated[float, Field(ge=0, lt=1)]


class TrainingConfig(_Section):
    drafter_init: str | None = None
    # The convention of a drafter_init folder's aux ids when it has no draftloop block to record it
    # (layer_input | layer_output, or the engine that reads them); null = the folder must record it.
    drafter_init_convention: str | None = None
    draft_vocab_size: int | None = Field(default=None, ge=1)
    # The drafter variant (kernels/variants/: eagle3 | eagle3.1) and its options ({}: the variant's
    # defaults; eagle3.1: fc_norm, norm_before_fc, norm_output). A drafter_init keeps its folder's.
    drafter: str = "eagle3"
    drafter_options: dict[str, bool] = Field(default_factory=dict)
    # The training loop's settings take their defaults from kernels/train.py's TrainConfig (the one place
    # they are declared; it says why the last three).
    ttt_length: int = Field(default=TrainConfig.ttt_length, ge=1)
    epochs: int = Field(default=TrainConfig.epochs, ge=1)
    batch_size: int = Field(default=TrainConfig.batch_size, ge=1)
    lr: float = Field(default=TrainConfig.lr, gt=0)
    warmup_ratio: float = Field(default=TrainConfig.warmup_ratio, ge=0, lt=1)
    weight_decay: float = Field(default=TrainConfig.weight_decay, ge=0)
    grad_clip: float = Field(default=TrainConfig.grad_clip, ge=0)
    # batch_size * grad_accum samples per step, all workers together
    grad_accum: int = Field(default=TrainConfig.grad_accum, ge=1)
    seed: int = TrainConfig.seed
    # Pack samples into rows of at most this many tokens; null = one sample per row.
    pack_tokens: int | None = Field(default=TrainConfig.pack_tokens, ge=1)
    # Packed rows per micro-batch (more: larger matmuls and fewer launches, for more GPU memory).
    rows_per_micro_batch: int = Field(default=TrainConfig.rows_per_micro_batch, ge=1)
    # null = after every epoch only
    checkpoint_every_steps: int | None = Field(default=TrainConfig.checkpoint_every_steps, ge=1)
    # false: the drafter's lm_head stays the target's rows (no gradient).
    train_lm_head: bool = TrainConfig.train_lm_head
    adam_betas: tuple[AdamBeta, AdamBeta] = TrainConfig.adam_betas
    # the decay to zero after the linear warm-up
    lr_schedule: LrSchedule = TrainConfig.lr_schedule
    # A fresh drafter's final norm starts from the target's final norm weight (false: ones).
    init_norm_from_target: bool = False
    # Shards whose samples are shuffled together (held in memory); each worker trains the samples of its own
    # shards of a window, so keep it at least num_workers.
    shuffle_window_shards: int = Field(default=8, ge=1)
    prefetch_shards: int = Field(default=2, ge=1)  # shards a worker reads ahead
    # How workers share each step (kernels/data.py): "shards" (each reads only its own shards; whole
    # shards make the shares uneven, a 2-GPU bound of ~0.92) or "tokens" (each step's samples dealt by
    # tokens: a bound of ~0.98, but every worker reads every shard of a window).
    rank_split: RankSplit = "shards"
    num_workers: int = Field(default=1, ge=1)
    num_gpus_per_worker: float = Field(default=0, ge=0)
    # torch.compile the TTT loss: ~2x faster on CUDA after ~2 min of compilation (bench/RESULTS.md).
    # null = on when training runs on a GPU, off on CPU (tiny models would spend longer compiling).
    compile: bool | None = TrainConfig.compile
    # Samples kept out of training (at most a tenth of the data): after every epoch the drafter's
    # teacher-forced acceptance length on them goes to MLflow, and the best epoch is the one exported.
    # 0 = export the last epoch.
    held_out_samples: int = Field(default=32, ge=0)

    @field_validator("drafter_init_convention")
    @classmethod
    def _known_convention(cls, value: str | None) -> str | None:
        return convention_for(value) if value is not None else None


class EngineConfig(_Section):
    kind: str = "vllm"
    python: str = ".venvs/vllm/bin/python"
    num_speculative_tokens: int = Field(default=3, ge=1)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    enforce_eager: bool = True
    max_model_len: int = Field(default=1024, ge=16)
    max_num_seqs: int = Field(default=16, ge=1)  # requests a server runs at once
    startup_timeout_s: float = Field(default=600, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    num_gpus: float = Field(default=0, ge=0)
    kv_cache_space_gib: int = Field(default=1, ge=1)  # on CPU (num_gpus 0): the KV cache's size
    # The address engine servers bind. Anything but loopback exposes the server to the network, so it
    # then requires `api_key` (clients send it as a bearer token; it is redacted from logs and MLflow).
    host: str = "127.0.0.1"
    api_key: str | None = None

    @model_validator(mode="after")
    def _exposed_server_has_key(self) -> EngineConfig:
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(
                f"engine.host {self.host!r} exposes the engine server beyond this machine: "
                "set engine.api_key (or bind engine.host to 127.0.0.1)"
            )
        return self

    def settings(self, *, trust_remote_code: bool, reasoning_parser: str | None = None) -> EngineSettings:
        """This section as the engine modules take it (the one place EngineSettings is built): every
        field but k, which each speculative server gets on its own (`Speculation`), plus whether the
        server runs the target folder's own code (target.trust_remote_code)."""
        fields = self.model_dump(exclude={"num_speculative_tokens"})
        return EngineSettings(
            **{**fields, "extra_args": tuple(self.extra_args)},
            trust_remote_code=trust_remote_code,
            reasoning_parser=reasoning_parser,
        )

    @field_validator("kind")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        try:
            return engine_class(value).kind
        except EngineConfigError as error:
            raise ValueError(error.reason) from None


class GateConfig(_Section):
    min_speedup: float | None = None
    min_acceptance_length: float | None = None
    require_consistency: bool = True
    beat_champion: bool = True
    # A registered version a trained drafter must beat as well (mean acceptance length): an alias such as
    # an external baseline's (`draftloop diagnose --register --alias baseline`) or a version number.
    beat: str | None = None


class EvaluationConfig(_Section):
    max_tokens: int = Field(default=64, ge=1)
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16])
    acceptance_tolerance: float = Field(default=0.05, ge=0)
    # Benchmark method (infra/evaluation/benchmark.py BenchmarkPlan): after warm-up, each level repeats
    # `repeats` times, each repeat running until `min_output_tokens` and `min_seconds` (small CPU defaults).
    repeats: int = Field(default=3, ge=1)
    min_output_tokens: int = Field(default=128, ge=0)
    min_seconds: float = Field(default=0.5, ge=0)
    warmup_rounds: int = Field(default=1, ge=0)
    # Baseline and speculative servers up together and measured in turns, repeat by repeat (ABBA), so
    # load that changes during the evaluation falls on both. auto: on where servers run on CPU
    # (engine.num_gpus 0); on GPUs both need room at once (twice engine.num_gpus), so there it is a choice.
    interleave: bool | Literal["auto"] = "auto"
    # Physical bounds: a speedup above the mean acceptance length x (1 + this) is a measurement error,
    # and so is a level whose duration is off its own TTFT/TPOT prediction by more than this factor.
    speedup_bound_tolerance: float = Field(default=0.1, ge=0)
    throughput_consistency_factor: float = Field(default=2.0, gt=1)
    # Open loop (off when empty): Poisson arrivals at these requests/s; goodput under `tpot_target_s`.
    request_rates: list[float] = Field(default_factory=list)
    open_loop_requests: int = Field(default=16, ge=1)
    tpot_target_s: float | None = Field(default=None, gt=0)
    # k values served and measured (None = just engine.num_speculative_tokens; that k is always included).
    speculative_tokens_sweep: list[int] | None = None
    # Long-context prompts added to the held-out ones (infra/synthesis/long_context.py): these lengths in
    # target tokens (e.g. [2048, 4096, 8192]; empty = none), `long_context_prompts` of each, categories
    # long_2k, ... in the report. Each length plus max_tokens must fit the engine and the RoPE lengths.
    long_context_tokens: list[Annotated[int, Field(ge=256, le=16384)]] = Field(default_factory=list)
    long_context_prompts: int = Field(default=2, ge=1, le=16)
    gate: GateConfig = Field(default_factory=GateConfig)

    @field_validator("speculative_tokens_sweep")
    @classmethod
    def _positive_ks(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(k < 1 for k in value)):
            raise ValueError("speculative_tokens_sweep must be a non-empty list of integers >= 1 (or null)")
        return value

    @field_validator("request_rates")
    @classmethod
    def _positive_rates(cls, value: list[float]) -> list[float]:
        if any(rate <= 0 for rate in value):
            raise ValueError("request_rates must be > 0 (requests per second)")
        return value

    @field_validator("concurrency")
    @classmethod
    def _positive_levels(cls, value: list[int]) -> list[int]:
        if not value or any(level < 1 for level in value):
            raise ValueError("concurrency levels must be a non-empty list of integers >= 1")
        return value


class StorageConfig(_Section):
    root: str = ".draftloop/runs"
    s3_endpoint_url: str | None = None


class TrackingConfig(_Section):
    mlflow_uri: str = "sqlite:///.draftloop/mlflow.db"
    artifact_root: str = ".draftloop/mlartifacts"
    experiment: str = "draftloop"
    registered_model: str | None = None  # None = "drafter-<name>"


class RayConfig(_Section):
    address: str | None = None


class ExperimentConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    target: TargetConfig
    data: DataConfig = Field(default_factory=DataConfig)
    synthesis: SynthesisConfig = Field(default_factory=SynthesisConfig)
    extraction: ExtractionConfig = Field(default_factory=ExtractionConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    # Facts about the target found during validation (not part of the config's content or hashes).
    _target_depth: int | None = PrivateAttr(default=None)
    _target_hidden_size: int | None = PrivateAttr(default=None)
    _source: str | None = PrivateAttr(default=None)

    # -----------------------------------------------------------------------------------------
    # Loading

    @classmethod
    def load(
        cls,
        path: str | Path,
        overrides: dict[str, Any] | None = None,
        *,
        base_dir: str | Path | None = None,
        check_environment: bool = True,
    ) -> ExperimentConfig:
        """Parse, override, resolve and validate a config file; raises ConfigError.

        overrides: dotted keys, e.g. {"engine.num_speculative_tokens": 5, "storage.root": "s3://b/p"}.
        check_environment=False skips the engine-Python and storage probes (schema, target and layer
        checks always run).
        """
        raw = _read_yaml(Path(path))
        return cls.from_dict(
            raw,
            overrides,
            base_dir=base_dir if base_dir is not None else config_base_dir(path),
            check_environment=check_environment,
            source=str(path),
        )

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        overrides: dict[str, Any] | None = None,
        *,
        base_dir: str | Path | None = None,
        check_environment: bool = True,
        source: str | None = None,
    ) -> ExperimentConfig:
        data = json.loads(json.dumps(raw))  # deep copy, and proves the document is plain data
        for key, value in (overrides or {}).items():
            _apply_override(data, key, value)
        try:
            config = cls.model_validate(data)
        except ValidationError as error:
            raise _config_error_from_validation(error) from None
        config._source = source
        config._resolve_paths(Path(base_dir) if base_dir is not None else Path.cwd())
        config.validate_against_world(check_environment=check_environment)
        return config

    def _resolve_paths(self, base: Path) -> None:
        def resolve(value: str) -> str:
            return value if _is_uri(value) else str((base / os.path.expanduser(value)).resolve())

        self.target.path = resolve(self.target.path)
        if self.training.drafter_init and not self.training.drafter_init.startswith("models:/"):
            self.training.drafter_init = resolve(self.training.drafter_init)
        if os.sep in self.engine.python:  # a bare name ("python3") is looked up on PATH instead
            self.engine.python = str((base / os.path.expanduser(self.engine.python)).absolute())
        if self.data.prompts != "builtin":
            self.data.prompts = resolve(self.data.prompts)
        self.storage.root = resolve(self.storage.root)
        self.tracking.artifact_root = resolve(self.tracking.artifact_root)
        sqlite_prefix = "sqlite:///"
        uri = self.tracking.mlflow_uri
        if uri.startswith(sqlite_prefix) and not uri.startswith(sqlite_prefix + "/"):
            self.tracking.mlflow_uri = sqlite_prefix + str((base / uri[len(sqlite_prefix) :]).resolve())

    # -----------------------------------------------------------------------------------------
    # Validation against the target, the engine and storage (reads only small files)

    def validate_against_world(self, check_environment: bool = True) -> None:
        depth, hidden_size = self._target_shape()
        self._target_depth, self._target_hidden_size = depth, hidden_size
        self._check_target_support(check_environment)
        self._check_aux_layer_ids(depth)
        self._check_drafter_init(hidden_size, check_environment)
        self._check_drafter_variant()
        self._check_prompts_source()
        self._check_long_context()
        if check_environment:
            self._check_engine_python()
            check_storage_root(self.storage.root, self.storage.s3_endpoint_url)

    def _check_target_support(self, check_environment: bool) -> None:
        """What the target can or cannot do, with the engine too when the environment is checked."""
        engine = engine_class(self.engine.kind)(self.engine_settings()) if check_environment else None
        try:
            refuse_unsupported_target(self.target, engine, self.aux_layer_ids_internal)
        except TargetRefusedError as error:
            raise ConfigError(error.field, str(error)) from None

    def _target_shape(self) -> tuple[int, int]:
        folder = Path(self.target.path)
        config_file = folder / "config.json"
        if self.target.create is not None and self.target.create not in zoo.RECIPES:
            raise ConfigError(
                "target.create",
                f"unknown zoo recipe {self.target.create!r}; known: {', '.join(sorted(zoo.RECIPES))}",
            )
        if config_file.is_file():
            try:
                hf_config = json.loads(config_file.read_text())
            except (OSError, ValueError) as error:
                raise ConfigError("target.path", f"cannot read {config_file}: {error}") from None
            return _depth_and_hidden(hf_config, "target.path", config_file)
        if self.target.create is not None:
            recipe = zoo.RECIPES[self.target.create]
            return recipe.num_hidden_layers, recipe.hidden_size
        reason = (
            f"model folder {folder} does not exist"
            if not folder.exists()
            else f"model folder {folder} has no config.json"
        )
        raise ConfigError("target.path", reason + " (set target.create to a zoo recipe to build it)")

    def _check_aux_layer_ids(self, depth: int) -> None:
        convention = convention_for(self.extraction.layer_id_convention)
        ids = self.extraction.aux_layer_ids
        field = "extraction.aux_layer_ids"
        if ids is None:
            try:
                default = self.target_family().default_aux_layer_ids(depth).to(convention)
            except UnknownFamilyError as error:
                raise ConfigError("target.path", str(error)) from None
            except ValueError as error:
                raise ConfigError(field, f"no default for a {depth}-layer target: {error}") from None
            self.extraction.aux_layer_ids = list(default.ids)
            return
        if len(ids) != EAGLE3_NUM_AUX_LAYERS:
            raise ConfigError(field, f"EAGLE-3 fuses exactly {EAGLE3_NUM_AUX_LAYERS} layers, got {ids}")
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ConfigError(field, f"duplicate layer ids {duplicates} in {ids}")
        low, high = LayerIds((0,), convention).valid_range(depth)
        bad = [i for i in ids if not low <= i <= high]
        if bad:
            raise ConfigError(
                field,
                f"layer id(s) {bad} out of range for the {depth}-layer target {self.target.path}: "
                f"valid ids are {low}..{high} in the {convention} convention "
                f"(extraction.layer_id_convention)",
            )

    def _check_drafter_init(self, target_hidden_size: int, check_environment: bool) -> None:
        init = self.training.drafter_init
        if init is None or _is_uri(init) or init.startswith("models:/"):
            return
        config_file = Path(init) / "config.json"
        if not config_file.is_file():
            raise ConfigError("training.drafter_init", f"no drafter config.json in {init}")
        if check_environment and (Path(self.target.path) / "config.json").is_file():
            # The target is here: the whole drafter contract, in seconds, not inside the train stage.
            fine_tune = FineTuneContract(self.data.max_length, self.training.drafter_init_convention)
            try:
                issues = check_drafter_contract(Path(self.target.path), Path(init), fine_tune=fine_tune)
            except EngineConfigError as error:  # an unreadable config.json
                raise ConfigError("training.drafter_init", str(error)) from None
            errors = [str(issue) for issue in issues if issue.severity == "error"]
            if errors:
                raise ConfigError("training.drafter_init", "; ".join(errors))
            return
        try:
            drafter_config = json.loads(config_file.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError("training.drafter_init", f"cannot read {config_file}: {error}") from None
        expected = drafter_config.get("target_hidden_size") or drafter_config.get("hidden_size")
        if expected is None:
            raise ConfigError("training.drafter_init", f"{config_file} names no hidden size")
        if int(expected) != target_hidden_size:
            raise ConfigError(
                "training.drafter_init",
                f"drafter {init} was built for target hidden size {expected}, but the target "
                f"{self.target.path} has hidden size {target_hidden_size}",
            )

    def _check_drafter_variant(self) -> None:
        """The variant and its options as the drafter for this target would be built (an MLA drafter
        refuses what vLLM's MLA drafter does not compute), in seconds, not inside the train stage."""
        section = self.training
        if section.drafter_init is not None or (section.drafter == "eagle3" and not section.drafter_options):
            return  # plain EAGLE-3: built from the target as always (its checks are the target's own)
        try:
            DrafterConfig.for_target(
                target_model_config(self.target.path, self.target.create), self.aux_layer_ids_internal(),
                section.draft_vocab_size, variant=section.drafter, variant_options=section.drafter_options,
            )  # fmt: skip
        except ValueError as error:
            raise ConfigError("training.drafter", str(error)) from None

    def _check_long_context(self) -> None:
        """Each long-context prompt plus its answer (and the largest k) within the served length and the
        RoPE lengths of the target and of the drafter (a fresh one takes the target's)."""
        lengths, evaluation = self.evaluation.long_context_tokens, self.evaluation
        if not lengths:
            return
        largest_k = max([self.engine.num_speculative_tokens, *(evaluation.speculative_tokens_sweep or [])])
        needed = max(lengths) + evaluation.max_tokens + largest_k
        need = (
            f"prompts of {max(lengths)} tokens + evaluation.max_tokens {evaluation.max_tokens} + k "
            f"{largest_k} need {needed} positions"
        )
        limits = {"engine.max_model_len": self.engine.max_model_len}
        try:
            target = language_model_config(target_model_config(self.target.path, self.target.create))
            rope = config_value(target, "max_position_embeddings", None)
            limits["the target's max_position_embeddings"] = rope
        except (OSError, ValueError):
            pass  # an unreadable target config is refused by its own check
        init = Path(self.training.drafter_init or "") / "config.json"
        if self.training.drafter_init is not None and init.is_file():
            try:
                drafter = json.loads(init.read_text())
            except (OSError, ValueError):
                drafter = {}  # refused by _check_drafter_init
            layer = drafter.get("transformer_layer_config") or {}  # the speculators format nests it
            limits[f"max_position_embeddings in {init}"] = drafter.get(
                "max_position_embeddings", layer.get("max_position_embeddings")
            )
        for limit, positions in limits.items():
            if positions is not None and needed > int(positions):
                raise ConfigError("evaluation.long_context_tokens", f"{need}, beyond {limit} {positions}")

    def _check_prompts_source(self) -> None:
        source = self.data.prompts
        if source != "builtin" and not _is_uri(source) and not Path(source).is_file():
            raise ConfigError("data.prompts", f'prompts file {source} does not exist (or use "builtin")')

    def _check_engine_python(self) -> None:
        python = self.engine.python
        if os.sep in python:
            if not (os.path.isfile(python) and os.access(python, os.X_OK)):
                raise ConfigError(
                    "engine.python",
                    f"engine Python {python} does not exist or is not executable "
                    f"(install the {self.engine.kind} environment, e.g. `make engine-env`)",
                )
        elif shutil.which(python) is None:
            raise ConfigError("engine.python", f"{python!r} is not on PATH")

    # -----------------------------------------------------------------------------------------
    # Derived values

    @property
    def target_depth(self) -> int:
        if self._target_depth is None:
            self._target_depth, self._target_hidden_size = self._target_shape()
        return self._target_depth

    @property
    def target_hidden_size(self) -> int:
        if self._target_hidden_size is None:
            self._target_depth, self._target_hidden_size = self._target_shape()
        return self._target_hidden_size

    @property
    def registered_model_name(self) -> str:
        return self.tracking.registered_model or f"drafter-{self.name}"

    @property
    def source(self) -> str | None:
        """The file the config was loaded from, if any."""
        return self._source

    def engine_settings(self) -> EngineSettings:
        """The engine section as the engine modules take it, with the target's trust_remote_code (the
        server loads the target too)."""
        return self.engine.settings(
            trust_remote_code=self.target.trust_remote_code, reasoning_parser=self.synthesis.reasoning_parser
        )

    def target_family(self) -> TargetFamily:
        """The target's family (kernels/families/; "generic": no module), from config.json or its recipe."""
        return family_for_config(target_model_config(self.target.path, self.target.create))

    def aux_layer_ids_internal(self) -> LayerIds:
        """The aux layer ids in the internal layer_input convention (validated against the target)."""
        ids = self.extraction.aux_layer_ids
        if ids is None:
            return self.target_family().default_aux_layer_ids(self.target_depth)
        return LayerIds.parse(ids, self.extraction.layer_id_convention).to("layer_input")

    def section_hash(self, name: str) -> str:
        """Stable sha256 of one section's JSON (key-sorted), for stage cache keys."""
        if name not in type(self).model_fields:
            raise KeyError(f"unknown config section {name!r}")
        value = getattr(self, name)
        dumped = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        for placement in _PLACEMENT_FIELDS.get(name, ()):  # where it runs, not what it computes
            dumped.pop(placement, None)
        for added, default in _ADDED_FIELDS.get(name, {}).items():
            if dumped.get(added) == default:
                dumped.pop(added)
        canonical = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# Fields that say where work runs, not what it computes: left out of the section's hash, so that a
# training resumes from its checkpoints on another number of workers (its steps do not depend on it).
# Fields added after runs were cached: at their default they leave the section's hash as it was, so a
# config that does not use them keeps its finished stages.
_ADDED_FIELDS: dict[str, dict[str, Any]] = {
    "training": {"drafter": "eagle3", "drafter_options": {}},
    "evaluation": {"long_context_tokens": [], "long_context_prompts": 2},
}
_PLACEMENT_FIELDS = {"training": ("num_workers", "num_gpus_per_worker")}


# ---------------------------------------------------------------------------------------------
# Helpers


def _is_uri(value: str) -> bool:
    return "://" in value


def config_base_dir(path: str | Path) -> Path:
    """The folder a config file's relative paths start from: its own, or the repository for configs/*.yaml."""
    repository, folder = Path(__file__).resolve().parents[2], Path(path).resolve().parent
    return repository if folder == repository / "configs" else folder


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    except OSError as error:
        raise ConfigError(str(path), f"cannot read: {error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown line"
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(str(path), f"invalid YAML at {where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "the top level must be a mapping of sections")
    return data


def parse_override_value(text: str) -> Any:
    """A `--set key=value` value: YAML scalar/list syntax (5, true, null, [1, 2, 3]); else the string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _apply_override(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(key, "invalid override key")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part) if isinstance(node, dict) else None
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: depth + 1]), f"is not a section (cannot set {key})")
        node = child
    node[parts[-1]] = value


def _config_error_from_validation(error: ValidationError) -> ConfigError:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        reason = "unknown field"
    elif first["type"] == "missing":
        reason = "required field is missing"
    else:
        reason = str(first["msg"]).removeprefix("Value error, ")
        if "input" in first and first["type"] != "value_error":
            reason += f" (got {first['input']!r})"
    others = error.error_count() - 1
    if others:
        reason += f" (and {others} more error{'s' if others > 1 else ''})"
    return ConfigError(field, reason)


def _depth_and_hidden(hf_config: dict[str, Any], field: str, source: Path) -> tuple[int, int]:
    # Multimodal wrappers (e.g. Kimi-K2.5) keep the language model's shape under text_config.
    for candidate in (hf_config, hf_config.get("text_config") or {}):
        if "num_hidden_layers" in candidate and "hidden_size" in candidate:
            return int(candidate["num_hidden_layers"]), int(candidate["hidden_size"])
    model_type = hf_config.get("model_type")
    raise ConfigError(field, f"{source} (model_type {model_type!r}) has no num_hidden_layers/hidden_size")


def check_storage_root(root: str, s3_endpoint_url: str | None = None) -> None:
    """Raise ConfigError("storage.root", ...) unless `root` can be written, creating nothing.

    Local: the nearest existing ancestor must be a writable directory. s3://: the bucket must exist
    (probed through s3fs with the configured endpoint). Other schemes are accepted as they are.
    """
    field = "storage.root"
    if root.startswith("s3://"):
        bucket = root[len("s3://") :].split("/", 1)[0]
        if not bucket:
            raise ConfigError(field, f"{root} names no bucket")
        try:
            import s3fs

            fs = s3fs.S3FileSystem(
                client_kwargs={"endpoint_url": s3_endpoint_url} if s3_endpoint_url else {},
                config_kwargs={"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 2}},
                skip_instance_cache=True,
            )
            found = fs.exists(bucket)
        except Exception as error:  # any client/network failure means "unreachable"
            raise ConfigError(
                field, f"cannot reach bucket {bucket!r} ({type(error).__name__}: {error})"
            ) from None
        if not found:
            endpoint = f" at {s3_endpoint_url}" if s3_endpoint_url else ""
            raise ConfigError(field, f"bucket {bucket!r} does not exist{endpoint}")
        return
    if _is_uri(root) and not root.startswith("file://"):
        return
    path = Path(root.removeprefix("file://"))
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(field, f"{root} cannot be created: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(field, f"{root} is not writable: no write permission on {probe}")
