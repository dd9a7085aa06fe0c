"""The "auto" values transformers and accelerate derive from the model's hidden size h: the one home of the rule.

Both libraries fill `reduce_bucket_size` with h², and at stage 3 `stage3_prefetch_bucket_size` with 0.9·h² and
`stage3_param_persistence_threshold` with 10·h. The Trainer's second pass, `ZeroAccelerator.prepare`, `accelerate-zero
estimate` and the `validate` listing all read them from here; how each finds h (and what it says when the model has
none) stays with the library it imitates.
"""

from __future__ import annotations

from collections.abc import Callable


_RULES: dict[str, tuple[Callable[[int], int], str]] = {
    "zero_optimization.reduce_bucket_size": (lambda h: h * h, "hidden_size^2 of the model"),
    "zero_optimization.stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "0.9 x hidden_size^2 of the model"),
    "zero_optimization.stage3_param_persistence_threshold": (lambda h: 10 * h, "10 x hidden_size of the model"),
}
HIDDEN_SIZE_KEYS = tuple(_RULES)
"""The config keys (dotted paths) filled from the hidden size."""
HIDDEN_SIZE_DESCRIPTIONS = {key: description for key, (_, description) in _RULES.items()}
"""What fills each key, in words (for `accelerate-zero validate`)."""


def hidden_size_autos(hidden_size: int, *, stage3: bool = True) -> dict[str, int]:
    """The values for a model of hidden size `hidden_size`; without `stage3`, only the keys that matter below it."""
    return {key: rule(hidden_size) for key, (rule, _) in _RULES.items() if stage3 or "stage3_" not in key}
