"""What `activation_checkpointing.cpu_checkpointing` moves from the device to host memory, for the estimate.

[Note: activations in host memory, estimated]
With `cpu_checkpointing` what autograd saves during forward waits in host memory ([Note: activations in host
memory] in engine/activation_offload.py); the device keeps one layer's activations (the layer running forward, or
recomputed and run backward) and the logits (the model returns them; their loss's saved copy goes to host memory
too, but the figure keeps it on the device, the safe side). So of [Note: activations] in debug/estimate.py the
device keeps the figure of a one-layer model without checkpointing, and the rest moves to each rank's host memory:
with gradient checkpointing the checkpoints (2*s*b*h per layer in 16-bit), without it all layers but one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from accelerate_zero.debug.estimate import Architecture, activation_bytes


def cpu_checkpointed_bytes(architecture: Architecture, **setup: Any) -> int:
    """Bytes per rank `cpu_checkpointing` keeps in host memory instead of on the device ([Note: activations in host
    memory, estimated]); `setup`: the keyword arguments of `activation_bytes`."""
    one_layer = dataclasses.replace(architecture, num_layers=1)
    kept = activation_bytes(one_layer, **{**setup, "gradient_checkpointing": False})
    return max(0, activation_bytes(architecture, **setup) - kept)
