"""How long an offloaded optimizer step takes, from three measured figures: the step without offload, the pinned
copy bandwidth between host and device, and the host optimizer step's rate.

[Note: the offload step time model]
Offload adds to the step without offload (same model, batch and accumulation) what of its traffic and host work
does not hide behind the device's compute; `n` is this rank's trainable elements (the shard):
- gradients to the host: each reduction copies the averaged fp32 slice, 4n bytes (at stages 2 and 3 on every
  micro-step, at stages 0 and 1 once per step), asynchronously while backward runs ([Note: asynchronous host
  copies] in engine/host_copies.py). Backward is taken as 2/3 of the compute, so what the copies need beyond it
  is exposed.
- the host step: n elements at the measured rate of the optimizer's fused CPU kernel on the rank's cores. The norm
  and the clipping multiply (each one more pass over the gradients) are not counted. Synchronous (stages 1 and 2, or
  `ACCELERATE_ZERO_OVERLAP_STEP=0`) nothing hides it; at stage 3 it runs across the step boundary ([Note: the host
  step across the step boundary] in engine/step_in_flight.py) and hides behind the next step's first forward (a
  third of one micro-step's compute), with the last chunk's upload; the next backward waits for the rest.
- uploads of the updated parameters: the fp32 masters, 4n bytes (an asynchronous copy into a parameter of another
  dtype copies the source as it is and casts on the device). They run chunk by chunk beside the host step
  ([Note: the pipelined host step] in offload/pipelined_step.py), so only the last chunk's is exposed. Under
  parameter offload the masters update the host shards in place and nothing is uploaded at the step.
- parameter offload (stage 3): each micro-step's forward and backward copy every unit's shard to the device (2n
  bytes each time, 4n per micro-step) before its all-gather; that traffic beyond the compute is exposed.
NVMe adds file traffic this model does not count. The prediction is checked against GPU measurements by
bench/gpu_compare.py (the "predicted" column).
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate_zero.offload.pipelined_step import CHUNK_NUMEL


BACKWARD_SHARE = 2 / 3
"""The share of a training step's compute spent in backward (2 of the 3 matmul passes)."""


@dataclass(frozen=True)
class Measured:
    """The three figures the model takes, measured on the machine being predicted."""

    step_seconds: float
    """The optimizer step without offload (all micro-steps), same model, batch and accumulation."""
    copy_gbps: float
    """Pinned host <-> device copy bandwidth, 1e9 bytes per second."""
    host_rate: float
    """Elements per second the optimizer's fused CPU step processes on the rank's cores."""

    def __post_init__(self) -> None:
        for name in ("step_seconds", "copy_gbps", "host_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a measured figure > 0")


def offload_step_seconds(
    numel: int,
    stage: int,
    offload: str,
    accumulation: int,
    measured: Measured,
    compute_bytes: int = 2,
    overlapped: bool | None = None,
) -> dict[str, float]:
    """The predicted step time of `offload` ("none", "cpu", "cpu+param") and its parts, in seconds
    ([Note: the offload step time model]); `hidden_behind_forward` is host work the next forward hides (not in
    `total`).

    Args:
        numel: this rank's trainable elements (the model's trainable parameters / world size at stages 1-3).
        accumulation: micro-steps per optimizer step.
        compute_bytes: bytes per element of the parameters on the device (bf16 / fp16: 2, fp32: 4).
        overlapped: the host step runs across the step boundary; None: the engine's default (at stage 3).

    Raises:
        ValueError: an offload mode the model does not cover (nvme), or parameter offload below stage 3.
    """
    if offload not in ("none", "cpu", "cpu+param"):
        raise ValueError(f"offload={offload!r}: the step time model covers none, cpu and cpu+param")
    if offload == "cpu+param" and stage != 3:
        raise ValueError(f"offload={offload!r} at stage {stage}: parameter offload needs stage 3")
    parts = {"no_offload": measured.step_seconds, "gradients_to_host": 0.0, "host_step": 0.0, "uploads": 0.0}
    parts["parameter_reads"] = parts["hidden_behind_forward"] = 0.0
    if offload != "none":
        per_second = measured.copy_gbps * 1e9
        reductions = accumulation if stage >= 2 else 1
        backward = BACKWARD_SHARE * measured.step_seconds
        parts["gradients_to_host"] = max(0.0, reductions * 4 * numel / per_second - backward)
        parts["host_step"] = numel / measured.host_rate
        if offload == "cpu":
            parts["uploads"] = min(numel, CHUNK_NUMEL) * 4 / per_second
        else:
            reads = accumulation * 2 * compute_bytes * numel / per_second
            parts["parameter_reads"] = max(0.0, reads - measured.step_seconds)
        if overlapped if overlapped is not None else stage == 3:
            forward = (1 - BACKWARD_SHARE) * measured.step_seconds / accumulation
            hidden = min(forward, parts["host_step"] + parts["uploads"])
            parts["hidden_behind_forward"] = hidden
            from_step = min(hidden, parts["host_step"])
            parts["host_step"] -= from_step
            parts["uploads"] -= hidden - from_step
    parts["total"] = sum(value for key, value in parts.items() if key != "hidden_behind_forward")
    return {key: round(value, 4) for key, value in parts.items()}
