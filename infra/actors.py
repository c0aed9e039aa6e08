"""Ray: one `ray.init` per process, and the actors that host heavy kernels work (targets, capture).

Actors never call Prefect or MLflow: in ephemeral Prefect mode every Ray worker would start its own
temporary Prefect server. They load models, compute, write shards through infra.storage and return
small results; the driver (the Prefect task) logs and commits.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftloop.infra.conversations import (
    SynthesisResult,
    first_turns,
    iter_conversations,
    prompt_too_long,
    split_reasoning,
    templated_prompt,
)
from draftloop.infra.storage import DatasetWriter, Manifest, ShardInfo, StorageOptions
from draftloop.kernels.extract import extract_hidden_states
from draftloop.kernels.layer_ids import LayerIds, normalize_convention
from draftloop.kernels.shards import shard_chunks

# Ray 2.60 turns token auth on and writes ~/.ray/auth_token; a local, in-process cluster needs neither.
_LOCAL_RAY_ENV = {"RAY_AUTH_MODE": "disabled"}
# Unix socket paths are limited to 107 bytes: keep Ray's session folder short (not under a deep tmp_path).
_DEFAULT_RAY_TMPDIR = str(Path(tempfile.gettempdir()) / "draftloop-ray")

_started_here = False
# Called with no arguments right after this process starts a local Ray (the flow records its PIDs).
RAY_START_CALLBACKS: list[Callable[[], None]] = []


def ray_environment(address: str | None) -> dict[str, str]:
    """Environment Ray needs before `ray.init` (set in os.environ by `ensure_ray`)."""
    env = {"RAY_TMPDIR": os.environ.get("RAY_TMPDIR", _DEFAULT_RAY_TMPDIR)}
    has_token = "RAY_AUTH_TOKEN_PATH" in os.environ or "RAY_AUTH_TOKEN" in os.environ
    if address is None and not has_token:
        env.update(_LOCAL_RAY_ENV)
    elif address is not None and has_token:
        # A driver joining a token-auth cluster sends its token only in explicit token mode.
        env["RAY_AUTH_MODE"] = "token"
    return env


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to (or start) Ray once in this process. Returns True when this call started it."""
    global _started_here

    if ray.is_initialized():
        return False
    for key, value in ray_environment(address).items():
        os.environ.setdefault(key, value)
    _reload_ray_auth_settings()
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    ray.init(
        address=address,
        num_cpus=num_cpus if address is None else None,
        include_dashboard=False,
        # Actor/worker output on the driver's console; the demo turns it off to keep its progress bars
        # readable (failures still arrive as exceptions carrying the remote traceback).
        log_to_driver=os.environ.get("DRAFTLOOP_RAY_LOG_TO_DRIVER", "1") != "0",
        configure_logging=False,
        # Tokenizers must not start a thread pool per worker on a 2-core machine.
        runtime_env={
            "env_vars": {"TOKENIZERS_PARALLELISM": "false", **_forwarded_credentials()},
            "worker_process_setup_hook": "draftloop.infra.ray_logging.quiet_ray_train_cleaner",
        },
    )
    _started_here = True
    for callback in list(RAY_START_CALLBACKS):
        with suppress(Exception):
            callback()
    return True


# Storage credentials workers need to read/write S3 (training reads shards there); config holds none.
_FORWARDED_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
)


def _forwarded_credentials() -> dict[str, str]:
    """The driver's S3 credentials, for this job's Ray workers (a cluster's nodes may have none)."""
    return {key: os.environ[key] for key in _FORWARDED_ENV if os.environ.get(key)}


def _reload_ray_auth_settings() -> None:
    """Make Ray re-read RAY_AUTH_* now: it reads them once, when `ray` is first imported.

    Without this a process that imported Ray (or ran a local, auth-less Ray) before cannot join a
    token-auth cluster named later by a config. Ray's own tests reset the same two caches.
    """
    with suppress(Exception):
        raylet: Any = importlib.import_module("ray._raylet")  # compiled module: no type stubs
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


def started_here() -> bool:
    """True while a Ray this process started (not one it only connected to) is running."""
    return _started_here


def shutdown_ray() -> None:
    """Stop Ray if this process started it (a cluster we only connected to is left running)."""
    global _started_here

    if ray.is_initialized():
        ray.shutdown()
    _started_here = False


def kill_actors(handles: Sequence[Any]) -> None:
    """Best-effort: stop actors we started (on success, failure and cancellation alike)."""
    for handle in handles:
        with suppress(Exception):
            ray.kill(handle, no_restart=True)


