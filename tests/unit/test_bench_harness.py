"""bench/harness: the peers train the same model the same way and count their bytes by the ring convention, the
timed loop's readings summarize, and `launch.on_ranks` brings back what every rank returned and the failing rank's
traceback. Tiny Linear stack (hidden 16, 2 layers) on pooled gloo ranks; one real launch (the launcher itself)."""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import run_distributed


BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from harness import launch, report, summary  # noqa: E402


PEER_NAMES = ["ddp", "ddp_bucket_view", "ddp_zero_r", "fsdp2", "az0", "az1", "az2", "az3"]
TIMED = ("ddp", "az3")
"""Peers run through the timed loop; the others step plainly (the loop's garbage collections and live-tensor scan
cost seconds per peer in a test process)."""
HIDDEN, LAYERS, ACCUM = 16, 2, 2


def _mse(module: Any, x: Any, y: Any) -> Any:
    from torch import nn

    return nn.functional.mse_loss(module(x), y)


def _train_every_peer(rank: int, world_size: int) -> dict[str, Any]:
    """Every peer, in turn, trains the same stack for 3 steps of 2 micro-steps; bytes and (timed peers) the timed
    loop's readings over the last 2."""
    sys.path.insert(0, str(BENCH))
    import torch.distributed as dist
    from harness import models, peers, steps

    dist.init_process_group("gloo")
    out = {}
    for name in PEER_NAMES:
        model = models.build_model(HIDDEN, LAYERS)
        x, y = models.make_batch(rank, HIDDEN)
        config = models.engine_config(int(name[-1])) if name.startswith("az") else None
        system = peers.build(name, model, functools.partial(_mse, x=x, y=y), grad_accum=ACCUM, zero_config=config)
        if name in TIMED:
            measurement = steps.start_measurement()
            measurement.params = sum(p.numel() for p in models.build_model(HIDDEN, LAYERS).parameters())
            steps.run_steps(measurement, system.step, warmup=1, steps=2, reset_comm=system.reset_comm)
            out[name] = vars(measurement)
        else:
            losses = [float(system.step())]
            system.reset_comm()
            out[name] = {"losses": losses + [float(system.step()) for _ in range(2)]}
        out[name]["comm"] = system.comm()
        system.close()
        if system.engine is not None:
            system.engine.destroy()
    return out


def test_peers_train_alike_and_count_bytes_by_the_ring_convention() -> None:
    ranks = run_distributed(_train_every_peer, 2)
    timed = {name: summary.summarize(name, [[r[name] for r in ranks]]) for name in TIMED}
    for name, s in timed.items():
        assert s.steps == 2 and s.world_size == 2 and s.params == timed["ddp"].params, name
        assert s.wire_mb_per_step > 0 and s.step_ms > 0 and s.cpu_ms_per_rank >= 0, name
    final = {name: statistics.fmean(r[name]["losses"][-1] for r in ranks) for name in PEER_NAMES}
    for name in PEER_NAMES:  # the same training, every peer
        assert final[name] == pytest.approx(final["ddp"], rel=1e-5), name
    losses = ranks[0]["ddp"]["losses"]
    assert losses[2] < losses[0]
    comm = {name: ranks[0][name]["comm"] for name in PEER_NAMES}  # over the last 2 steps
    # DDP: one all-reduce of the gradients per optimizer step (accumulation under no_sync): 2Ψ(W−1)/W·4 bytes.
    assert timed["ddp"].comm_mb_per_step * summary.MB == pytest.approx(
        summary.comm_formula_bytes(timed["ddp"].params, 2)
    )
    assert comm["ddp_bucket_view"]["total"] == comm["ddp"]["total"]
    assert set(comm["ddp_zero_r"]) == {"all_reduce", "broadcast", "total"}
    # FSDP2 reduce-scatters every micro-step and gathers in forward and backward (2 units, 2 micro-steps, 2 steps).
    assert comm["fsdp2"]["reduce_scatter"]["calls"] == 2 * LAYERS * ACCUM and comm["fsdp2"]["all_gather"]["calls"] > 0
    for stage in range(4):
        assert comm[f"az{stage}"]["total"]["bytes_per_rank"] > 0


def _rank_facts_or_fail(scale: int, message: str) -> dict[str, int]:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(message)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "value": scale * (dist.get_rank() + 1)}


def test_on_ranks_brings_back_each_rank_and_names_the_failure(tmp_path: Path) -> None:
    """One launch: rank 0 returns, rank 1 raises; the failure carries rank 1's own traceback and rank 0's result."""
    kwargs = {"scale": 10, "message": "the cause, not torchrun's summary"}
    with pytest.raises(launch.LaunchFailed, match="ValueError: the cause, not torchrun's summary") as failed:
        launch.on_ranks(2, _rank_facts_or_fail, kwargs, out_dir=tmp_path)
    assert failed.value.results == [{"rank": 0, "world_size": 2, "value": 10}, None]
    assert failed.value.code != 0
    records = summary.records(launch.Ranks([{"extra": {"a": 1}}], 1.0, (0.5, 0.7), tmp_path / "x.log"))
    assert records == [{"extra": {"a": 1, "loadavg_1min": [0.5, 0.7]}}]


def test_interleaved_rounds_and_report_pieces() -> None:
    assert launch.interleaved(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert report.table(["x", "y"], [(1, 2)]) == "| x | y |\n|---|--:|\n| 1 | 2 |"
    with pytest.raises(ValueError, match="align 'l' has 1 letters for 2 columns"):
        report.table(["x", "y"], [], "l")
    assert report.at_most("t", 2.0, 1.0, 1.5).line() == "FAIL  t: 2.0 vs 1.0 (ratio 2.00, limit 1.5)"
    assert report.at_most("t", None, 1.0, 1.5).passed is None
    assert report.ratio(3.0, 2.0) == "1.50" and report.ratio(1.0, None) == "—" and report.fmt(None) == "—"
