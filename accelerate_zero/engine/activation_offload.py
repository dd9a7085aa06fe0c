"""ActivationsToHost: what autograd saves during the model's forward waits in host memory until backward
(DeepSpeed's `activation_checkpointing.cpu_checkpointing`).

[Note: activations in host memory]
DeepSpeed's `cpu_checkpointing` moves the inputs of each checkpointed layer to host memory, inside its own
`deepspeed.checkpointing.checkpoint`. Models trained through transformers checkpoint with torch's checkpoint
instead, so here the move is made where autograd saves tensors, with torch's saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`, the mechanism of its `save_on_cpu`), entered around every forward of
the engine's model by a root forward pre-hook and left by a post-hook (`always_call`: a forward that raises leaves
no hook context open). Whatever calls the model (`engine(...)`, a ZeroAccelerator-prepared model called directly,
the Trainer) goes through them. What that moves:
- with the model's gradient checkpointing on (transformers' `gradient_checkpointing_enable`, reentrant or not),
  torch's checkpoint saves each layer's inputs through these hooks and keeps nothing else of the layer (its own
  inner hooks win inside the layer): the checkpoints go to host memory, DeepSpeed's meaning. The layer is
  recomputed in backward, on the device, with no hook of ours open;
- without it, every tensor autograd saves;
- never a parameter or a view of one (the weight a matmul saves): it stays where the engine keeps it (on the
  device, or gathered again for backward at stage 3); copying it would only cost bandwidth and host memory;
- a forward without grad (eval, generate) saves nothing and opens no context.
On CUDA the host copy is page-locked and made with a non-blocking device-to-host copy on the current stream, and an
event marks its end: backward's host-to-device copy waits for that event on its own stream before it reads the
host copy (the device tensor the copy reads is freed only in the order of the current stream, after the copy). On
the CPU, "host" is the same memory, and the same code copies each tensor once and hands the copy back: the tests
run the path the GPU runs and count what it moved (`ActivationStats`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass
class ActivationStats:
    """What the hooks moved, in bytes."""

    packed_bytes: int = 0
    """Copied to host memory by the latest forward."""
    kept_bytes: int = 0
    """Saved by the latest forward and left where they were (parameters and their views, CPU tensors beside a GPU)."""
    unpacked_bytes: int = 0
    """Copied back for backward since the latest forward began."""
    held_bytes: int = 0
    """Host copies alive now (released as backward consumes them)."""
    peak_held_bytes: int = 0
    """The most `held_bytes` has been since the hooks were attached."""


class _Packed(NamedTuple):
    host: torch.Tensor
    device: torch.device
    ready: Any  # torch.Event: the device-to-host copy has finished; None on the CPU


def _is_parameter(tensor: torch.Tensor) -> bool:
    # A parameter re-pointed at a flat buffer (`param.data = view`) is still not an autograd view, so the views
    # autograd saves of it (`weight.t()`) have it as their `_base`.
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class ActivationsToHost:
    """The saved-tensor hooks of [Note: activations in host memory], opened around each forward of one model."""

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        """`device`: where the model computes; `pin_memory`: page-lock the host copies (only beside a GPU)."""
        self.device = device
        self.pin_memory = pin_memory and device.type != "cpu"
        self.stats = ActivationStats()
        self._frames: list[torch.autograd.graph.saved_tensors_hooks | None] = []

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        """Opens the hooks before `module`'s forward (first of its pre-hooks) and closes them after it."""
        return [
            module.register_forward_pre_hook(self._pre_forward, prepend=True),
            module.register_forward_hook(self._post_forward, always_call=True),
        ]

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            self._frames.append(None)
            return
        if not self._frames:  # the outermost forward: the figures of the latest forward start again
            self.stats.packed_bytes = self.stats.kept_bytes = self.stats.unpacked_bytes = 0
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._frames.append(hooks)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._frames:
            return  # a pre-hook before ours raised
        hooks = self._frames.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Packed:
        """A saved tensor -> its host copy (or itself, where it stays)."""
        nbytes = tensor.numel() * tensor.element_size()
        beside_gpu = tensor.device.type == "cpu" and self.device.type != "cpu"
        if _is_parameter(tensor) or beside_gpu or tensor.layout != torch.strided:
            self.stats.kept_bytes += nbytes
            return tensor
        with torch.profiler.record_function("ZeRO::activations_to_host"):
            host = torch.empty_like(tensor, device="cpu", pin_memory=self.pin_memory)
            host.copy_(tensor, non_blocking=self.pin_memory)
            ready = None
            if tensor.device.type != "cpu":
                ready = torch.Event(device=tensor.device)
                ready.record()
        self.stats.packed_bytes += nbytes
        self._hold(host, nbytes)
        return _Packed(host, tensor.device, ready)

    def unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        """The tensor backward reads: a kept tensor as it was, a host copy brought back to its device."""
        if not isinstance(packed, _Packed):
            return packed
        with torch.profiler.record_function("ZeRO::activations_from_host"):
            if packed.ready is not None:
                torch.accelerator.current_stream(packed.device).wait_event(packed.ready)
            self.stats.unpacked_bytes += packed.host.numel() * packed.host.element_size()
            return packed.host.to(packed.device, non_blocking=self.pin_memory)

    def _hold(self, host: torch.Tensor, nbytes: int) -> None:
        stats = self.stats
        stats.held_bytes += nbytes
        stats.peak_held_bytes = max(stats.peak_held_bytes, stats.held_bytes)
        weakref.finalize(host, _release, stats, nbytes)


def _release(stats: ActivationStats, nbytes: int) -> None:
    stats.held_bytes -= nbytes
