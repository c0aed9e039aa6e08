"""DeepSeek-V2/V3 and Kimi-K2 (also inside Kimi-K2.5's text_config): multi-head latent attention (MLA).

The drafter uses MLA too: vLLM allocates one KV-cache layout for target and drafter, so their attention
kinds must match. vLLM's EAGLE-3 target whitelist (some releases) and Kimi-K2.5's media-token field need
the plugin's `speculative_whitelist` and `kimi_media_alias` patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import TargetFamily, config_value, language_model_config, register_family


@dataclass(frozen=True)
class DeepSeekFamily(TargetFamily):
    def drafter_config_fields(self, target_config: Any) -> dict[str, Any]:
        """MLA shapes copied from the target (DeepSeek-V3's sizes where the config omits one); every
        head has its own key and value, and the query/key head is the no-RoPE plus the RoPE part."""
        config = language_model_config(target_config)
        q_lora_rank = config_value(config, "q_lora_rank", None)
        nope = int(config_value(config, "qk_nope_head_dim", 128))
        rope = int(config_value(config, "qk_rope_head_dim", 64))
        return {
            "num_key_value_heads": int(config_value(config, "num_attention_heads")),
            "head_dim": nope + rope,
            "q_lora_rank": int(q_lora_rank) if q_lora_rank else None,
            "kv_lora_rank": int(config_value(config, "kv_lora_rank", 512)),
            "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope,
            "v_head_dim": int(config_value(config, "v_head_dim", 128)),
        }


register_family(
    DeepSeekFamily(
        name="deepseek",
        model_types=("deepseek_v2", "deepseek_v3", "kimi_k2"),
        drafter_attention="mla",
        engine_patches=("speculative_whitelist", "kimi_media_alias", "cpu_rope_3d_query"),
    )
)
