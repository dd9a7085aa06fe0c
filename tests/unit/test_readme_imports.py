"""Every `from accelerate_zero... import ...` the README writes (in its code blocks and inline) works: a README change
that names a missing symbol fails here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest


README = Path(__file__).resolve().parents[2] / "README.md"
_IMPORT = re.compile(r"from (accelerate_zero[\w.]*) import \(?([\w ,]+(?:,\s*\n\s*[\w ,]+)*)\)?")


def readme_imports() -> list[tuple[str, str]]:
    """(module, name) for every name imported from accelerate_zero in README.md."""
    found = []
    for module, names in _IMPORT.findall(README.read_text(encoding="utf-8")):
        for name in re.split(r"[,\s]+", names.strip()):
            if name and name != "as":
                found.append((module, name))
    return sorted(set(found))


def test_the_readme_imports_something() -> None:
    assert ("accelerate_zero", "ZeroAccelerator") in readme_imports()
    assert len(readme_imports()) >= 5


@pytest.mark.parametrize(("module", "name"), readme_imports())
def test_each_name_the_readme_imports_exists(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"README: from {module} import {name} fails"


def test_the_plugin_and_the_config_come_from_the_top_level() -> None:
    import accelerate_zero
    from accelerate_zero import ZeroPlugin
    from accelerate_zero.integrations.accelerate import ZeroPlugin as Plugin

    assert ZeroPlugin is Plugin and "ZeroPlugin" in accelerate_zero.__all__
