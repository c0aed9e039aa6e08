"""One interface for every serving engine draftloop deploys a drafter into.

An `Engine` knows everything engine-specific: its Python environment, how to build the server's command
line (baseline and speculative), its environment variables, the layer-id convention it reads from a
drafter's config, which log lines mean it will never come up, and how to read its speculative-decoding
counters. Nothing outside `infra/engines/` names a vLLM or SGLang flag or metric.

Adding an engine = adding one module `infra/engines/<kind>.py` whose `Engine` subclass is decorated with
`@register_engine`; `get_engine(kind)` imports it on first use.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from draftloop.kernels.layer_ids import Convention, LayerIds


class EngineError(RuntimeError):
    """An engine could not be used (unknown kind, missing environment, bad drafter pairing)."""


class EngineConfigError(EngineError):
    """A user input (config field, folder) makes the engine unusable; `field` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class FatalPattern:
    """A log line that means the server will never become ready; `hint` says what to do about it."""

    name: str
    regex: str
    hint: str = ""
    # Count a match only after a "Traceback (most recent call last)" line: warnings mention errors too.
    after_traceback: bool = False

    def search(self, text: str) -> re.Match[str] | None:
        for match in re.finditer(self.regex, text, flags=re.MULTILINE):
            if not self.after_traceback or _TRACEBACK in text[: match.start()]:
                return match
        return None


_TRACEBACK = "Traceback (most recent call last)"


# Patterns every engine shares: Python failures and accelerator failures.
COMMON_FATAL_PATTERNS: tuple[FatalPattern, ...] = (
    FatalPattern("cuda_oom", r"CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError: CUDA"),
    FatalPattern("nccl", r"NCCL error|ncclInternalError|ncclSystemError|NCCL WARN .*failed"),
    FatalPattern("address_in_use", r"Address already in use|\[Errno 98\]"),
    FatalPattern(
        "exception",
        # The line a Python traceback ends with: "SomeError: message" at the start of a line.
        # vLLM prefixes lines of its child processes: "(EngineCore pid=1) ERROR 11-29 ... [file.py:9] ".
        r"^(?:\([\w-]+ pid=\d+\) )?(?:ERROR [^\]]*\] )?(?:[\w.]+\.)?"
        r"(?:AttributeError|KeyError|ValueError|RuntimeError|TypeError|AssertionError|"
        # (FileNotFoundError/OSError left out: multiprocessing's finalizers print them harmlessly.)
        r"ImportError|ModuleNotFoundError|NotImplementedError|IndexError|"
        r"NameError|pydantic_core\._pydantic_core\.ValidationError|ValidationError)\b:? .*$",
        after_traceback=True,
    ),
)


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative speculative-decoding counters (definitions in eagle3.md, "Measuring acceptance").

    num_drafts: verification steps that carried draft tokens; num_draft_tokens: tokens proposed;
    num_accepted_tokens: proposed tokens the target accepted; accepted_per_position[i]: drafts whose
    i-th proposed token was accepted (empty when the engine does not report it).
    """

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        after_pos = list(self.accepted_per_position) + [0.0] * (width - len(self.accepted_per_position))
        before_pos = list(before.accepted_per_position) + [0.0] * (width - len(before.accepted_per_position))
        return SpecCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(after_pos, before_pos, strict=True)),
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = list(self.accepted_per_position) + [0.0] * (width - len(self.accepted_per_position))
        theirs = list(other.accepted_per_position) + [0.0] * (width - len(other.accepted_per_position))
        return SpecCounters(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_position=tuple(a + b for a, b in zip(mine, theirs, strict=True)),
        )

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens produced per target forward, the bonus token included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts > 0 else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts whose i-th token was accepted."""
        if self.num_drafts <= 0:
            return []
        return [count / self.num_drafts for count in self.accepted_per_position]

    def to_json(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
        }


