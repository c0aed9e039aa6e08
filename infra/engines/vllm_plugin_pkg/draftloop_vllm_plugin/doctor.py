"""`python -m draftloop_vllm_plugin.doctor --target DIR [--drafter DIR]`: run in vLLM's environment.

Prints one JSON object: the vLLM version, what each plugin patch does here, whether the target's model
class supports EAGLE-3 (natively or through which patch), and the aux layer ids vLLM will capture for the
drafter (vLLM's convention = draftloop's layer_input convention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _read_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        data: dict[str, Any] = json.load(handle)
    return data


def _depth(config: dict[str, Any]) -> int:
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        return int(text["num_hidden_layers"])
    return int(config["num_hidden_layers"])


def probe(target: str, drafter: str | None) -> dict[str, Any]:
    from draftloop_vllm_plugin import apply_patches
    from draftloop_vllm_plugin.patches import eagle3_support, enable_eagle3

    report: dict[str, Any] = {}
    import vllm

    report["vllm_version"] = str(getattr(vllm, "__version__", "unknown"))
    report["patches"] = [r.to_json() for r in apply_patches()]

    target_config = _read_config(target)
    architectures = list(target_config.get("architectures") or [])
    report["target"] = {
        "path": target,
        "architectures": architectures,
        "model_type": target_config.get("model_type"),
    }
    from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    model_cls = None
    for arch in architectures:
        model_cls = ModelRegistry._try_load_model_cls(arch)
        if model_cls is not None:
            break
    if model_cls is None:
        report["eagle3"] = {"support": "unsupported", "detail": f"vLLM has no class for {architectures}"}
    else:
        native = bool(supports_eagle3(model_cls))
        enabler_on = any(
            r["name"] == "eagle3_enabler" and r["status"] in ("applied", "noop") for r in report["patches"]
        )
        if native:
            support = "native"
        elif enabler_on and enable_eagle3(model_cls, SupportsEagle3) is not model_cls:
            support = "plugin:eagle3_enabler"
        else:
            support = "unsupported" if not enabler_on else eagle3_support(model_cls)
        report["eagle3"] = {"support": support, "class": model_cls.__name__, "native": native}

    depth = _depth(target_config)
    report["target"]["num_hidden_layers"] = depth
    if drafter:
        drafter_config = _read_config(drafter)
        ids = drafter_config.get("eagle_aux_hidden_state_layer_ids")
        if not ids and isinstance(drafter_config.get("eagle_config"), dict):
            ids = drafter_config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        source = "drafter config" if ids else "vLLM default (2, N//2, N-3)"
        if not ids:
            ids = [2, depth // 2, depth - 3]
        block = drafter_config.get("draftloop") or {}
        trained = block.get("aux_layer_ids") if isinstance(block, dict) else None
        report["drafter"] = {
            "path": drafter,
            "architectures": drafter_config.get("architectures"),
            # vLLM captures the input of layer k: its ids are draftloop's layer_input ids.
            "engine_layer_ids": {"ids": [int(i) for i in ids], "convention": "layer_input", "source": source},
            "layer_input_ids": [int(i) for i in ids],
            "trained_layer_ids": trained,
            "in_range": all(0 <= int(i) < depth for i in ids),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", default=None)
    args = parser.parse_args(argv)
    result = probe(args.target, args.drafter)
    sys.stdout.write("DRAFTLOOP_DOCTOR " + json.dumps(result, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
