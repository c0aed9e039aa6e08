"""SGLang: the engine the reference Kimi-K2 / DeepSeek-V3 EAGLE-3 results were measured on.

There is no CPU build of SGLang, so this module is exercised on recorded responses and
metrics (tests/fixtures_engine.py) and on a GPU machine (infra/engines/README.md).

Differences from vLLM that matter to draftloop:
- a drafter's `eagle_aux_hidden_state_layer_ids` are read in the layer_output convention (SpecForge's),
  and SGLang also looks for them, with `use_aux_hidden_state`, in an `eagle_config` block;
- `--speculative-num-draft-tokens` counts one more than the number of proposed tokens (k steps, k+1);
- acceptance comes per request (`meta_info.spec_verify_ct` against `completion_tokens`); the
  `sglang:spec_accept_length` / `sglang:spec_accept_rate` gauges on /metrics are most-recent-batch
  values, not cumulative counters, so they cannot be differenced over a benchmark.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import Engine, FatalPattern, ServerSpec, register_engine
from draftloop.kernels.counters import SpecCounters
from draftloop.kernels.layer_ids import LayerIds


@register_engine
class SglangEngine(Engine):
    kind = "sglang"
    # SGLang (and SpecForge, which trains its drafters) capture the output of layer k.
    layer_id_convention = "layer_output"
    engine_fatal_patterns = (
        FatalPattern("cuda_graph_oom", r"Capture cuda graph failed.*", "lower --cuda-graph-max-bs or memory"),
        FatalPattern("not_enough_memory", r"Not enough memory.*"),
        FatalPattern("bad_cli_argument", r"launch_server\S*: error: .*"),
    )

    def server_env(self, run_dir: Path) -> dict[str, str]:
        return {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "DO_NOT_TRACK": "1",
            "SGLANG_DISABLE_REQUEST_LOGGING": "1",
            "PYTHONUNBUFFERED": "1",
            # Compiled kernels and Triton caches stay inside the run folder.
            "TRITON_CACHE_DIR": str(Path(run_dir) / "triton-cache"),
        }

    def server_command(self, spec: ServerSpec) -> list[str]:
        s = self.settings
        argv = [str(self.python), "-m", "sglang.launch_server", "--model-path", str(spec.target_dir)]
        argv += ["--served-model-name", spec.served_model_name, "--enable-metrics"]
        argv += ["--host", s.host, "--port", str(spec.port), "--dtype", s.dtype, "--random-seed", "0"]
        if s.api_key:
            argv += ["--api-key", s.api_key]
        argv += ["--context-length", str(s.max_model_len), "--max-running-requests", str(s.max_num_seqs)]
        if s.enforce_eager:
            argv.append("--disable-cuda-graph")
        if s.trust_remote_code:
            argv.append("--trust-remote-code")
        if spec.speculation is not None:
            steps = spec.speculation.num_speculative_tokens
            argv += [
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                str(spec.speculation.drafter_dir),
                "--speculative-num-steps",
                str(steps),
                "--speculative-eagle-topk",
                "1",
                # SGLang counts the verified root token among the draft tokens: k proposals = k + 1.
                "--speculative-num-draft-tokens",
                str(steps + 1),
            ]
        argv += list(s.extra_args)
        return argv

    def user_serving_command(self, target: str, drafter: str, num_speculative_tokens: int) -> str:
        k = num_speculative_tokens
        argv = ["python", "-m", "sglang.launch_server", "--model-path", target]
        if self.settings.trust_remote_code:
            argv.append("--trust-remote-code")
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter]
        argv += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
        argv += ["--speculative-num-draft-tokens", str(k + 1)]  # the verified root counts: k + 1
        return shlex.join(argv)

    def export_config(self, exported_ids: LayerIds) -> dict[str, Any]:
        return {
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(exported_ids.ids),
                "use_aux_hidden_state": True,
            }
        }

    def parse_metrics(self, text: str) -> SpecCounters | None:
        # SGLang exposes no cumulative speculative counters; see counters_from_response.
        return None

    def request_extras(self) -> dict[str, Any]:
        # OpenAI-compatible endpoints carry meta_info only on request.
        return {"return_meta_info": True}

    def counters_from_response(
        self, response: Mapping[str, Any], num_speculative_tokens: int
    ) -> SpecCounters | None:
        """Counters of one request from its `meta_info` (native /generate, or an OpenAI choice), on a
        server started at k = `num_speculative_tokens`: the k of that server, not of the config (the k
        sweep serves other k), gives the draft tokens of older SGLang and the per-position width."""
        meta = _find_meta_info(response)
        if meta is None or "spec_verify_ct" not in meta:
            return None
        verify = float(meta.get("spec_verify_ct") or 0)
        completion = float(meta.get("completion_tokens") or 0)
        steps = int(num_speculative_tokens)
        if "spec_accept_token_num" in meta:
            accepted = float(meta["spec_accept_token_num"])
        else:
            # Every verify step yields its accepted drafts plus one token of the target's own.
            accepted = max(completion - verify, 0.0)
        if "spec_draft_token_num" in meta:
            draft_tokens = float(meta["spec_draft_token_num"])
        else:
            draft_tokens = verify * steps
        per_position: tuple[float, ...] = ()
        histogram = meta.get("spec_accept_histogram")
        if isinstance(histogram, list) and histogram:
            # histogram[j] = verify steps that accepted exactly j drafts; position i accepted when j > i.
            counts = [float(c) for c in histogram]
            per_position = tuple(sum(counts[j] for j in range(i + 1, len(counts))) for i in range(steps))
        return SpecCounters(
            num_drafts=verify,
            num_draft_tokens=draft_tokens,
            num_accepted_tokens=accepted,
            accepted_per_position=per_position,
        )

    def version_probe_code(self) -> str:
        return (
            "import importlib.metadata as m\n"
            "try:\n"
            "    print(m.version('sglang'))\n"
            "except m.PackageNotFoundError:\n"
            "    print('not installed')\n"
        )


def _find_meta_info(response: Mapping[str, Any]) -> Mapping[str, Any] | None:
    meta = response.get("meta_info")
    if isinstance(meta, Mapping):
        return meta
    choices = response.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, Mapping) and isinstance(choice.get("meta_info"), Mapping):
                found: Mapping[str, Any] = choice["meta_info"]
                return found
    return None
