"""`deepspeed.ops`: DeepSpeed's Adam classes as torch's optimizers (ops.adam); no compiled kernels."""

from accelerate_zero.deepspeed.ops import adam  # noqa: F401  (deepspeed.ops.adam.FusedAdam)
