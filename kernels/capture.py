"""Capture a Hugging Face target's aux hidden states with hooks (no output_hidden_states).

``layer_input`` id k = the residual stream entering decoder layer k, captured by a forward pre-hook on
layer k; the final hidden state (after the model's final norm, so logits = lm_head(last)) by a forward
hook on that norm. Only the requested layers are kept. The target's family (kernels/families/, by its
config's model_type) says where the layers and the norm are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .families.base import family_for_config
from .layer_ids import LayerIds

__all__ = ["CaptureResult", "capture_aux_hidden_states", "conversation_samples"]


@dataclass
class CaptureResult:
    aux: Tensor  # [B, T, len(ids) * Ht], layers concatenated in id order
    last: Tensor | None  # [B, T, Ht], after the final norm
    logits: Tensor | None  # [B, T, V] when requested


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    if args and isinstance(args[0], Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    if isinstance(value, Tensor):
        return value
    raise RuntimeError("decoder layer called without a hidden_states tensor")


@torch.no_grad()
def capture_aux_hidden_states(
    model: nn.Module,
    input_ids: Tensor,
    layer_ids: LayerIds,
    attention_mask: Tensor | None = None,
    want_last: bool = True,
    want_logits: bool = False,
    position_ids: Tensor | None = None,
    past_key_values: Any = None,
) -> CaptureResult:
    """Run ``model`` once and return the hidden states entering the ``layer_ids`` decoder layers.

    ``want_last``: also the final hidden state after the model's final norm. ``want_logits``: also
    the logits (otherwise the lm_head is skipped when the model allows it). ``past_key_values``: a
    transformers cache to read and extend (incremental decoding, e.g. the simulator's verify steps).
    """
    family = family_for_config(getattr(model, "config", {}))
    layers = family.decoder_layers(model)
    ids = layer_ids.to("layer_input").validate(len(layers)).ids
    captured: dict[int, Tensor] = {}
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def pre_hook(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured[index] = _first_tensor(args, kwargs)

        return hook

    last: list[Tensor] = []

    def norm_hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        last.append(output[0] if isinstance(output, tuple) else output)

    try:
        for index in ids:
            handles.append(layers[index].register_forward_pre_hook(pre_hook(index), with_kwargs=True))
        if want_last:
            handles.append(family.final_norm(model).register_forward_hook(norm_hook))
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": past_key_values is not None}
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if want_logits:
            outputs = model(**kwargs)
            logits = outputs.logits
        else:
            # The decoder alone: skips the lm_head, the largest matmul for big vocabularies.
            family.decoder(model)(**kwargs)
            logits = None
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in ids if i not in captured]
    if missing:
        raise RuntimeError(f"layers {missing} did not run (model truncated?)")
    aux = torch.cat([captured[i] for i in ids], dim=-1)
    return CaptureResult(aux=aux, last=last[-1] if last else None, logits=logits)


@torch.no_grad()
def conversation_samples(
    model: nn.Module,
    conversations: Sequence[tuple[list[int], list[int]]],
    layer_ids: LayerIds,
    batch_size: int = 32,
) -> list[dict[str, Tensor]]:
    """Shard-shaped samples of (prompt ids, answer ids) pairs: input_ids, loss_mask on the answer, aux
    and final hidden states. Captured in right-padded batches: attention is causal, so padding never
    reaches a real token and each row's states are those of its conversation alone."""
    samples: list[dict[str, Tensor]] = []
    for start in range(0, len(conversations), batch_size):
        chunk = conversations[start : start + batch_size]
        rows = [prompt + answer for prompt, answer in chunk]
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in rows])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in rows])
        captured = capture_aux_hidden_states(model, input_ids, layer_ids, attention_mask=mask)
        assert captured.last is not None
        for row, (prompt, answer) in enumerate(chunk):
            length = len(prompt) + len(answer)
            loss_mask = torch.zeros(length, dtype=torch.uint8)
            loss_mask[len(prompt) :] = 1
            samples.append(
                {
                    "input_ids": input_ids[row, :length].clone(),
                    "loss_mask": loss_mask,
                    "aux_hidden": captured.aux[row, :length].clone(),
                    "last_hidden": captured.last[row, :length].clone(),
                }
            )
    return samples
