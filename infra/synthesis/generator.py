"""The Hugging Face target answering prompts greedily in bounded batches (a Ray actor in the flow)."""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from draftloop.infra.runtime.ray_cluster import remote_options
from draftloop.infra.synthesis.conversations import (
    SynthesisResult,
    first_turns,
    prompt_too_long,
    split_reasoning,
    templated_prompt,
)
from draftloop.infra.targets.loaded import load_target


class TargetGenerator:
    """Hosts the HF target in one process and answers prompts greedily (a Ray actor in the flow)."""

    def __init__(
        self,
        target_path: str,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,  # run the folder's own code: only for a target.trust_remote_code
    ) -> None:
        target = load_target(target_path, dtype, device, trust_remote_code)
        self.device = target.device
        self.tokenizer: Any = target.tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: Any = target.model

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
