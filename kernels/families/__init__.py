"""Target families, one module each; `base` holds `TargetFamily` and the registry (see its docstring)."""
