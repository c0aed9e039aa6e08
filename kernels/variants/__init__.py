"""Drafter variants, one module each; `base` holds `DrafterVariant` and the registry (see its docstring)."""
