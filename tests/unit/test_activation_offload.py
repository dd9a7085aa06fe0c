"""ActivationsToHost on one module, on the CPU (the path the GPU runs: every saved activation copied once and
handed back), without an engine ([Note: activations in host memory] in engine/activation_offload.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_zero.engine.activation_offload import ActivationsToHost


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(6, 5)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inner(x))
        if self.fail:
            raise RuntimeError("forward failed")
        return (hidden.transpose(0, 1) @ hidden).sum()


def _attached() -> tuple[_Net, ActivationsToHost]:
    net = _Net()
    hooks = ActivationsToHost(torch.device("cpu"), pin_memory=True)
    hooks.attach(net)
    return net, hooks


def test_saved_activations_go_to_host_and_come_back_identical() -> None:
    x = torch.randn(4, 6, requires_grad=True)  # so that addmm saves the weight too
    reference = _Net()
    reference(x).backward()
    net, hooks = _attached()
    loss = net(x)
    # saved: x (96 B, addmm), tanh's output (80 B), hidden.t() and hidden for the matmul (80 B each); the weight's
    # view weight.t() (120 B) stays where it is
    assert hooks.stats.packed_bytes == 96 + 80 + 80 + 80
    assert hooks.stats.kept_bytes == 120
    assert hooks.stats.held_bytes == hooks.stats.packed_bytes == hooks.stats.peak_held_bytes
    loss.backward()
    assert hooks.stats.unpacked_bytes == hooks.stats.packed_bytes
    del loss
    assert hooks.stats.held_bytes == 0
    for got, want in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_host_copy_keeps_the_strides() -> None:
    hooks = ActivationsToHost(torch.device("cpu"), pin_memory=False)
    transposed = torch.randn(3, 5).t()
    back = hooks.unpack(hooks.pack(transposed))
    assert back.stride() == transposed.stride() and torch.equal(back, transposed)
    assert back.untyped_storage().data_ptr() != transposed.untyped_storage().data_ptr()


def test_forward_without_grad_and_a_failing_forward_leave_no_hooks_open() -> None:
    net, hooks = _attached()
    x = torch.randn(4, 6)
    with torch.no_grad():
        net(x)
    assert hooks.stats.packed_bytes == 0
    net.fail = True
    with pytest.raises(RuntimeError, match="forward failed"):
        net(x)
    packed = hooks.stats.packed_bytes
    assert packed > 0
    torch.tanh(x.requires_grad_())  # saves its output: no hook of ours may still be open
    assert hooks.stats.packed_bytes == packed
