"""`accelerate_zero.deepspeed.initialize` and its engine's DeepSpeed signatures, on 2 ranks (one pooled body).

Pins what the parity test against DeepSpeed does not reach: the returns of `save_checkpoint`/`load_checkpoint`
(True; `(path, client_state)`; `(None, None)` without `latest`; `load_module_only` keeping the step counters),
`save_16bit_model`'s `pytorch_model.bin`, the attribute pass-through to the model, refusals by name, DeepSpeed's
precedence of a client optimizer over the config's block (and `model_parameters` groups for the block's optimizer),
`args.local_rank`, and a model without optimizer (frozen, optimizer None).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_model, param_groups


def _config(**extra: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, **extra}


def _raises(fn: Any, kind: type[BaseException]) -> str | None:
    try:
        fn()
    except kind as error:
        return str(error)
    return None


def _steps(engine: Any, rank: int, count: int = 2) -> list[float]:
    generator = torch.Generator().manual_seed(9 + rank)
    losses = []
    for _ in range(count):
        loss = nn.functional.mse_loss(engine(torch.randn(2, 7, generator=generator)), torch.zeros(2, 3))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _checkpoints(ds: Any, folder: str, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = make_model()
    engine, optimizer, loader, scheduler = ds.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=_config()
    )
    out["returns"] = (optimizer is engine.optimizer, loader, scheduler)
    out["missing"] = engine.load_checkpoint(str(Path(folder) / "nothing"))
    _steps(engine, rank)
    out["saved"] = engine.save_checkpoint(folder, client_state={"epoch": 3})
    with ds.zero.GatheredParameters(list(engine.module.parameters())):
        saved_weights = [p.clone() for p in engine.module.parameters()]
    _steps(engine, rank)
    path, client_state = engine.load_checkpoint(folder)
    out["loaded"] = (Path(path).name, client_state, engine.global_steps)
    with ds.zero.GatheredParameters(list(engine.module.parameters())):
        out["restored"] = all(
            torch.equal(a, b) for a, b in zip(saved_weights, engine.module.parameters(), strict=True)
        )
    _steps(engine, rank)
    engine.load_checkpoint(folder, load_module_only=True)
    out["module_only_steps"] = engine.global_steps  # 4 steps taken: the counters stay
    out["save_latest"] = _raises(lambda: engine.save_checkpoint(folder, save_latest=False), ds.DeepSpeedUnavailable)
    out["strict"] = _raises(lambda: engine.load_checkpoint(folder, load_module_strict=False), ds.DeepSpeedUnavailable)
    out["no_gather_flag"] = engine.save_16bit_model(str(Path(folder) / "bin"))
    return out


def _surface(ds: Any, folder: str, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = make_model()
    config = _config(zero_optimization={"stage": 2}, gradient_accumulation_steps=2)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    client = torch.optim.AdamW(param_groups(model, lr=1e-2, decay=0.1), lr=1e-2)
    engine, optimizer, _, _ = ds.initialize(model=model, optimizer=client, config=config)
    out["client_wins"] = (optimizer is client, type(engine.optimizer).__name__, len(engine.optimizer.param_groups))
    out["forwarded"] = engine.inp is model.inp  # DeepSpeed's pass-through to the module
    out["refused_method"] = _raises(lambda: engine.flops_profiler_enabled(), ds.DeepSpeedUnavailable)
    out["plain_missing"] = _raises(lambda: engine.no_such_thing, AttributeError)
    applied = []
    for _ in range(2):
        _steps(engine, rank, 1)
        applied.append(engine.was_step_applied())
    out["applied"] = applied
    out["batch"] = (engine.train_batch_size(), engine.global_samples, engine.get_batch_info())
    out["16bit"] = engine.save_16bit_model(folder)
    out["monitor_off"] = engine.monitor.enabled
    csv_config = {**config, "csv_monitor": {"enabled": True, "output_path": f"{folder}/csv", "job_name": "job"}}
    monitored, _, _, _ = ds.initialize(model=make_model(), optimizer=None, config=csv_config)
    out["monitor_on"] = monitored.monitor.enabled
    monitored.monitor.write_events([("Custom/rank_value", float(rank) + 0.5, 7)])  # rank 0's value is written
    model2 = make_model()
    groups = param_groups(model2, lr=0.1, decay=0.1)
    engine2, optimizer2, _, _ = ds.initialize(model=model2, model_parameters=groups, config=config)
    out["block_over_groups"] = [(g["lr"], g["weight_decay"]) for g in optimizer2.param_groups]
    parser = ds.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", f"--local_rank={1 - rank}"])
    out["local_rank"] = _raises(lambda: ds.initialize(args=args, model=make_model(), config=config), ValueError)
    out["no_config"] = _raises(lambda: ds.initialize(model=make_model()), ValueError)
    out["mpu"] = _raises(
        lambda: ds.initialize(model=make_model(), config=config, mpu=object()), ds.DeepSpeedUnavailable
    )
    frozen = make_model()
    engine3, optimizer3, _, _ = ds.initialize(model=frozen, config=_config())
    out["inference"] = (optimizer3, any(p.requires_grad for p in frozen.parameters()), engine3(torch.ones(1, 7)).shape)
    return out


def _engine_api(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import accelerate_zero.deepspeed as ds

    return {**_checkpoints(ds, str(Path(folder) / "ckpt"), rank), **_surface(ds, str(Path(folder) / "bits"), rank)}


def test_deepspeed_engine_signatures_and_refusals(tmp_path: Path) -> None:
    for r in run_distributed(_engine_api, 2, str(tmp_path)):
        assert r["returns"] == (True, None, None)
        assert r["missing"] == (None, None)
        assert r["saved"] is True
        assert r["loaded"] == ("global_step2", {"epoch": 3}, 2) and r["restored"]
        assert r["module_only_steps"] == 4
        assert "save_latest" in r["save_latest"] and "load_module_strict" in r["strict"]
        assert r["no_gather_flag"] is False  # stage 3 without stage3_gather_16bit_weights_on_model_save
        assert r["client_wins"] == (True, "AdamW", 2)
        assert r["forwarded"] is True
        assert "flops_profiler_enabled" in r["refused_method"] and "no_such_thing" in r["plain_missing"]
        assert r["applied"] == [False, True]  # accumulation 2: the first step() is not a boundary
        assert r["batch"] == (8, 8, (8, 2, 2))
        assert r["16bit"] is True
        assert (r["monitor_off"], r["monitor_on"]) == (False, True)
        assert r["block_over_groups"] == [(0.5, 0.1), (0.05, 0.0)]  # the SGD block's lr, the groups' own values
        assert "Mismatch in local rank" in r["local_rank"]
        assert "deepspeed_config" in r["no_config"] and "mpu" in r["mpu"]
        assert r["inference"][:2] == (None, False) and tuple(r["inference"][2]) == (1, 3)
    rows = (tmp_path / "bits" / "csv" / "job" / "Custom_rank_value.csv").read_text().split()
    assert rows == ["step,rank_value", "7,0.5"]  # DeepSpeed's csvMonitor header; rank 0 alone writes
    saved = torch.load(tmp_path / "bits" / "pytorch_model.bin", weights_only=True)  # DeepSpeed's file name and format
    assert sorted(saved) == sorted(name for name, _ in make_model().named_parameters())
