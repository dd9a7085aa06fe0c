"""`deepspeed.accelerator.get_accelerator()`: the device name and the few calls scripts make through it.

DeepSpeed's accelerator abstraction covers CUDA, ROCm, XPU, HPU, NPU, MPS and CPU back ends. Here it answers what a
training script asks of it (the device name, the local device, its count, seeding, synchronising) from torch
itself; everything else it offers raises `DeepSpeedUnavailable` naming the torch call to use instead.
"""

from __future__ import annotations

from typing import Any

import torch

from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable
from accelerate_zero.engine.groups import has_accelerator


class Accelerator:
    """The accelerator this process computes on: CUDA when torch sees one, else the CPU."""

    def __init__(self) -> None:
        self._name = "cuda" if has_accelerator() and torch.cuda.is_available() else "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        """ "cuda" / "cuda:<index>", or "cpu"."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise DeepSpeedUnavailable(
            f"get_accelerator().{name} is not available in accelerate_zero (only the device name and a few calls "
            "are): use torch.cuda / torch.accelerator directly"
        )


_ACCELERATOR: list[Accelerator] = []


def get_accelerator() -> Accelerator:
    """The process's accelerator (made on first use)."""
    if not _ACCELERATOR:
        _ACCELERATOR.append(Accelerator())
    return _ACCELERATOR[0]
