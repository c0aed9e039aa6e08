"""Stage outputs cached on their inputs: cache keys, the committed-manifest lookup, `run_cached`.

A stage's output lives at `<storage.root>/<config.name>/<stage>/<cache key>/` and is committed by its
`manifest.json`. The cache key hashes the config sections the stage reads and the content hashes of
the upstream manifests it consumes, so a re-run finds finished stages by looking at storage alone:
this works across Prefect servers, machines and result caches, and a half-written stage (no manifest)
is simply redone.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import held_exclusively
from draftloop.infra.runtime.storage import Manifest, StorageOptions, join, read_manifest, storage_options

# Bump when a stage's on-disk output changes meaning, so old cache entries stop matching.
CACHE_VERSION = "1"


class StageError(RuntimeError):
    """A stage failed; carries an excerpt of the log that explains why (engine log, worker output)."""

    def __init__(self, stage: str, message: str, log_excerpt: str | None = None) -> None:
        text = f"stage {stage} failed: {message}"
        if log_excerpt:
            text += f"\n--- log excerpt ---\n{log_excerpt[-3000:]}"
        super().__init__(text)
        self.stage = stage
        self.log_excerpt = log_excerpt


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()


def cache_key(
    stage: str,
    config: ExperimentConfig,
    sections: tuple[str, ...],
    upstream: Mapping[str, Manifest],
    extra_inputs: Mapping[str, str] | None = None,
) -> tuple[str, dict[str, str]]:
    """(key, inputs): inputs names each config section hash and upstream manifest hash; key hashes them.

    `extra_inputs`: single config fields a stage depends on without depending on their whole section.
    """
    inputs: dict[str, str] = {f"config.{name}": config.section_hash(name) for name in sections}
    inputs.update({f"field.{name}": str(value) for name, value in (extra_inputs or {}).items()})
    for name, manifest in upstream.items():
        inputs[f"upstream.{name}"] = manifest.content_hash()
    inputs["cache_version"] = CACHE_VERSION
    key = hashlib.sha256(_canonical({"stage": stage, **inputs})).hexdigest()[:24]
    inputs["cache_key"] = key
    return key, inputs


def stage_uri(config: ExperimentConfig, stage: str, key: str) -> str:
    return join(str(config.storage.root), config.name, stage, key)


def find_committed(uri: str, key: str, options: StorageOptions | None = None) -> Manifest | None:
    """The committed manifest at `uri` if it exists and was produced with `key`; None otherwise."""
    try:
        manifest = read_manifest(uri, options)
    except FileNotFoundError:
        return None
    except Exception:  # an unreadable manifest is not a cache hit; the stage is redone
        return None
    if manifest.inputs.get("cache_key") != key:
        return None
    return manifest


@dataclass
class StageOutcome:
    """What a stage task returns to the flow."""

    stage: str
    key: str
    uri: str
    manifest: Manifest
    cache_hit: bool
    seconds: float


@dataclass
class StageWork:
    """Handed to a stage body: where to write, what the manifest's `inputs` must be."""

    stage: str
    key: str
    uri: str
    inputs: dict[str, str]


StageBody = Callable[[StageWork], Manifest]
OnStart = Callable[[StageWork], None]


def run_cached(
    stage: str,
    config: ExperimentConfig,
    sections: tuple[str, ...],
    upstream: Mapping[str, Manifest],
    body: StageBody,
    on_start: OnStart | None = None,
    extra_inputs: Mapping[str, str] | None = None,
) -> StageOutcome:
    """Return the committed manifest for this stage's inputs, or run `body` to produce and commit it.

    `body` must commit a manifest at `work.uri` with `inputs=work.inputs` and return it; `on_start` is
    called only when the stage really runs.
    """
    key, inputs = cache_key(stage, config, sections, upstream, extra_inputs)
    uri = stage_uri(config, stage, key)
    started = time.perf_counter()
    found = find_committed(uri, key, storage_options(config))
    if found is not None:
        return StageOutcome(stage, key, uri, found, cache_hit=True, seconds=time.perf_counter() - started)

    def waiting(holder: str) -> None:
        with suppress(MissingContextError):
            get_run_logger().info(f"{stage}: another run ({holder}) is producing this output; waiting for it")

    # Two runs of one config at once would write the same output and work folders: the second waits for
    # the first, then finds its committed manifest (or, if the first failed, produces it itself).
    with held_exclusively(f"{config.name}-{stage}-{key}", on_wait=waiting):
        found = find_committed(uri, key, storage_options(config))
        if found is not None:
            return StageOutcome(stage, key, uri, found, cache_hit=True, seconds=time.perf_counter() - started)
        work = StageWork(stage=stage, key=key, uri=uri, inputs=inputs)
        if on_start is not None:
            on_start(work)
        manifest = body(work)
    if manifest.inputs.get("cache_key") != key:
        raise StageError(stage, f"committed manifest at {uri} lacks cache key {key}")
    return StageOutcome(stage, key, uri, manifest, cache_hit=False, seconds=time.perf_counter() - started)
