"""The words every config module shares: the "auto" placeholder, the error that lists problems, key paths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


AUTO = "auto"
"""The placeholder a leaf value may hold until an integration fills it (transformers' convention)."""


def is_auto(value: Any) -> bool:
    """True for the string "auto" (and nothing else: not "Auto", not a dict)."""
    return isinstance(value, str) and value == AUTO


class ZeroConfigError(ValueError):
    """A ZeRO config has problems; `problems` holds one line per problem, each saying how to fix it."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems: list[str] = list(problems)
        count = f"{len(self.problems)} problem" + ("s" if len(self.problems) != 1 else "")
        super().__init__(f"invalid ZeRO config ({count}):\n" + "\n".join(f"- {p}" for p in self.problems))


def join_path(prefix: str, key: str) -> str:
    """`prefix.key`, or `key` at the top level."""
    return f"{prefix}.{key}" if prefix else key
