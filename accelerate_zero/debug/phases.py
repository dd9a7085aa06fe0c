"""The peak device memory of each training phase, from what an estimate says each kind holds.

[Note: the peak of each phase]
`estimate_stage` counts what a rank holds per kind; a step does not hold every kind at once. The engine's rules
([Note: gradients live from the first backward to the optimizer step] in engine/kept_grads.py, and the stage-3
gather schedule), phase by phase, with `held` = parameters + master weights + optimizer states:
- init: parameters and master weights (the optimizer creates its states at the first step, the gradients come
  with the first backward);
- forward: held + the gathered units (stage 3) + the activations;
- backward, stages 0-2: held + the gradients + the communication buffers + autograd's gradient of the largest
  parameter, copied into its bucket (the activations are freed as backward goes: the peak is at its end);
- backward, stage 3: held + the gradient shard + the gathered units + the activations + the largest unit's full
  gradient: everything that can coexist at the start of backward, an upper bound;
- optimizer step: held + the gradients;
- between steps: held.
Measured against bench/user_load.py (a 66.9M Llama, 4 ranks, fp32 AdamW, 1 x 64 tokens,
anonymous RSS): the 20 cells (5 phases x stages 0-3) within 10% of the measured peak (0.93-1.05 of it;
tests/unit/test_estimate_phases.py keeps them). The stage-3 backward is measured with the gradient arena counted
from its allocation, as a device allocator counts it (`--arena_whole`, [Note: resident pages against allocated
bytes] in bench/user_load.py): 1.049 of it, against 1.108 of RSS alone, whose untouched arena pages are not resident
at the start of backward. Offloaded kinds are not on the device and count 0, as in the estimate.
"""

from __future__ import annotations

from accelerate_zero.debug.estimate import MemoryEstimate


PHASES = ("init", "forward", "backward", "optimizer_step", "between_steps")


def phase_peaks(estimate: MemoryEstimate, activations: int, largest_grad_bytes: int) -> dict[str, int]:
    """Device bytes at the peak of each phase of `PHASES` ([Note: the peak of each phase])."""
    device = estimate.device
    weights = device["parameters"] + device["master_weights"]
    held = weights + device["optimizer_states"]
    grads, buffers, gathered = device["gradients"], device["communication_buffers"], device["gathered_parameters"]
    if estimate.stage == 3:
        backward = held + grads + gathered + activations + largest_grad_bytes
    else:
        backward = held + grads + buffers + largest_grad_bytes
    return {
        "init": weights,
        "forward": held + gathered + activations,
        "backward": backward,
        "optimizer_step": held + grads,
        "between_steps": held,
    }
