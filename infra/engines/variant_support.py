"""Whether the installed engine computes a drafter's EAGLE 3.1 fields, read from its source without
importing it. An engine whose drafter class does not read `fc_norm` or `norm_output` serves the folder as
plain EAGLE-3 without a word: SGLang before sgl-project/sglang#24663 (Llama-style drafters) and #26506
(the Kimi MLA drafter) skipped the `fc_norm.*` tensors at load and fed the next step the pre-norm state.
The acceptance lost that way looks like a weak drafter; the contract names it before a server starts
(infra/engines/pairing.py, clause `variant_fields`).

The drafter's architecture class is found through vLLM's model registry, or in SGLang's model folder by
its `class <name>` line; the engine reads a field when that module names it as a string
(`getattr(config, "fc_norm", False)`, as vLLM 0.32 and SGLang do). Anything not found says nothing (None:
not refused).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from draftloop.infra.engines.base import Engine, EngineError
from draftloop.infra.engines.class_support import vllm_module_path, vllm_registry

# engine kind -> (its package, the folder of its model classes inside it)
MODEL_FOLDERS: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "model_executor/models"),
    "sglang": ("sglang", "srt/models"),
}


@dataclass(frozen=True)
class VariantSupport:
    """The drafter class the engine serves an architecture with, and which variant fields it reads."""

    architecture: str
    module: Path
    fields_read: frozenset[str]

    def unread(self, fields: set[str]) -> list[str]:
        return sorted(fields - self.fields_read)


def engine_models_folder(engine: Engine, timeout_s: float = 30.0) -> Path | None:
    """The engine's model-class folder in its own Python environment (None: another kind, or not found)."""
    package = MODEL_FOLDERS.get(engine.kind)
    if package is None:
        return None
    locate = (
        f"import importlib.util as u, json; s = u.find_spec({package[0]!r}); "
        "print(json.dumps(list(s.submodule_search_locations)[0] if s else None))"
    )
    try:
        proc = subprocess.run(
            [str(engine.python), "-c", locate], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, EngineError):
        return None
    folder = Path(found) / package[1] if found else None
    return folder if folder is not None and folder.is_dir() else None


@lru_cache(maxsize=16)
def variant_support(models_folder: Path, architecture: str, fields: tuple[str, ...]) -> VariantSupport | None:
    """Which of `fields` the module defining `architecture` in `models_folder` reads (None: no module
    there defines it)."""
    registry = models_folder / "registry.py"
    if registry.is_file():  # vLLM: the architecture names a (module, class) in its model registry
        entry = vllm_registry(registry).get(architecture)
        if entry is None:
            return None
        candidates = [vllm_module_path(models_folder.parent.parent, entry[0])]
        class_name = entry[1]
    else:  # SGLang: the class is named as the architecture (the module's EntryClass)
        candidates = sorted(models_folder.glob("*.py"))
        class_name = architecture
    defines = re.compile(rf"^class {re.escape(class_name)}\b", re.MULTILINE)
    for path in candidates:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if defines.search(text):
            read = frozenset(name for name in fields if f'"{name}"' in text or f"'{name}'" in text)
            return VariantSupport(architecture, path, read)
    return None
