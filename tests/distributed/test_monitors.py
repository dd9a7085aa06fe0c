"""DeepSpeed's monitors (`csv_monitor`, `tensorboard`) and `comms_logger` on 2 gloo ranks: the engine's events under
DeepSpeed's names and steps, rank 0 only, one row per optimizer step ([Note: the monitor's events] in
monitor/events.py), checked against the mean of every micro-batch loss of every rank, the engine's schedule and the
format DeepSpeed's csvMonitor writes; every collective the engine's counters count, timed, without changing a value
([Note: timing collectives] in engine/collectives.py)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model


STEPS, ACCUMULATION, MICRO = 3, 2, 2


def _train(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import accelerate_zero

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                    "warmup_num_steps": 4, "warmup_type": "linear"}},
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": f"{folder}/csv", "job_name": "job"},
        "tensorboard": {"enabled": True, "output_path": f"{folder}/tb", "job_name": "job"},
    }  # fmt: skip
    engine = accelerate_zero.initialize(make_model(), config=config)
    batches = make_batches(STEPS, ACCUMULATION, MICRO * world_size)
    losses, lrs = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        lrs.append(engine.get_lr()[0])
    return {"losses": losses, "lrs": lrs, "norm": engine.get_global_grad_norm(), "batch": engine.train_batch_size()}


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_csv_and_tensorboard_monitors_write_the_engines_events(tmp_path: Path) -> None:
    results = run_distributed(_train, 2, str(tmp_path))
    batch = results[0]["batch"]
    assert batch == MICRO * ACCUMULATION * 2
    samples = [batch * (step + 1) for step in range(STEPS)]
    folder = tmp_path / "csv" / "job"
    files = sorted(p.name for p in folder.iterdir())
    assert files == [
        "Train_Samples_elapsed_time_ms_backward.csv",
        "Train_Samples_elapsed_time_ms_forward.csv",
        "Train_Samples_elapsed_time_ms_step.csv",
        "Train_Samples_grad_norm.csv",
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ], "no loss_scale event without fp16, as DeepSpeed"
    lr = _rows(folder / "Train_Samples_lr.csv")
    assert lr[0] == ["step", "lr"], "DeepSpeed's csvMonitor header: step, the name's last part"
    assert [int(row[0]) for row in lr[1:]] == samples, "one row per optimizer step, at DeepSpeed's global_samples"
    assert [float(row[1]) for row in lr[1:]] == pytest.approx(results[0]["lrs"], rel=1e-12)
    assert len(set(results[0]["lrs"])) == STEPS, "the warmup moves the learning rate every step"
    loss = _rows(folder / "Train_Samples_train_loss.csv")
    per_step = ACCUMULATION
    expected = [
        sum(r["losses"][step * per_step + m] for r in results for m in range(per_step)) / (per_step * len(results))
        for step in range(STEPS)
    ]
    assert [float(row[1]) for row in loss[1:]] == pytest.approx(expected, rel=1e-6), "mean over micro-steps and ranks"
    norm = _rows(folder / "Train_Samples_grad_norm.csv")
    assert float(norm[-1][1]) == pytest.approx(results[0]["norm"], rel=1e-12)
    for phase in ("forward", "backward", "step"):
        times = _rows(folder / f"Train_Samples_elapsed_time_ms_{phase}.csv")
        assert len(times) == STEPS + 1 and all(float(row[1]) > 0 for row in times[1:])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "job"))
    events.Reload()
    scalars = events.Scalars("Train/Samples/train_loss")
    assert [s.step for s in scalars] == samples
    assert [s.value for s in scalars] == pytest.approx(expected, rel=1e-6)
    assert [s.value for s in events.Scalars("Train/Samples/lr")] == pytest.approx(results[0]["lrs"], rel=1e-6)


def _comms(rank: int, world_size: int) -> dict[str, Any]:
    """Stage 2, two steps, with the comms logger on (every op, then reduce-scatters only) and off."""
    import accelerate_zero

    out: dict[str, Any] = {}
    only_reduce_scatter = {"enabled": True, "prof_all": False, "prof_ops": ["reduce_scatter_tensor"]}
    for name, logger in (("off", None), ("all", {"enabled": True}), ("ops", only_reduce_scatter)):
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}}
        if logger is not None:
            config["comms_logger"] = logger
        model = make_model()
        engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        batches = make_batches(2, 1, MICRO * world_size)
        for step in range(2):
            x, y = batches.rank_slice(step, 0, rank, world_size)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        log = engine.step_log.comms_log
        out[name] = {
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "stats": engine.comm_stats(),
            "records": None if log is None else {k: dict(by) for k, by in log.records.items()},
            "summary": None if log is None else log.summary(),
        }
    return out


def test_comms_logger_times_every_collective_the_counters_count() -> None:
    results = run_distributed(_comms, 2)
    for result in results:
        for name, params in result["all"]["params"].items():
            assert torch.equal(params, result["off"]["params"][name]), "timing collectives changes no value"
        stats, records = result["all"]["stats"], result["all"]["records"]
        kinds = {k: v for k, v in stats.items() if k != "total"}
        assert kinds and set(records) == set(kinds)
        for kind, count in kinds.items():
            assert sum(len(v) for v in records[kind].values()) == count["calls"], kind
            assert sum(size * len(v) for size, v in records[kind].items()) == count["payload_bytes"], kind
            assert all(seconds > 0 for v in records[kind].values() for seconds in v)
        only = result["ops"]["records"]
        assert set(only) == {k for k in kinds if k.startswith("reduce_scatter")} and only, "prof_ops selects"
        columns = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                   "busbw_avg (Gbps)")  # fmt: skip
        header = "".join(f"{c: <20}" for c in columns)
        assert result["all"]["summary"].splitlines()[0] == header, "DeepSpeed's log_summary columns"
        assert result["off"]["records"] is None


def _flops(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Stage 3, accumulation 2, step 1 profiled (the second step), written to a file."""
    import accelerate_zero

    out_file = f"{folder}/flops.txt"
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "flops_profiler": {"enabled": True, "profile_step": 1, "top_modules": 2, "output_file": out_file},
    }
    model = make_model()
    engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    batches = make_batches(3, ACCUMULATION, MICRO * world_size)
    for step in range(3):
        for micro in range(ACCUMULATION):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
    return {"exists": Path(out_file).exists()}


