"""A package's public names, imported on first use (PEP 562), so that importing one light module of
a package does not import the package's heavy names.

A snapshot holder (``hf_lowzero.ray.holder``, one Ray actor per node) and the run's controller
import a few small modules of ``hf_lowzero.ray``; with eager ``__init__`` imports they also
imported the Trainer's console (``transformers``, and through it ``peft``, ``bitsandbytes`` and
``torchao`` where installed): about 9 s of CPU per process on the cores that train, for names they
never use.

The package names its exports once, as imports under ``if TYPE_CHECKING:``, which type checkers
and the API reference (mkdocstrings) read as they read any import; at run time ``lazy_names``
reads the same lines from the package's source and imports each name when it is first used.

Example (a package's ``__init__.py``)::

    from typing import TYPE_CHECKING

    from hf_lowzero.lazy_names import lazy_names

    if TYPE_CHECKING:
        from hf_lowzero.ray.console import ConsoleProgress

    __all__ = ["ConsoleProgress"]
    __getattr__, __dir__ = lazy_names(__name__)
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path


def lazy_names(package: str) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: each name its ``__init__.py``
    imports under ``if TYPE_CHECKING:`` is imported from that module on first use, then kept on the
    package; a submodule's name imports it (``import hf_lowzero`` then ``hf_lowzero.checkpoint.load``,
    as when the package imported its names eagerly).

    Raises:
        ValueError: The package's ``__all__`` names a name that no such import gives.
    """
    init = sys.modules[package]
    where = guarded_imports(Path(init.__file__).read_text())
    missing = sorted(set(getattr(init, "__all__", ())) - set(where) - set(vars(init)))
    if missing:
        raise ValueError(f"{package}.__all__ names {missing}: import each under `if TYPE_CHECKING:` in its __init__.py")

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:  # a submodule, reached as an attribute as the eager imports made it one
            if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            return importlib.import_module(f"{package}.{name}")
        value = getattr(importlib.import_module(module), name)
        setattr(init, name, value)  # the next use is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(init)) | set(where))

    return __getattr__, __dir__


def guarded_imports(source: str) -> dict[str, str]:
    """Each name that ``source`` imports under a top-level ``if TYPE_CHECKING:``, and its module."""
    where = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imported in node.body:
                if isinstance(imported, ast.ImportFrom) and imported.module:
                    where |= {alias.asname or alias.name: imported.module for alias in imported.names}
    return where
