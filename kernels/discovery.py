"""Registries filled by their package's modules: every module of a package imported once, on first use.

Target families (kernels/families/) and drafter variants (kernels/variants/) register themselves when
their module is imported; adding one is adding the module, with no list to edit.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil


@functools.cache
def import_package_modules(package: str, skip: str = "base") -> None:
    """Import every module of `package` except `skip` (the one holding the registry), once."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if module.name != skip:
            importlib.import_module(f"{package}.{module.name}")
