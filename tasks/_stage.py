"""What every stage shares: cache keys, committed-manifest lookup, the run folder, availability checks.

A stage's output lives at `<storage.root>/<config.name>/<stage>/<cache key>/` and is committed by its
`manifest.json`. The cache key hashes the config sections the stage reads and the content hashes of
the upstream manifests it consumes, so a re-run finds finished stages by looking at storage alone:
this works across Prefect servers, machines and result caches, and a half-written stage (no manifest)
is simply redone.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

STAGES: tuple[str, ...] = ("synthesize", "extract", "train", "evaluate", "register")
# Bump when a stage's on-disk output changes meaning, so old cache entries stop matching.
CACHE_VERSION = "1"

# The modules each stage needs from the other work streams (kernels, storage, engines...).
STAGE_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "synthesize": ("draftloop.infra.config", "draftloop.infra.storage", "draftloop.infra.zoo"),
    "extract": (
        "draftloop.infra.storage",
        "draftloop.kernels.capture",
        "draftloop.kernels.shards",
    ),
    "train": ("draftloop.infra.storage", "draftloop.kernels.train", "draftloop.kernels.drafter"),
    "evaluate": ("draftloop.infra.storage", "draftloop.infra.evaluate", "draftloop.infra.engines"),
    "register": ("draftloop.infra.storage",),
}


class StageUnavailable(RuntimeError):
    """A stage whose pieces have not landed (or failed to import)."""

    def __init__(self, stage: str, missing: str) -> None:
        super().__init__(f"stage {stage} not available yet: {missing}")
        self.stage = stage
        self.missing = missing


class StageError(RuntimeError):
    """A stage failed; carries an excerpt of the log that explains why (engine log, worker output)."""

    def __init__(self, stage: str, message: str, log_excerpt: str | None = None) -> None:
        text = f"stage {stage} failed: {message}"
        if log_excerpt:
            text += f"\n--- log excerpt ---\n{log_excerpt[-3000:]}"
        super().__init__(text)
        self.stage = stage
        self.log_excerpt = log_excerpt


def stage_availability() -> dict[str, str | None]:
    """stage -> None when it can run, else why not (the missing module or its import error)."""
    status: dict[str, str | None] = {}
    for stage in STAGES:
        status[stage] = None
        for module in STAGE_REQUIREMENTS[stage]:
            try:
                importlib.import_module(module)
            except ImportError as error:
                status[stage] = f"{module} ({error})"
                break
    return status


def require_stage(stage: str) -> None:
    """Raise `StageUnavailable` naming the first missing piece of `stage`."""
    for module in STAGE_REQUIREMENTS[stage]:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise StageUnavailable(stage, f"{module} cannot be imported ({error})") from error


# ---------------------------------------------------------------------------------------------------------
# Hashing


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()


def section_hash(config: Any, section: str) -> str:
    """The config's own section hash when it has one; otherwise sha256 over the section's JSON dump."""
    method = getattr(config, "section_hash", None)
    if callable(method):
        return str(method(section))
    value = getattr(config, section)
    dumped = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return hashlib.sha256(_canonical(dumped)).hexdigest()


def cache_key(
    stage: str,
    config: Any,
    sections: tuple[str, ...],
    upstream: Mapping[str, Any],
    extra_inputs: Mapping[str, str] | None = None,
) -> tuple[str, dict[str, str]]:
    """(key, inputs): inputs names each config section hash and upstream manifest hash; key hashes them.

    `extra_inputs`: single config fields a stage depends on without depending on their whole section.
    """
    inputs: dict[str, str] = {f"config.{name}": section_hash(config, name) for name in sections}
    inputs.update({f"field.{name}": str(value) for name, value in (extra_inputs or {}).items()})
    for name, manifest in upstream.items():
        inputs[f"upstream.{name}"] = manifest.content_hash()
    inputs["cache_version"] = CACHE_VERSION
    key = hashlib.sha256(_canonical({"stage": stage, **inputs})).hexdigest()[:24]
    inputs["cache_key"] = key
    return key, inputs


# ---------------------------------------------------------------------------------------------------------
# Locations (fsspec URIs; local paths or s3://)


def storage_options(config: Any) -> dict[str, Any]:
    from draftloop.infra.storage import storage_options as options

    return options(config)


def join_uri(*parts: str) -> str:
    head, *rest = parts
    return "/".join([head.rstrip("/"), *(part.strip("/") for part in rest)])


def stage_uri(config: Any, stage: str, key: str) -> str:
    return join_uri(str(config.storage.root), config.name, stage, key)


def run_folder_uri(config: Any, run_id: str) -> str:
    return join_uri(str(config.storage.root), config.name, "cycles", run_id)


def write_text(uri: str, text: str, config: Any) -> None:
    from draftloop.infra.storage import write_text_atomic

    write_text_atomic(uri, text, storage_options(config))


def read_text(uri: str, config: Any) -> str | None:
    from draftloop.infra.storage import exists
    from draftloop.infra.storage import read_text as read

    options = storage_options(config)
    return read(uri, options) if exists(uri, options) else None


def find_committed(uri: str, key: str, options: dict[str, Any] | None = None) -> Any | None:
    """The committed manifest at `uri` if it exists and was produced with `key`; None otherwise."""
    from draftloop.infra.storage import read_manifest

    try:
        manifest = read_manifest(uri, options)
    except FileNotFoundError:
        return None
    except Exception:  # an unreadable manifest is not a cache hit; the stage is redone
        return None
    if manifest.inputs.get("cache_key") != key:
        return None
    return manifest


# ---------------------------------------------------------------------------------------------------------
# One stage execution


@dataclass
class StageOutcome:
    """What a stage task returns to the flow."""

    stage: str
    key: str
    uri: str
    manifest: Any  # infra.storage.Manifest
    cache_hit: bool
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "cache_key": self.key,
            "cache_hit": self.cache_hit,
            "seconds": round(self.seconds, 3),
            "manifest_hash": self.manifest.content_hash(),
            **{k: v for k, v in self.manifest.summary.items() if _jsonable(v)},
        }


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


@dataclass
class StageWork:
    """Handed to a stage body: where to write, what the manifest's `inputs` must be."""

    stage: str
    key: str
    uri: str
    inputs: dict[str, str]


