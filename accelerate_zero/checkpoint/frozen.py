"""Frozen parameters (a LoRA base) left out of engine checkpoints, and the fingerprints that make that safe."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accelerate_zero.checkpoint.fragments import range_fragments
from accelerate_zero.engine import collectives


if TYPE_CHECKING:
    from accelerate_zero.checkpoint.engine_view import ZeroEngine
    from accelerate_zero.engine.checkpoint_state import CheckpointState


# [Note: frozen parameters are not saved]
# A LoRA run's base is most of the model and never changes: writing it into every checkpoint (rank 0 at stages 0-2,
# every rank's shard at stage 3) costs a copy of the base per save for nothing the model does not already hold. So
# by default frozen parameters are left out (DeepSpeed and the Trainer call this `exclude_frozen_parameters`; the
# Trainer passes it for PEFT models). What makes that safe is the fingerprint: meta.json records, per frozen
# parameter, its shape and the float64 sum and absolute sum of its values (summed over the ranks' shards), and
# loading recomputes them on the model it restores into. A model built from another base (or not loaded at all)
# fails with the parameter's name instead of training on silently wrong weights. Sums in float64 differ across
# world sizes by summation order only (~1e-15 relative); the check allows 1e-6 of the absolute sum.
FINGERPRINT_RTOL = 1e-6


def frozen_names(state: CheckpointState) -> list[str]:
    return [n for n, p in state.module.named_parameters() if not p.requires_grad]


def frozen_fingerprints(engine: ZeroEngine) -> dict[str, list[float]]:
    """Per frozen parameter [sum, sum of |values|] in float64 over the whole parameter; every rank must call it."""
    state = engine.checkpoint_state()
    names = frozen_names(state)
    index = {name: i for i, name in enumerate(names)}
    sums = torch.zeros(len(names), 2, dtype=torch.float64)
    in_flats: set[str] = set()
    by_id = {id(p): n for n, p in state.module.named_parameters()}
    for frozen in state.frozen_shards():
        shard = state.read_frozen(frozen)
        shard_range = frozen.range
        for frag in range_fragments(shard_range.plan, shard_range.params, by_id, shard_range.lo, shard_range.hi):
            sums[index[frag.name]] += _sums(shard[frag.offset : frag.offset + frag.numel])
        in_flats.update(by_id[id(p)] for p in frozen.range.params)
    for name, param in state.module.named_parameters():
        if name in index and name not in in_flats:
            # held whole on every rank: counted on rank 0; a split expert: on the ranks that save it
            split = state.part_of_whole(param) is not None
            if state.writes_parts if split else engine.dp.rank == 0:
                sums[index[name]] += _sums(param)
    sums = sums.to(engine.device)
    collectives.all_reduce(sums, engine.dp, engine.comm_stats_counter, kind="checkpoint")
    return {name: sums[i].tolist() for name, i in index.items()}


_SUM_CHUNK = 1 << 24


def _sums(values: torch.Tensor) -> torch.Tensor:
    """[sum, sum of |values|] in float64 on the CPU, a chunk at a time where the values are: a float64 copy of a
    whole frozen weight (an 8B model's embedding: 4 GB on the GPU) is never made."""
    out = torch.zeros(2, dtype=torch.float64, device=values.device)
    for chunk in values.detach().reshape(-1).split(_SUM_CHUNK):
        out[0] += chunk.sum(dtype=torch.float64)
        out[1] += chunk.abs().sum(dtype=torch.float64)
    return out.cpu()


def check_frozen(engine: ZeroEngine, meta: dict[str, Any], folder: Path) -> set[str]:
    """The frozen parameters the checkpoint left out, after checking the model holds the saved values."""
    saved: dict[str, list[float]] = meta.get("frozen_fingerprints") or {}
    if not saved:
        return set()
    now = frozen_fingerprints(engine)
    wrong = []
    for name, (total, absolute) in saved.items():
        if name not in now:
            continue  # _check_shapes reports parameters the model lacks or trains
        got_total, got_absolute = now[name]
        tolerance = FINGERPRINT_RTOL * max(absolute, 1e-30)
        if abs(got_total - total) > tolerance or abs(got_absolute - absolute) > tolerance:
            wrong.append(f"{name} (sum {got_total:.9g}, saved {total:.9g})")
    if wrong:
        raise ValueError(
            f"{folder} was saved without its {len(saved)} frozen parameters (exclude_frozen_parameters), which must "
            f"come from the model, but {len(wrong)} of the model's differ from the ones trained with: "
            + "; ".join(wrong[:5])
            + ("; ..." if len(wrong) > 5 else "")
            + ". Build the model from the same base weights (e.g. the same from_pretrained folder) before loading."
        )
    return set(saved)
