"""Memory is counted per distinct storage: views and aliases once, under the first kind that names them."""

from __future__ import annotations

import torch

from accelerate_zero.debug.memory import bytes_by_kind


def test_views_and_aliases_count_once() -> None:
    flat = torch.zeros(100)
    other = torch.zeros(10, dtype=torch.float16)
    out = bytes_by_kind({"parameters": [flat[:50], flat[50:]], "master_weights": [flat[10:20]], "grads": [other]})
    assert out == {"parameters": 400, "master_weights": 0, "grads": 20, "total": 420}