@contextmanager
def _timed() -> Iterator[Callable[[], float]]:
    start = time.perf_counter()
    yield lambda: time.perf_counter() - start


def run_cached(
    stage: str,
    config: Any,
    sections: tuple[str, ...],
    upstream: Mapping[str, Any],
    body: Callable[[StageWork], Any],
    on_start: Callable[[StageWork], None] | None = None,
    extra_inputs: Mapping[str, str] | None = None,
) -> StageOutcome:
    """Return the committed manifest for this stage's inputs, or run `body` to produce and commit it.

    `body` must commit a manifest at `work.uri` with `inputs=work.inputs` and return it.
    """
    require_stage(stage)
    key, inputs = cache_key(stage, config, sections, upstream, extra_inputs)
    uri = stage_uri(config, stage, key)
    with _timed() as elapsed:
        found = find_committed(uri, key, storage_options(config))
        if found is not None:
            return StageOutcome(stage, key, uri, found, cache_hit=True, seconds=elapsed())
        work = StageWork(stage=stage, key=key, uri=uri, inputs=inputs)
        if on_start is not None:
            on_start(work)
        manifest = body(work)
    if manifest.inputs.get("cache_key") != key:
        raise StageError(stage, f"committed manifest at {uri} lacks cache key {key}")
    return StageOutcome(stage, key, uri, manifest, cache_hit=False, seconds=elapsed())


# ---------------------------------------------------------------------------------------------------------
# The cycle: what the flow hands every stage task


def local_state_dir() -> Any:
    """`./.draftloop` (PID records, training checkpoints): per checkout; DRAFTLOOP_STATE_DIR overrides."""
    import os
    from pathlib import Path

    return Path(os.environ.get("DRAFTLOOP_STATE_DIR", ".draftloop")).resolve()


