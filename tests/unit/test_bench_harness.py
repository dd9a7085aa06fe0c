"""bench/harness: the peers train the same model the same way and count their bytes by the ring convention, the
timed loop's readings summarize, and `launch.on_ranks` brings back every rank's result or the failing rank's
traceback. Tiny Linear stack (hidden 16, 2 layers) on pooled gloo ranks; two real launches (the launcher itself)."""

from __future__ import annotations

import functools
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
HIDDEN, LAYERS, ACCUM = 16, 2, 2


def _mse(module: Any, x: Any, y: Any) -> Any:
    from torch import nn

    return nn.functional.mse_loss(module(x), y)


def _train_every_peer(rank: int, world_size: int) -> dict[str, Any]:
    """Every peer, in turn, trains the same stack for 3 steps of 2 micro-steps; the timed loop reads the last 2."""
    sys.path.insert(0, str(BENCH))
    import torch.distributed as dist
    from harness import models, peers, steps

    dist.init_process_group("gloo")
    out = {}
    for name in PEER_NAMES:
        model = models.build_model(HIDDEN, LAYERS)
        x, y = models.make_batch(rank, HIDDEN)
        config = models.engine_config(int(name[-1])) if name.startswith("az") else None
        loss = functools.partial(_mse, x=x, y=y)
        system = peers.build(name, model, loss, grad_accum=ACCUM, zero_config=config)
        measurement = steps.start_measurement()
        measurement.params = sum(p.numel() for p in models.build_model(HIDDEN, LAYERS).parameters())
        steps.run_steps(measurement, system.step, warmup=1, steps=2, reset_comm=system.reset_comm)
        measurement.comm = system.comm()
        system.close()
        if system.engine is not None:
            system.engine.destroy()
        out[name] = vars(measurement)
    return out


def test_peers_train_alike_and_count_bytes_by_the_ring_convention() -> None:
    ranks = run_distributed(_train_every_peer, 2)
    by_peer = {name: summary.summarize(name, [[r[name] for r in ranks]]) for name in PEER_NAMES}
    ddp = by_peer["ddp"]
    psi = ddp.params
    for name, s in by_peer.items():
        assert s.steps == 2 and s.world_size == 2 and s.params == psi
        assert s.final_loss == pytest.approx(ddp.final_loss, rel=1e-5), name  # the same training, every peer
        assert s.wire_mb_per_step > 0 and s.step_ms > 0 and s.cpu_ms_per_rank >= 0, name
    losses = [ranks[0]["ddp"]["losses"][i] for i in range(3)]
    assert losses[2] < losses[0]
    # DDP: one all-reduce of the gradients per optimizer step (accumulation under no_sync): 2Ψ(W−1)/W·4 bytes.
    assert ddp.comm_mb_per_step * summary.MB == pytest.approx(summary.comm_formula_bytes(psi, 2))
    assert set(by_peer["ddp_zero_r"].comm_by_kind) == {"all_reduce", "broadcast", "total"}
    # FSDP2 reduce-scatters every micro-step and gathers in forward and backward (2 units, 2 micro-steps).
    fsdp2 = by_peer["fsdp2"].comm_by_kind
    assert fsdp2["reduce_scatter"]["calls"] == 2 * LAYERS * ACCUM and fsdp2["all_gather"]["calls"] > 0
    for stage in range(4):
        assert by_peer[f"az{stage}"].comm_mb_per_step > 0


def _rank_facts(scale: int) -> dict[str, int]:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "value": scale * (dist.get_rank() + 1)}


def _fails(message: str) -> None:
    raise ValueError(message)


def test_on_ranks_returns_every_rank_and_names_the_failure(tmp_path: Path) -> None:
    done = launch.on_ranks(2, _rank_facts, {"scale": 10}, out_dir=tmp_path)
    assert done.results == [{"rank": 0, "world_size": 2, "value": 10}, {"rank": 1, "world_size": 2, "value": 20}]
    assert len(done.load) == 2 and done.seconds > 0
    records = summary.records(launch.Ranks([{"extra": {"a": 1}}], 1.0, (0.5, 0.7), done.log))
    assert records == [{"extra": {"a": 1, "loadavg_1min": [0.5, 0.7]}}]
    with pytest.raises(launch.LaunchFailed, match="ValueError: the cause, not torchrun's summary"):
        launch.on_ranks(1, _fails, {"message": "the cause, not torchrun's summary"}, out_dir=tmp_path, backend="none")


def test_interleaved_rounds_and_report_pieces() -> None:
    assert launch.interleaved(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert report.table(["x", "y"], [(1, 2)]) == "| x | y |\n|---|--:|\n| 1 | 2 |"
    with pytest.raises(ValueError, match="align 'l' has 1 letters for 2 columns"):
        report.table(["x", "y"], [], "l")
    assert report.at_most("t", 2.0, 1.0, 1.5).line() == "FAIL  t: 2.0 vs 1.0 (ratio 2.00, limit 1.5)"
    assert report.at_most("t", None, 1.0, 1.5).passed is None
    assert report.ratio(3.0, 2.0) == "1.50" and report.ratio(1.0, None) == "—" and report.fmt(None) == "—"
