"""Plain EAGLE-3 (vLLM's and SGLang's drafter layer): fc fusion, the raw hidden state as the residual,
the prenorm state handed on; no fields or modules of its own. `DrafterVariant`'s methods are its rules."""

from __future__ import annotations

from .base import DrafterVariant, register_variant

EAGLE3 = register_variant(DrafterVariant(name="eagle3"))
