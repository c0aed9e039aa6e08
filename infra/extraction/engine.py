"""Engine-side extraction: the engine server computes the hidden states, draftloop repacks them into shards.

For targets only an engine can hold, the extract stage starts the engine server in its extraction mode
(`Engine.extraction_args`: for vLLM the `extract_hidden_states` speculative method with its hidden-states
KV connector), sends every conversation's token ids — built from the chat template by the same
`tokenize_conversation` the in-process path uses, so input ids and loss masks are identical — and reads
back each request's hidden states (`Engine.read_extracted`). The engine is asked for the aux layers plus
layer id `depth` (layer_input), the residual stream leaving the last decoder layer: engines expose the
stream before the final norm, so the shard's `last_hidden` (after the final norm, what training
assumes) is that stream through the target's own final norm module, loaded alone from the target's
weights (its class, epsilon and dtype as in-process). Samples are packed with kernels.shards into the
same shard format and manifest as the in-process path.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open
from torch import nn

from draftloop.infra.engines.actors import start_server_actor
from draftloop.infra.engines.base import Engine, ExtractedHiddenStates, get_engine
from draftloop.infra.extraction.tokenize import tokenize_conversation
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord, state_dir
from draftloop.infra.runtime.ray_cluster import ensure_ray
from draftloop.kernels.families.base import family_for_config
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import TARGET_DTYPE_KEY, pack_hidden_shard, shard_metadata, shard_to_bytes

SHARD_PREFIX = "hidden-e00"


class EngineExtractionError(RuntimeError):
    """The engine's hidden states do not match the request (token ids, layer count, shape)."""


def extraction_layer_ids(aux: LayerIds, depth: int) -> LayerIds:
    """The layer_input ids the engine is asked for: the aux layers, then `depth` (the last layer's output,
    before the final norm)."""
    ids = aux.to("layer_input").validate(depth).ids
    if sorted(ids) != list(ids) or len(set(ids)) != len(ids):
        raise EngineExtractionError(f"aux layer ids must be strictly increasing, got {list(ids)}")
    return LayerIds((*ids, depth), "layer_input")


def load_final_norm(target_dir: Path, dtype: torch.dtype, *, trust_remote_code: bool = False) -> nn.Module:
    """The target's final norm module with its trained weights, without building the rest of the model:
    the model is created on the meta device, only the norm's tensors are read from the weights files.
    `trust_remote_code`: the config and model classes may come from the target folder's own code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    norm = family_for_config(config).final_norm(model)
    prefix = next(name for name, module in model.named_modules() if module is norm)
    wanted = {f"{prefix}.{name}": name for name, _ in norm.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in set(handle.keys()) & set(wanted):
                state[wanted[key]] = handle.get_tensor(key).to(dtype)
    missing = sorted(set(wanted.values()) - set(state))
    if missing:
        raise EngineExtractionError(f"{target_dir}: final norm tensors {missing} under {prefix!r} not found")
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(state)
    return norm.eval()


def sample_from_engine(
    states: ExtractedHiddenStates,
    input_ids: Sequence[int],
    loss_mask: Sequence[int],
    final_norm: nn.Module,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One shard sample from the engine's [T, aux + 1, H] hidden states of `input_ids`."""
    expected = torch.tensor(list(input_ids), dtype=torch.long)
    if states.token_ids.shape != expected.shape or not torch.equal(states.token_ids.long(), expected):
        raise EngineExtractionError(
            f"engine returned hidden states of {states.token_ids.numel()} tokens that are not the "
            f"{expected.numel()} sent"
        )
    hidden = states.hidden_states.to(dtype)
    tokens, layers, width = hidden.shape
    with torch.no_grad():
        last = final_norm(hidden[:, -1, :].unsqueeze(0)).squeeze(0)
    return {
        "input_ids": expected,
        "loss_mask": torch.tensor(list(loss_mask), dtype=torch.uint8),
        "aux_hidden": hidden[:, :-1, :].reshape(tokens, (layers - 1) * width).contiguous(),
        "last_hidden": last.to(dtype).contiguous(),
    }


@dataclass
class EngineExtractionResult:
    shards: list[tuple[str, bytes, int]] = field(default_factory=list)  # (name, bytes, samples)
    tokens: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0


async def request_hidden_states(
    engine: Engine,
    base_url: str,
    model: str,
    token_lists: Sequence[list[int]],
    concurrency: int,
    max_attempts: int = 3,
) -> list[ExtractedHiddenStates | str]:
    """Each token list's hidden states from the server (or the reason it failed), in order."""
    limit = asyncio.Semaphore(max(1, concurrency))
    path, _ = engine.extraction_request(model, [])

    async def one(client: httpx.AsyncClient, ids: list[int]) -> ExtractedHiddenStates | str:
        _, payload = engine.extraction_request(model, ids)
        last = ""
        for _attempt in range(max_attempts):
            try:
                async with limit:
                    response = await client.post(f"{base_url.rstrip('/')}{path}", json=payload)
                if response.status_code == 200:
                    return await asyncio.to_thread(engine.read_extracted, response.json())
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code < 500:
                    break
            except httpx.HTTPError as error:
                last = f"{type(error).__name__}: {error}"
        return last

    async with httpx.AsyncClient(timeout=600, headers=engine.request_headers()) as client:
        return list(await asyncio.gather(*(one(client, ids) for ids in token_lists)))