@dataclass
class CycleContext:
    """One flow run: its config, tracker, run folder, stage timings and what it started."""

    config: Any
    run_id: str
    tracker: Any  # infra.tracking.Tracker
    run_uri: str
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)

    @property
    def pid_file(self) -> Any:
        return local_state_dir() / "cycles" / self.run_id / "pids.json"

    def record_pids(self, kind: str, pids: list[int]) -> None:
        """Remember processes this cycle started, so cancellation hooks can stop them by PID."""
        path = self.pid_file
        path.parent.mkdir(parents=True, exist_ok=True)
        record: dict[str, list[int]] = json.loads(path.read_text()) if path.exists() else {}
        record[kind] = sorted({*record.get(kind, []), *pids})
        path.write_text(json.dumps(record))

    def forget_pids(self, kind: str) -> None:
        path = self.pid_file
        if path.exists():
            record = json.loads(path.read_text())
            record.pop(kind, None)
            path.write_text(json.dumps(record))

    def mark(self, stage: str, event: str) -> None:
        """`<run folder>/stages/<stage>.<event>`: progress anyone can watch (tests, people, the demo)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_text(join_uri(self.run_uri, "stages", f"{stage}.{event}"), stamp, self.config)
        for listener in list(PROGRESS_LISTENERS):
            with suppress(Exception):  # a broken progress bar must not fail a stage
                listener(stage, event)


# In-process observers of stage events ("started", "running", "done"): the demo's progress bars.
PROGRESS_LISTENERS: list[Callable[[str, str], None]] = []


def stop_recorded_pids(run_id: str) -> list[int]:
    """Terminate (then kill) every process recorded for `run_id`; returns those signalled."""
    import os
    import signal

    path = local_state_dir() / "cycles" / run_id / "pids.json"
    if not path.exists():
        return []
    record: dict[str, list[int]] = json.loads(path.read_text())
    signalled: list[int] = []
    for pids in record.values():
        for pid in pids:
            try:
                # Engine servers lead their own process group (their workers are in it too).
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGTERM)
                else:
                    os.kill(pid, signal.SIGTERM)
                signalled.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 10
    for pid in signalled:
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.2)
        if not _running(pid):
            continue
        with suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return signalled


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child of ours lingers as one until reaped)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _numeric(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    metrics: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            metrics[f"{prefix}{key}"] = float(value)
        elif isinstance(value, Mapping):
            metrics.update(_numeric(value, prefix=f"{prefix}{key}."))
    return metrics


def execute_stage(
    ctx: CycleContext, stage: str, produce: Callable[[Any, Callable[[StageWork], None]], StageOutcome]
) -> StageOutcome:
    """Run one stage inside its nested MLflow run: markers, timings, cache-hit tag, summary metrics.

    `produce(stage_run, on_start)` returns the StageOutcome (usually through `run_cached`); `on_start`
    is called only when the stage really runs (not on a cache hit). A failure is recorded in MLflow and
    re-raised as a StageError carrying the log excerpt, so Prefect shows it too.
    """
    from draftloop.infra.tracking import error_excerpt

    ctx.mark(stage, "started")
    started = time.perf_counter()
    try:
        with ctx.tracker.stage(stage) as stage_run:

            def on_start(work: StageWork) -> None:
                ctx.mark(stage, "running")
                stage_run.set_tags({"draftloop.cache_key": work.key, "draftloop.uri": work.uri})

            outcome = produce(stage_run, on_start)
            stage_run.set_tags(
                {
                    "draftloop.cache_hit": str(outcome.cache_hit).lower(),
                    "draftloop.cache_key": outcome.key,
                    "draftloop.uri": outcome.uri,
                    "draftloop.manifest_hash": outcome.manifest.content_hash(),
                }
            )
            if not outcome.cache_hit:
                stage_run.log_metrics(_numeric(outcome.manifest.summary))
            stage_run.log_dict(outcome.manifest.model_dump(mode="json"), "manifest.json")
    except BaseException as error:
        with suppress(Exception):
            ctx.mark(stage, "failed")
        if isinstance(error, StageUnavailable | StageError) or not isinstance(error, Exception):
            raise
        if is_transient(error):
            raise  # keep the type: Prefect's retry condition looks at it
        excerpt = getattr(error, "log_excerpt", None)
        raise StageError(
            stage, f"{type(error).__name__}: {error}", excerpt or error_excerpt(error)
        ) from error
    seconds = time.perf_counter() - started
    ctx.outcomes[stage] = outcome
    ctx.timings[stage] = {"seconds": round(seconds, 3), "cache_hit": outcome.cache_hit}
    ctx.mark(stage, "done")
    return outcome


# ---------------------------------------------------------------------------------------------------------
# Prefect task policy shared by every stage


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import httpx

        types.extend([httpx.TransportError])
    except ImportError:
        pass
    try:
        import botocore.exceptions

        types.extend([botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError])
    except ImportError:
        pass
    return tuple(types)


def is_transient(error: BaseException | None) -> bool:
    """Engine start-up, S3 and network faults are worth a retry; config errors and bugs are not."""
    seen: set[int] = set()
    transient = _transient_types()
    while error is not None and id(error) not in seen:
        if isinstance(error, StageUnavailable):
            return False
        if type(error).__name__ == "EngineStartError":
            # A server that timed out or died without a known fatal log line may come up next time;
            # one that logged a fatal pattern (bad flag, OOM, wrong drafter) will not.
            return getattr(error, "pattern", None) is None
        if isinstance(error, transient) or getattr(error, "transient", False):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry only when the failure (or its cause) is transient."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as error:
        return is_transient(error)
    return False


def task_options(retries: int = 2) -> dict[str, Any]:
    """Keyword arguments for `@task` on a stage: our own manifest cache, retries with backoff."""
    from prefect.cache_policies import NO_CACHE
    from prefect.tasks import exponential_backoff

    return {
        "retries": retries,
        "retry_delay_seconds": exponential_backoff(backoff_factor=5),
        "retry_jitter_factor": 0.2,
        "retry_condition_fn": retry_if_transient,
        # Caching is ours (committed manifests in storage), not Prefect's result store.
        "cache_policy": NO_CACHE,
        "persist_result": False,
    }