@dataclass(frozen=True)
class EngineSettings:
    """The engine section of the experiment config, as the engine modules need it."""

    kind: str = "vllm"
    python: str = ".venvs/vllm/bin/python"
    num_speculative_tokens: int = 3
    dtype: str = "float32"
    enforce_eager: bool = True
    max_model_len: int = 1024
    max_num_seqs: int = 16
    startup_timeout_s: float = 600.0
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    num_gpus: float = 0
    kv_cache_space_gib: int = 1

    @classmethod
    def from_config(cls, engine_section: Any, root: Path | None = None) -> EngineSettings:
        """Build from `ExperimentConfig.engine` (any object or mapping with the config's field names).

        A relative `python` path is resolved against `root` (the repository / working directory).
        """

        def get(name: str, default: Any) -> Any:
            if isinstance(engine_section, Mapping):
                return engine_section.get(name, default)
            return getattr(engine_section, name, default)

        defaults = cls()
        python = str(get("python", defaults.python))
        if root is not None and not os.path.isabs(python):
            python = str(Path(root) / python)
        return cls(
            kind=str(get("kind", defaults.kind)),
            python=python,
            num_speculative_tokens=int(get("num_speculative_tokens", defaults.num_speculative_tokens)),
            dtype=str(get("dtype", defaults.dtype)),
            enforce_eager=bool(get("enforce_eager", defaults.enforce_eager)),
            max_model_len=int(get("max_model_len", defaults.max_model_len)),
            max_num_seqs=int(get("max_num_seqs", defaults.max_num_seqs)),
            startup_timeout_s=float(get("startup_timeout_s", defaults.startup_timeout_s)),
            extra_args=tuple(str(a) for a in (get("extra_args", ()) or ())),
            env={str(k): str(v) for k, v in dict(get("env", {}) or {}).items()},
            num_gpus=float(get("num_gpus", defaults.num_gpus)),
            kv_cache_space_gib=int(get("kv_cache_space_gib", defaults.kv_cache_space_gib)),
        )


@dataclass(frozen=True)
class ServerLaunch:
    """Everything needed to start one server process."""

    argv: list[str]
    env: dict[str, str]
    port: int
    served_model_name: str


