"""One interface for every serving engine draftloop deploys a drafter into, and their registry.

An `Engine` knows everything engine-specific: its Python environment, the server's command line
(baseline and speculative) and environment, the layer-id convention it reads from a drafter's config,
the drafter folder it loads (`export_drafter`), which log lines mean it will never come up, and how to
read its speculative-decoding counters. Nothing outside `infra/engines/` names an engine's flag, metric
or convention.

Adding an engine = one module `infra/engines/<kind>.py` whose `Engine` subclass is decorated with
`@register_engine`. The registry finds it by importing the package's modules; registering a kind twice
is an error.
"""

from __future__ import annotations

import importlib
import ipaddress
import json
import os
import pkgutil
import re
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from draftloop.kernels.checkpoint import save_drafter
from draftloop.kernels.counters import SpecCounters
from draftloop.kernels.drafter import Eagle3Drafter
from draftloop.kernels.layer_ids import Convention, LayerIds, normalize_convention


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


def is_loopback(host: str) -> bool:
    """True when `host` (an address or "localhost") is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@dataclass(frozen=True)
class EngineSettings:
    """The engine section of the experiment config, as the engine modules need it.

    No defaults here: it is built in one place, `EngineConfig.settings` (infra/runtime/config.py), from
    the config's engine section and the target's `trust_remote_code`. k is not a setting: each
    speculative server gets its own (`Speculation`).
    """

    kind: str
    python: str
    dtype: str
    enforce_eager: bool
    max_model_len: int
    max_num_seqs: int
    startup_timeout_s: float
    extra_args: tuple[str, ...]
    env: Mapping[str, str]
    num_gpus: float
    kv_cache_space_gib: int
    host: str  # the address servers bind; beyond loopback they require `api_key`
    api_key: str | None
    trust_remote_code: bool  # the server runs the target folder's own code (target.trust_remote_code)
    # A thinking target's reasoning parser (synthesis.reasoning_parser): every server starts with it, and
    # its smoke request must come back with reasoning and content apart. None: not a thinking target.
    reasoning_parser: str | None


@dataclass(frozen=True)
class ExtractedHiddenStates:
    """One request's hidden states as an engine computed them: `hidden_states` [T, L, H] for the T prompt
    tokens `token_ids` and the L layer ids the server was started with, in that order."""

    token_ids: Any  # torch.Tensor [T]
    hidden_states: Any  # torch.Tensor [T, L, H]


@dataclass(frozen=True)
class Speculation:
    """What makes a server speculative: the drafter folder it loads and its k (tokens proposed per step).

    k belongs to each server, never to the engine: the k sweep serves one drafter at several k."""

    drafter_dir: Path
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k < 1:
            raise EngineError(f"a speculative server proposes 1 token or more per step, not {k}")


@dataclass(frozen=True)
class ServerSpec:
    """What one server serves: the target, and for a speculative server its `speculation`."""

    target_dir: Path
    port: int
    served_model_name: str = "target"
    speculation: Speculation | None = None


class Engine(ABC):
    """One serving engine. Subclasses set the class attributes and implement the abstract methods."""

    kind: ClassVar[str]
    # How this engine reads `eagle_aux_hidden_state_layer_ids` from a drafter's config (DESIGN.md,
    # "Layer ids"): layer_input = the residual stream entering layer k, layer_output = leaving it.
    layer_id_convention: ClassVar[Convention]
    health_path: ClassVar[str] = "/health"
    models_path: ClassVar[str] = "/v1/models"
    metrics_path: ClassVar[str] = "/metrics"
    engine_fatal_patterns: ClassVar[tuple[FatalPattern, ...]] = ()

    def __init__(self, settings: EngineSettings | None = None) -> None:
        # None: an engine that exports drafters, reads their layer ids, logs and counters, but serves
        # nothing (whatever reads `settings` says so).
        self._settings = settings

    @property
    def settings(self) -> EngineSettings:
        """The config's engine section (EngineConfig.settings); an engine built without it cannot serve."""
        if self._settings is None:
            raise EngineError(
                f"engine {self.kind!r} was built without settings (the config's engine section): "
                "it exports drafters and reads counters, but cannot build or reach a server"
            )
        return self._settings

    # ---- environment -------------------------------------------------------------------------

    @property
    def python(self) -> Path:
        """The engine's own Python interpreter (the orchestrator never imports the engine).

        Absolute but not resolved: a venv's python is a symlink whose target would lose the venv. A bare
        name ("python3") is looked up on PATH.
        """
        python = self.settings.python
        if os.sep not in python:
            python = shutil.which(python) or python
        return Path(os.path.abspath(python))

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
    def server_command(self, spec: ServerSpec) -> list[str]:
        """argv of the server: baseline when `spec.speculation` is None, speculative otherwise."""

    @abstractmethod
    def user_serving_command(self, target: str, drafter: str, num_speculative_tokens: int) -> str:
        """The shell command a user runs to serve `target` with `drafter` at k speculative tokens
        (the last line of a registered drafter's description)."""

    def process_env(self, run_dir: Path) -> dict[str, str]:
        """The server process's whole environment: ours, the engine's, then the config's `engine.env`."""
        env = dict(os.environ)
        env.update(self.server_env(run_dir))
        env.update({str(k): str(v) for k, v in self.settings.env.items()})
        return env

    def doctor_command(self, target_dir: Path, drafter_dir: Path | None) -> list[str] | None:
        """argv of a probe, run in the engine's environment, that prints one `DRAFTLOOP_DOCTOR {json}`
        line saying what the engine will do with the pair (None: the engine has no such probe)."""
        return None

    # ---- drafter export ----------------------------------------------------------------------

    def export_drafter(
        self,
        drafter: Eagle3Drafter,
        out_dir: Path,
        *,
        metadata: Mapping[str, Any] | None = None,
        layer_ids: LayerIds | None = None,
        allow_layer_mismatch: bool = False,
    ) -> Path:
        """Write `drafter` as the folder this engine loads: its aux layer ids in `layer_id_convention`
        plus `export_config` keys. `layer_ids` restates the capture ids (refused when they differ from
        the trained ones unless `allow_layer_mismatch`)."""
        capture_ids = layer_ids if layer_ids is not None else drafter.config.aux_layer_ids
        return save_drafter(
            drafter,
            out_dir,
            convention=self.layer_id_convention,
            engine=self.kind,
            extra_config=self.export_config(capture_ids.to(self.layer_id_convention)),
            metadata=metadata,
            layer_ids=layer_ids,
            allow_layer_mismatch=allow_layer_mismatch,
        )

    def export_config(self, exported_ids: LayerIds) -> dict[str, Any]:
        """Keys this engine needs in a drafter's config.json beyond the common EAGLE-3 fields."""
        return {}

    def fallback_capture_ids(self, depth: int) -> tuple[int, ...]:
        """The target layers (layer_input) the engine captures for a drafter config that names no ids:
        (2, N//2, N-3), deduplicated and sorted as vLLM's EagleModelMixin does, so a target of fewer
        than 8 layers gives fewer than three (and an fc that reads three fails at the first request)."""
        return tuple(sorted({2, depth // 2, depth - 3}))

    def drafter_layer_ids(self, drafter_dir: Path) -> LayerIds | None:
        """The aux layer ids this engine will capture for the drafter folder, in its own convention
        (None when the config names none and the engine falls back to its defaults)."""
        ids = drafter_config_layer_ids(read_json(Path(drafter_dir) / "config.json"))
        return LayerIds.parse(ids, self.layer_id_convention) if ids else None

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

    def counters_from_response(
        self, response: Mapping[str, Any], num_speculative_tokens: int
    ) -> SpecCounters | None:
        """Per-request counters carried in a completion response of a server speculating at
        `num_speculative_tokens` (engines without cumulative counters)."""
        return None

    def request_headers(self) -> dict[str, str]:
        """Headers every request to this engine's server carries: the bearer token when it has one."""
        return {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}

    def request_extras(self) -> dict[str, Any]:
        """Extra fields every benchmark request carries (e.g. to ask for per-request metadata)."""
        return {}

    # ---- engine-backed synthesis and extraction ----------------------------------------------

    def reasoning_args(self) -> list[str]:
        """Extra server arguments for a thinking target: the parser that returns its reasoning apart
        from its answer (`reasoning_content`), when the settings name one."""
        parser = self.settings.reasoning_parser
        return ["--reasoning-parser", parser] if parser else []

    def extraction_args(self, layer_ids: LayerIds, out_dir: Path) -> list[str]:
        """Extra server arguments that make the server compute the hidden states entering `layer_ids`
        (in this engine's convention) for every request, written under `out_dir`."""
        raise EngineError(f"engine {self.kind!r} has no engine-side hidden-state extraction")

    def extraction_request(self, model: str, token_ids: list[int]) -> tuple[str, dict[str, Any]]:
        """(URL path, JSON body) of the request that computes the hidden states of `token_ids`."""
        raise EngineError(f"engine {self.kind!r} has no engine-side hidden-state extraction")

    def read_extracted(self, response: Mapping[str, Any]) -> ExtractedHiddenStates:
        """The hidden states an extraction request's response points at (read, then removed)."""
        raise EngineError(f"engine {self.kind!r} has no engine-side hidden-state extraction")

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
_PACKAGE = __name__.rsplit(".", 1)[0]  # draftloop.infra.engines


def register_engine(cls: type[Engine]) -> type[Engine]:
    """Class decorator: make `cls` available as `get_engine(cls.kind)`; a kind taken already is refused."""
    kind = cls.kind
    if kind != kind.strip().lower() or not kind:
        raise EngineError(f"engine kind {kind!r} of {cls.__qualname__} must be a non-empty lower-case name")
    existing = _ENGINES.get(kind)
    if existing is not None:
        raise EngineError(
            f"engine {kind!r} is registered twice: {existing.__module__}.{existing.__qualname__} "
            f"and {cls.__module__}.{cls.__qualname__}"
        )
    _ENGINES[kind] = cls
    return cls


def engine_class(kind: str) -> type[Engine]:
    """The class registered as `kind`, importing `infra/engines/<kind>.py` on first use."""
    key = str(kind).strip().lower()
    if key not in _ENGINES and key.isidentifier():
        try:
            importlib.import_module(f"{_PACKAGE}.{key}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{_PACKAGE}.{key}":
                raise
    if key not in _ENGINES:
        raise EngineConfigError(
            "engine.kind", f"unknown engine {kind!r}; known engines: {', '.join(known_engines())}"
        )
    return _ENGINES[key]


def get_engine(kind: str, settings: EngineSettings | None = None) -> Engine:
    """An instance of the engine `kind` (any module registered under infra/engines/, or elsewhere);
    without `settings` it exports drafters and reads counters but serves nothing."""
    return engine_class(kind)(settings)


def known_engines() -> list[str]:
    """Every registered engine, after importing the modules of infra/engines/ (which register theirs)."""
    package = importlib.import_module(_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        if not module.ispkg:
            importlib.import_module(f"{_PACKAGE}.{module.name}")
    return sorted(_ENGINES)


def convention_for(name: str) -> Convention:
    """A layer-id convention named directly (layer_input, layer_output) or by the engine that reads it."""
    try:
        return normalize_convention(name)
    except ValueError as error:
        try:
            return engine_class(name).layer_id_convention
        except EngineConfigError:
            raise ValueError(f"{error}, or an engine name ({', '.join(known_engines())})") from None


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
