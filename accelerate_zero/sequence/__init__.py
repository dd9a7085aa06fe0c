"""Sequence parallelism (Ulysses): attention over a whole sequence cut across ranks; see sequence/ulysses.py."""

from accelerate_zero.sequence.batch import sequence_parallel_loss, shard_sequence
from accelerate_zero.sequence.normalization import LossNormalization, group_loss
from accelerate_zero.sequence.tiling import tile_mlp, tiled_causal_lm_loss
from accelerate_zero.sequence.ulysses import register_ulysses_attention


__all__ = [
    "LossNormalization",
    "group_loss",
    "register_ulysses_attention",
    "sequence_parallel_loss",
    "shard_sequence",
    "tile_mlp",
    "tiled_causal_lm_loss",
]
