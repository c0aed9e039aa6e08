"""draftloop's vLLM general plugin.

vLLM calls `register()` in every one of its processes (API server, engine core, workers) through the
`vllm.general_plugins` entry point. It applies draftloop's patches, each a no-op where the installed
vLLM already supports what it adds:

(a) speculative_whitelist  older releases refuse EAGLE-3 for target model types outside a whitelist
                           (kimi_k2, deepseek_v3, ...): accept draftloop's extra types.
(b) eagle3_enabler         a decoder-only target class without SupportsEagle3 gets it: aux hidden states
                           captured at the input of the chosen layers (the layer_input convention).
(c) kimi_media_alias       Kimi configs get image_token_index = media_placeholder_token_id where
                           vLLM's EAGLE proposer reads the former.
(d) cpu_rope_3d_query      on CPU, the rotary op skips multi-head 3-D queries (MLA's q rope slice):
                           it is called on 2-D copies.
(e) cpu_hidden_states_writer  on CPU, the hidden-states KV connector pins host memory and uses CUDA
                           events/streams: it copies on the host instead (engine-side extraction).
(f) cpu_fork_engine_core   on CPU, vLLM spawns the engine-core process (vLLM imported a second time,
                           ~15 s a server on 2 cores): it is forked from the API server instead.

Environment:
  DRAFTLOOP_PLUGIN_PATCHES   comma-separated patch names to apply, "all" (default) or "none".
  DRAFTLOOP_PLUGIN_REPORT    file to which each process appends one JSON line of what it did.
  DRAFTLOOP_EAGLE3_TARGET_TYPES  more target model types for (a).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from draftloop_vllm_plugin.patches import (
    PatchResult,
    patch_cpu_fork_engine_core,
    patch_cpu_hidden_states_writer,
    patch_cpu_rope_3d_query,
    patch_eagle3_enabler,
    patch_kimi_media_alias,
    patch_speculative_whitelist,
)

__all__ = ["PATCH_NAMES", "PatchResult", "apply_patches", "register"]

logger = logging.getLogger("draftloop_vllm_plugin")
if not logger.handlers:
    # vLLM configures only its own "vllm" logger: give ours a handler so its lines reach the server log.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

PATCH_NAMES: tuple[str, ...] = (
    "speculative_whitelist",
    "eagle3_enabler",
    "kimi_media_alias",
    "cpu_rope_3d_query",
    "cpu_hidden_states_writer",
    "cpu_fork_engine_core",
)
_RESULTS: list[PatchResult] | None = None


def enabled_patches() -> set[str]:
    raw = os.environ.get("DRAFTLOOP_PLUGIN_PATCHES", "all").strip().lower()
    if raw in ("", "all"):
        return set(PATCH_NAMES)
    if raw == "none":
        return set()
    return {name.strip() for name in raw.split(",") if name.strip()}


def write_report(record: dict[str, Any]) -> None:
    """Append one JSON line to $DRAFTLOOP_PLUGIN_REPORT (when set); never fails the caller."""
    path = os.environ.get("DRAFTLOOP_PLUGIN_REPORT")
    if not path:
        return
    line = json.dumps({"pid": os.getpid(), **record}, sort_keys=True)
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    except OSError as exc:
        logger.warning("draftloop plugin: cannot write report %s: %s", path, exc)


def _vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:
        return "unknown"


def apply_patches() -> list[PatchResult]:
    """Apply the enabled patches once per process; later calls return the first results."""
    global _RESULTS
    if _RESULTS is not None:
        return _RESULTS
    wanted = enabled_patches()
    patches: list[tuple[str, Callable[[], PatchResult]]] = [
        ("speculative_whitelist", patch_speculative_whitelist),
        ("eagle3_enabler", lambda: patch_eagle3_enabler(report=write_report)),
        ("kimi_media_alias", patch_kimi_media_alias),
        ("cpu_rope_3d_query", patch_cpu_rope_3d_query),
        ("cpu_hidden_states_writer", patch_cpu_hidden_states_writer),
        ("cpu_fork_engine_core", patch_cpu_fork_engine_core),
    ]
    results: list[PatchResult] = []
    for name, patch in patches:
        if name not in wanted:
            results.append(PatchResult(name, "disabled", "not in DRAFTLOOP_PLUGIN_PATCHES"))
            continue
        try:
            results.append(patch())
        except Exception as exc:
            results.append(PatchResult(name, "failed", f"{type(exc).__name__}: {exc}"))
    for result in results:
        # The server watcher treats "draftloop plugin: patch X failed" as fatal.
        log = logger.error if result.status == "failed" else logger.info
        log("draftloop plugin: patch %s %s: %s", result.name, result.status, result.detail)
    _RESULTS = results
    return results


def register() -> None:
    """Entry point of the `vllm.general_plugins` group."""
    import multiprocessing

    results = apply_patches()
    write_report(
        {
            "event": "register",
            "process": multiprocessing.current_process().name,
            "vllm_version": _vllm_version(),
            "patches": [r.to_json() for r in results],
        }
    )