def remote_options(num_gpus: float, num_cpus: float = 1) -> dict[str, Any]:
    """Ray resource request from a config's per-stage GPU count (0 on CPU machines)."""
    return {"num_cpus": num_cpus, "num_gpus": num_gpus}


# ---------------------------------------------------------------------------------------------------------
# Synthesis: greedy answers from the Hugging Face target, in bounded batches.


class TargetGenerator:
    """Hosts the HF target in one process and answers prompts greedily (a Ray actor in the flow)."""

    def __init__(
        self,
        target_path: str,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,  # run the folder's own code: only for a target.trust_remote_code
    ) -> None:
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer: Any = AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model: Any = AutoModelForCausalLM.from_pretrained(
            target_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
        self.model: Any = model.to(self.device).eval()

    def generate(
        self,
        rows: list[dict[str, str]],
        max_new_tokens: int,
        temperature: float,
        max_length: int,
        batch_size: int,
    ) -> SynthesisResult:
        """Answer `rows` ({"id", "prompt"}); rows that cannot be answered come back in `rejected`."""
        started = time.perf_counter()
        result = SynthesisResult()
        usable: list[tuple[dict[str, str], str, int]] = []
        for row in rows:
            try:
                text, prompt_tokens = templated_prompt(self.tokenizer, first_turns(row))
            except Exception as error:  # a template that refuses the message (e.g. roles)
                result.reject(row["id"], f"chat template failed: {error}")
                continue
            too_long = prompt_too_long(prompt_tokens, max_length)
            if too_long is not None:
                result.reject(row["id"], too_long)
                continue
            usable.append((row, text, prompt_tokens))
        eos_ids = self._eos_ids()
        for start in range(0, len(usable), max(1, batch_size)):
            batch = usable[start : start + batch_size]
            budget = min(max_new_tokens, max_length - max(tokens for _, _, tokens in batch))
            encoded = self.tokenizer(
                [text for _, text, _ in batch], add_special_tokens=False, padding=True, return_tensors="pt"
            ).to(self.device)
            sampling = (
                {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            )
            try:
                with torch.no_grad():
                    output = self.model.generate(
                        **encoded,
                        max_new_tokens=budget,
                        pad_token_id=self.tokenizer.pad_token_id,
                        **sampling,
                    )
            except Exception as error:
                for row, _, _ in batch:
                    result.reject(row["id"], f"generation failed: {error}")
                continue
            new_tokens = output[:, encoded["input_ids"].shape[1] :]
            for (row, _, _), ids in zip(batch, new_tokens.tolist(), strict=True):
                kept: list[int] = []
                for token in ids:
                    if token in eos_ids:
                        break
                    kept.append(token)
                result.generated_tokens += len(kept)
                answer = str(self.tokenizer.decode(kept, skip_special_tokens=True))
                result.add_answer(row, *split_reasoning(answer))
        result.seconds = time.perf_counter() - started
        return result

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(value) for value in source)
        if self.tokenizer.pad_token_id is not None:
            ids.add(int(self.tokenizer.pad_token_id))
        return ids


def remote_target_generator(num_gpus: float) -> Any:
    """`TargetGenerator` as a Ray actor class with the stage's resource request."""
    return ray.remote(**remote_options(num_gpus))(TargetGenerator)


# ---------------------------------------------------------------------------------------------------------
# Extraction: the target's aux hidden states for each conversation, packed into shards.


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], max_length: int
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation through the chat template; 1 marks assistant tokens.

    Each assistant turn's tokens are those the template adds after the prefix that ends with the
    generation prompt; truncated to `max_length`.
    """
    ids: list[int] = []
    mask: list[int] = []
    for turn in range(len(messages)):
        if messages[turn]["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True, tokenize=False)
        through = tokenizer.apply_chat_template(messages[: turn + 1], tokenize=False)
        prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        through_ids = tokenizer(through, add_special_tokens=False)["input_ids"]
        if through_ids[: len(prefix_ids)] != prefix_ids:
            # The template re-renders earlier turns differently: fall back to a per-turn split by length.
            prefix_ids = through_ids[: len(prefix_ids)]
        new_prompt = prefix_ids[len(ids) :]
        ids.extend(new_prompt)
        mask.extend([0] * len(new_prompt))
        answer = through_ids[len(prefix_ids) :]
        ids.extend(answer)
        mask.extend([1] * len(answer))
    return ids[:max_length], mask[:max_length]


# Skipped conversations an actor names (with the reason) beside its count: a bounded return value.
_SKIP_EXAMPLES = 3


@dataclass(frozen=True)
class ExtractedShards:
    """What an extraction actor returns: the shards it wrote (their ShardInfo, never their bytes)."""

    shards: list[ShardInfo]
    tokens: int
    skipped: int  # conversations with no assistant token within data.max_length
    skip_examples: list[dict[str, str]]  # the first few of them, {"id", "reason"}
    seconds: float


class HiddenStateExtractor:
    """Hosts the HF target and captures aux + final hidden states (a Ray actor in the flow)."""

    def __init__(
        self,
        target_path: str,
        aux_layer_ids: Sequence[int],
        convention: str,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,  # run the folder's own code: only for a target.trust_remote_code
    ) -> None:
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype)
        self.target_path = target_path
        self.tokenizer: Any = AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
        model: Any = AutoModelForCausalLM.from_pretrained(
            target_path, dtype=self.dtype, trust_remote_code=trust_remote_code
        )
        self.model: Any = model.to(self.device).eval()
        self.layer_ids = LayerIds(tuple(int(i) for i in aux_layer_ids), normalize_convention(convention)).to(
            "layer_input"
        )
        # Hooks capture from one process; keep the thread count to what Ray gave this actor.
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    def extract_slice(
        self,
        conversations: Manifest,
        start: int,
        end: int,
        dataset_uri: str,
        options: StorageOptions,
        shard_prefix: str,
        samples_per_shard: int,
        max_length: int,
        batch_size: int = 4,
    ) -> ExtractedShards:
        """As :meth:`extract` over conversations `start`..`end` of a synthesize dataset, read here from
        storage one shard at a time (so the driver never holds the conversations either)."""
        rows = iter_conversations(conversations, start, end, options)
        return self.extract(
            rows, dataset_uri, options, shard_prefix, samples_per_shard, max_length, batch_size
        )

    def extract(
        self,
        conversations: Iterable[dict[str, Any]],
        dataset_uri: str,
        options: StorageOptions,
        shard_prefix: str,
        samples_per_shard: int,
        max_length: int,
        batch_size: int = 4,
    ) -> ExtractedShards:
        """Capture every conversation and write its shards into the dataset folder `dataset_uri`.

        Conversations are tokenized as the batches are consumed; forward passes, device-to-host copies
        and shard writes overlap (kernels.extract), and each shard is streamed from host memory to
        storage. Only the shards' ShardInfo come back: the driver lists them in the one manifest it
        commits, so no hidden state passes through it or Ray's object store.
        """
        skipped = 0
        skip_examples: list[dict[str, str]] = []

        def batches() -> Iterator[list[dict[str, Any]]]:
            nonlocal skipped
            batch: list[dict[str, Any]] = []
            for row in conversations:
                ids, mask = tokenize_conversation(self.tokenizer, row["messages"], max_length)
                if sum(mask) == 0:
                    skipped += 1
                    if len(skip_examples) < _SKIP_EXAMPLES:
                        skip_examples.append(
                            {"id": row["id"], "reason": "no assistant tokens within data.max_length"}
                        )
                    continue
                batch.append(
                    {
                        "input_ids": torch.tensor(ids, dtype=torch.long),
                        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                    }
                )
                if len(batch) == batch_size:
                    yield batch
                    batch = []
            if batch:
                yield batch

        # Never commits: the driver adopts these shards into its own writer and writes the manifest.
        writer = DatasetWriter(dataset_uri, storage_options=options)

        def sink(name: str, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
            rows = int(tensors["seq_offsets"].shape[0]) - 1
            writer.write_shard_chunks(name, shard_chunks(tensors, metadata), rows=rows)

        stats = extract_hidden_states(
            self.model,
            batches(),
            self.layer_ids,
            sink,
            target_name=self.target_path,
            samples_per_shard=samples_per_shard,
            shard_prefix=shard_prefix,
            store_dtype=self.dtype,
        )
        return ExtractedShards(
            shards=sorted(writer.shards, key=lambda info: info.name),
            tokens=stats.tokens,
            skipped=skipped,
            skip_examples=skip_examples,
            seconds=stats.seconds,
        )


def remote_hidden_state_extractor(num_gpus: float) -> Any:
    return ray.remote(**remote_options(num_gpus))(HiddenStateExtractor)