def extract_through_server(
    engine: Engine,
    base_url: str,
    model: str,
    target_dir: Path,
    conversations: Sequence[dict[str, Any]],
    aux_layer_ids: LayerIds,
    *,
    samples_per_shard: int,
    max_length: int,
    dtype: torch.dtype,
    concurrency: int,
    trust_remote_code: bool = False,
) -> EngineExtractionResult:
    """Hidden-state shards of `conversations` from a server started with `engine.extraction_args`;
    `trust_remote_code`: the tokenizer and final norm may come from the target folder's own code."""
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    result = EngineExtractionResult()
    kept: list[tuple[dict[str, Any], list[int], list[int]]] = []
    for row in conversations:
        ids, mask = tokenize_conversation(tokenizer, row["messages"], max_length)
        if sum(mask) == 0:
            result.skipped.append({"id": row["id"], "reason": "no assistant tokens within data.max_length"})
            continue
        kept.append((row, ids, mask))
    final_norm = load_final_norm(target_dir, dtype, trust_remote_code=trust_remote_code)
    replies = asyncio.run(
        request_hidden_states(engine, base_url, model, [ids for _, ids, _ in kept], concurrency)
    )
    metadata = shard_metadata(
        aux_layer_ids,
        str(target_dir),
        extraction_backend=f"engine:{engine.kind}",
        **{TARGET_DTYPE_KEY: engine.settings.dtype},
    )
    samples: list[dict[str, torch.Tensor]] = []

    def flush() -> None:
        name = f"{SHARD_PREFIX}-{len(result.shards):05d}.safetensors"
        result.shards.append((name, shard_to_bytes(pack_hidden_shard(samples), metadata), len(samples)))
        samples.clear()

    for (row, ids, mask), reply in zip(kept, replies, strict=True):
        if isinstance(reply, str):
            result.skipped.append({"id": row["id"], "reason": f"engine request failed: {reply}"})
            continue
        samples.append(sample_from_engine(reply, ids, mask, final_norm, dtype))
        result.tokens += len(ids)
        if len(samples) == samples_per_shard:
            flush()
    if samples:
        flush()
    result.seconds = time.perf_counter() - started
    return result


def extraction_engine(engine: Engine, aux_layer_ids: LayerIds, depth: int, out_dir: Path) -> Engine:
    """`engine` with its settings' extra server arguments extended by its extraction mode."""
    ids = extraction_layer_ids(aux_layer_ids, depth)
    extra = engine.extraction_args(ids.to(engine.layer_id_convention), out_dir)
    settings = replace(engine.settings, extra_args=(*engine.settings.extra_args, *extra))
    return type(engine)(settings)


def target_depth(target_dir: Path) -> int:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    text_config = config.get("text_config") or config
    return int(text_config["num_hidden_layers"])


def extract_with_engine(
    config: ExperimentConfig,
    target_path: str,
    conversations: Sequence[dict[str, Any]],
    pids: PidRecord | None,
) -> EngineExtractionResult:
    """Start the engine in extraction mode in a Ray actor (the evaluation's lifecycle: fail-fast start,
    PID recorded, stopped by PID), extract every conversation through it, stop it."""
    ensure_ray(config.ray.address, pids)
    run_dir = state_dir() / "work" / str(config.name) / "extract-engine"
    hidden_dir = run_dir / "hidden-states"
    shutil.rmtree(hidden_dir, ignore_errors=True)  # files a killed earlier attempt left
    hidden_dir.mkdir(parents=True)
    aux = config.aux_layer_ids_internal()
    base = get_engine(config.engine.kind, config.engine_settings())
    engine = extraction_engine(base, aux, target_depth(Path(target_path)), hidden_dir)
    server = start_server_actor(engine, target_path, run_dir, "extraction", pids=pids)
    try:
        return extract_through_server(
            engine,
            server.base_url,
            server.model_name,
            Path(target_path),
            conversations,
            aux,
            samples_per_shard=int(config.extraction.samples_per_shard),
            max_length=int(config.data.max_length),
            dtype=getattr(torch, str(config.extraction.dtype)),
            concurrency=engine.settings.max_num_seqs,
            trust_remote_code=bool(config.target.trust_remote_code),
        )
    finally:
        server.stop()
        if pids is not None:
            pids.forget("engine-extraction")
