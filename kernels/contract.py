"""What a drafter was trained against, recorded in its checkpoint's draftloop block (`contract_record`).

The target tokenizer's chat template (synthesis and extraction render conversations with it), the dtype
and quantization the target ran in when its hidden states were extracted, and those hidden states'
last-state semantics; the pairing check (infra/engines/pairing.py) compares them with what is served.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .files import read_json
from .shards import LAST_HIDDEN_STATE_KEY, TARGET_DTYPE_KEY

__all__ = [
    "CHAT_TEMPLATE_KEY",
    "TARGET_QUANTIZATION_KEY",
    "chat_template_sha256",
    "contract_record",
    "target_quantization",
]

# Keys of the draftloop block's metadata that record what the drafter was trained against.
CHAT_TEMPLATE_KEY = "chat_template_sha256"
TARGET_QUANTIZATION_KEY = "target_quantization"


def chat_template_sha256(path: str | os.PathLike[str]) -> str | None:
    """sha256 of the chat template a tokenizer folder holds (chat_template.jinja, chat_template.json or
    tokenizer_config.json's ``chat_template``), or of a template file; None when there is none."""
    source = Path(path)
    template: Any = None
    if source.is_file():
        template = source.read_text()
    elif (source / "chat_template.jinja").is_file():
        template = (source / "chat_template.jinja").read_text()
    else:
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (source / name).is_file():
                template = read_json(source / name).get("chat_template")
                if template is not None:
                    break
    if template is None:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def target_quantization(target_config: Mapping[str, Any]) -> str | None:
    """The quantization method a target checkpoint declares (``quantization_config.quant_method``)."""
    quantization = target_config.get("quantization_config")
    if not isinstance(quantization, Mapping):
        text_config = target_config.get("text_config")
        quantization = text_config.get("quantization_config") if isinstance(text_config, Mapping) else None
    return str(quantization.get("quant_method", "unknown")) if isinstance(quantization, Mapping) else None


def contract_record(
    target_dir: str | os.PathLike[str], *, target_dtype: str | None, last_hidden_state: str | None
) -> dict[str, Any]:
    """What a drafter is trained against, for its draftloop block's metadata: the target tokenizer's chat
    template (synthesis and extraction render conversations with it), the dtype and quantization the
    target ran in when its hidden states were extracted, and those hidden states' last-state semantics."""
    folder = Path(target_dir)
    return {
        CHAT_TEMPLATE_KEY: chat_template_sha256(folder),
        TARGET_DTYPE_KEY: target_dtype,
        TARGET_QUANTIZATION_KEY: target_quantization(read_json(folder / "config.json")),
        LAST_HIDDEN_STATE_KEY: last_hidden_state,
    }