def test_flops_profiler_counts_the_profiled_steps_forwards_and_backwards(tmp_path: Path) -> None:
    """The counts of `torch.utils.flop_counter` on the unsharded model over the same micro-batches, once."""
    from torch.utils.flop_counter import FlopCounterMode

    results = run_distributed(_flops, 2, str(tmp_path))
    text = (tmp_path / "flops.txt").read_text()
    assert text.count("DeepSpeed Flops Profiler") == 1 and "Profile Summary at step 1:" in text
    model, batches = make_model(), make_batches(3, ACCUMULATION, MICRO * 2)
    forward = backward = 0
    for micro in range(ACCUMULATION):
        x, y = batches.rank_slice(1, micro, 0, 2)
        with FlopCounterMode(display=False) as counted:
            loss = torch.nn.functional.mse_loss(model(x), y) / ACCUMULATION
        forward += counted.get_total_flops()
        with FlopCounterMode(display=False) as counted:
            loss.backward()
        backward += counted.get_total_flops()
    lines = dict(line.rsplit(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("depth"))
    assert lines["fwd flops per GPU"].strip() == f"{forward / 1e3:.2f} K"
    assert lines["bwd flops per GPU (counted)"].strip() == f"{backward / 1e3:.2f} K"
    assert lines["batch size per GPU (the step's micro-batches)"].strip() == str(MICRO * ACCUMULATION)
    assert "depth 1: ToyModel.mid" in text, "the largest modules by forward flops"
    assert [r["exists"] for r in results] == [True, True]  # rank 0 wrote it, in the shared folder