class Engine(ABC):
    """One serving engine. Subclasses set the class attributes and implement the abstract methods."""

    kind: ClassVar[str]
    # Layer-id convention the engine reads from a drafter's config (DESIGN.md, "Layer ids").
    drafter_convention: ClassVar[Convention]
    # Name `kernels.drafter.save_drafter(..., engine=...)` knows this engine's format by.
    export_format: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    models_path: ClassVar[str] = "/v1/models"
    metrics_path: ClassVar[str] = "/metrics"
    engine_fatal_patterns: ClassVar[tuple[FatalPattern, ...]] = ()

    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings(kind=self.kind)

    # ---- environment -------------------------------------------------------------------------

    @property
    def python(self) -> Path:
        """The engine's own Python interpreter (the orchestrator never imports the engine).

        Absolute but not resolved: a venv's python is a symlink whose target would lose the venv.
        """
        return Path(os.path.abspath(self.settings.python))

    def check_python(self) -> Path:
        path = self.python
        if not path.exists():
            raise EngineConfigError(
                "engine.python",
                f"{path} does not exist; build the engine environment first (make engine-env)",
            )
        return path

    @abstractmethod
    def server_env(self, run_dir: Path) -> dict[str, str]:
        """Environment variables for the server process (merged over os.environ and settings.env)."""

    # ---- command line ------------------------------------------------------------------------

    @abstractmethod
    def server_command(
        self,
        target_dir: Path,
        port: int,
        *,
        served_model_name: str,
        drafter_dir: Path | None = None,
        num_speculative_tokens: int | None = None,
    ) -> list[str]:
        """argv of the server: baseline when `drafter_dir` is None, speculative otherwise."""

    def launch(
        self,
        target_dir: Path,
        run_dir: Path,
        port: int,
        *,
        served_model_name: str = "target",
        drafter_dir: Path | None = None,
        num_speculative_tokens: int | None = None,
    ) -> ServerLaunch:
        env = dict(os.environ)
        env.update(self.server_env(run_dir))
        env.update({str(k): str(v) for k, v in self.settings.env.items()})
        argv = self.server_command(
            target_dir,
            port,
            served_model_name=served_model_name,
            drafter_dir=drafter_dir,
            num_speculative_tokens=num_speculative_tokens,
        )
        return ServerLaunch(argv=argv, env=env, port=port, served_model_name=served_model_name)

    # ---- drafter export ----------------------------------------------------------------------

    def engine_layer_ids(self, ids: LayerIds) -> LayerIds:
        """`ids` in the convention this engine reads from a drafter's config."""
        return ids.to(self.drafter_convention)

    def export_drafter(self, drafter: Any, out_dir: Path) -> Path:
        """Write `drafter` (a kernels Eagle3Drafter) in this engine's native folder format."""
        from draftloop.kernels.drafter import save_drafter

        save_drafter(drafter, Path(out_dir), engine=self.export_format)
        return Path(out_dir)

    @abstractmethod
    def drafter_layer_ids(self, drafter_dir: Path) -> LayerIds | None:
        """The aux layer ids this engine will capture for the drafter folder, in its own convention."""

    # ---- failure detection -------------------------------------------------------------------

    @property
    def fatal_patterns(self) -> tuple[FatalPattern, ...]:
        # Engine-specific first: their hints are more precise than the generic exception line.
        return self.engine_fatal_patterns + COMMON_FATAL_PATTERNS

    def find_fatal(self, log_text: str) -> tuple[FatalPattern, str] | None:
        """The first fatal pattern found in `log_text` and the matching line, or None."""
        for pattern in self.fatal_patterns:
            match = pattern.search(log_text)
            if match is not None:
                return pattern, match.group(0)
        return None

    # ---- metrics -----------------------------------------------------------------------------

    @abstractmethod
    def parse_metrics(self, text: str) -> SpecCounters | None:
        """Cumulative counters from the engine's Prometheus /metrics text (None when it has none)."""

    def counters_from_response(self, response: Mapping[str, Any]) -> SpecCounters | None:
        """Per-request counters carried in a completion response (engines without cumulative counters)."""
        return None

    def request_extras(self) -> dict[str, Any]:
        """Extra fields every benchmark request carries (e.g. to ask for per-request metadata)."""
        return {}

    # ---- probes ------------------------------------------------------------------------------

    @abstractmethod
    def version_probe_code(self) -> str:
        """Python source, run with the engine's interpreter, that prints the engine's version."""

    def version(self, timeout_s: float = 120.0) -> str:
        python = self.check_python()
        proc = subprocess.run(
            [str(python), "-c", self.version_probe_code()],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            raise EngineError(f"{self.kind} version probe failed: {proc.stderr.strip()[-2000:]}")
        return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


# ------------------------------------------------------------------------------------------------
# Registry

_ENGINES: dict[str, type[Engine]] = {}


def register_engine(cls: type[Engine]) -> type[Engine]:
    """Class decorator: make `cls` available as `get_engine(cls.kind)`."""
    _ENGINES[cls.kind] = cls
    return cls


def engine_class(kind: str) -> type[Engine]:
    key = str(kind).strip().lower()
    if key not in _ENGINES:
        try:
            importlib.import_module(f"draftloop.infra.engines.{key}")
        except ModuleNotFoundError as exc:
            if exc.name != f"draftloop.infra.engines.{key}":
                raise
    if key not in _ENGINES:
        known = ", ".join(known_engines())
        raise EngineConfigError("engine.kind", f"unknown engine {kind!r}; known: {known}")
    return _ENGINES[key]


def get_engine(kind: str, settings: EngineSettings | None = None) -> Engine:
    """The engine `kind` ("vllm" | "sglang" | any module added under infra/engines/)."""
    cls = engine_class(kind)
    if settings is None:
        settings = EngineSettings(kind=cls.kind)
    return cls(settings)


def known_engines() -> list[str]:
    """Engines with a module under infra/engines/ (registered or not yet imported)."""
    here = Path(__file__).resolve().parent
    names = set(_ENGINES)
    for path in here.glob("*.py"):
        if path.stem in {"__init__", "base", "server", "doctor"} or path.stem.startswith("_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if "@register_engine" in text:
            names.add(path.stem)
    return sorted(names)


# ------------------------------------------------------------------------------------------------
# Helpers shared by engine modules


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineConfigError(str(path), "file not found") from None
    except json.JSONDecodeError as exc:
        raise EngineConfigError(str(path), f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise EngineConfigError(str(path), "expected a JSON object")
    return data


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    samples: list[tuple[str, dict[str, str], float]] = []
    line_re = re.compile(r"^([A-Za-z_:][\w:]*)(\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
    label_re = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = line_re.match(line)
        if match is None:
            continue
        name, _, label_text, value_text = match.groups()
        try:
            value = float(value_text)
        except ValueError:
            continue
        labels = dict(label_re.findall(label_text or ""))
        samples.append((name, labels, value))
    return samples


def drafter_config_layer_ids(config: Mapping[str, Any]) -> list[int] | None:
    """`eagle_aux_hidden_state_layer_ids` from a drafter config.json (top level or eagle_config)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        nested = config.get("eagle_config")
        if isinstance(nested, Mapping):
            ids = nested.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return None
    return [int(i) for i in ids]


def stored_layer_ids(config: Mapping[str, Any]) -> LayerIds | None:
    """The ids draftloop trained on (the config's `draftloop` block, layer_input convention)."""
    block = config.get("draftloop")
    if not isinstance(block, Mapping):
        return None
    raw = block.get("aux_layer_ids")
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return LayerIds.from_json(dict(raw))
    return LayerIds.parse([int(i) for i in raw], "layer_input")


def is_mla_config(config: Mapping[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): a kv_lora_rank in the (text) config."""
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping) and is_mla_config(text_config):
        return True
    return bool(config.get("kv_lora_rank"))


def model_depth(config: Mapping[str, Any]) -> int:
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping) and "num_hidden_layers" in text_config:
        return int(text_config["num_hidden_layers"])
    return int(config["num_hidden_layers"])


def join_args(argv: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
