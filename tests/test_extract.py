"""The overlapped extraction pipeline writes exactly what a plain capture sees, sample by sample."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftloop.kernels.capture import capture_aux_hidden_states
from draftloop.kernels.extract import extract_hidden_states
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import iter_hidden_samples, shard_from_bytes, shard_layer_ids, shard_to_bytes


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def test_pipeline_matches_direct_capture_with_padding_and_sharding() -> None:
    model = _tiny_llama()
    layer_ids = LayerIds((1, 2, 3), "layer_input")
    generator = torch.Generator().manual_seed(1)
    samples = []
    for length in (7, 12, 5, 9, 3):  # uneven lengths force padding inside a batch
        ids = torch.randint(0, 97, (length,), generator=generator)
        samples.append({"input_ids": ids, "loss_mask": (torch.arange(length) >= 2).to(torch.uint8)})
    batches = [samples[0:2], samples[2:4], samples[4:5]]
    written: dict[str, bytes] = {}

    def sink(name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        written[name] = shard_to_bytes(tensors, metadata)

    stats = extract_hidden_states(
        model, batches, layer_ids, sink, target_name="tiny", samples_per_shard=3, writer_threads=2
    )
    assert stats.samples == 5 and stats.tokens == sum(int(s["input_ids"].shape[0]) for s in samples)
    assert stats.shards == 2 and sorted(written) == stats.shard_names  # 2 batches (4 samples) + 1

    recovered = []
    for name in stats.shard_names:
        tensors, metadata = shard_from_bytes(written[name])
        assert shard_layer_ids(metadata).ids == (1, 2, 3)
        recovered.extend(iter_hidden_samples(tensors))
    assert len(recovered) == len(samples)
    for sample, got in zip(samples, recovered, strict=True):
        direct = capture_aux_hidden_states(model, sample["input_ids"][None], layer_ids)
        assert torch.equal(got["input_ids"], sample["input_ids"])
        assert torch.equal(got["loss_mask"], sample["loss_mask"])
        assert direct.last is not None
        torch.testing.assert_close(got["aux_hidden"], direct.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["last_hidden"], direct.last[0], rtol=1e-5, atol=1e-5)
        assert got["aux_hidden"].shape[-1] == 3 * 32
