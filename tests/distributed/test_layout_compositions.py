"""hpZ, MiCS and ZeRO++ composed with bf16, CPU and NVMe offload, activation checkpointing and the Trainer, and
resumed on another node count, on 2 simulated nodes (engine/layout.py).

Each layout trains the same tiny Llama as flat stage 3 under the same config, with accumulation and clipping:
- fp32 with optimizer and parameter shards on NVMe: hpZ and MiCS equal flat to 1e-6 (replicas of a shard on one
  node write separate folders);
- bf16 with optimizer and parameter offload to the CPU: the fp32 masters (from a checkpoint) of hpZ equal flat's
  (the same values gathered another way), MiCS's within 1e-4 (its gradients are summed in another order, and bf16
  weights round the difference up), ZeRO++'s within 30% of the training update: int4 gradients carry noise of
  about a tenth of a block's spread per rank (measured 15% here after 2 steps; a misrouted chunk is over 100%);
- a checkpoint of 2 nodes x 2 (MiCS) resumed on 2 nodes x 4 (hpZ) equals one process trained on the same batches.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from accelerate_zero.checkpoint.consolidate import consolidated_state_dict
from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config, update_error


STEPS, GRAD_ACCUM, SEQ, VOCAB, NODES = 2, 2, 10, 64, 2
BASE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def _model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def _batches(world_size: int, steps: int = STEPS, seed: int = 5) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, VOCAB, (world_size, SEQ), generator=gen) for _ in range(GRAD_ACCUM)] for _ in range(steps)
    ]


def _engine(zero: dict, bf16: bool = False) -> Any:
    import accelerate_zero

    model = _model()
    config: dict[str, Any] = {"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": 0.5}
    config["zero_optimization"] = {**BASE, **zero}
    if bf16:
        config["bf16"] = {"enabled": True}
    return accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), config=config)


def _train(engine: Any, batches: list, rank: int) -> None:
    for step in batches:
        for tokens in step:
            mine = tokens[rank : rank + 1]
            engine.backward(engine(input_ids=mine, labels=mine).loss)
            engine.step()


def _layouts(per_node: int) -> dict[str, dict]:
    return {
        "flat": {},
        "hpz": {"zero_hpz_partition_size": per_node},
        "mics": {"mics_shard_size": per_node},
        "zeropp": {
            "zero_hpz_partition_size": per_node,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
        },
    }


def _masters(engine: Any, folder: str, rank: int) -> dict[str, torch.Tensor] | None:
    engine.save_checkpoint(folder, tag="end")
    return consolidated_state_dict(f"{folder}/end") if rank == 0 else None


def _compositions(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    os.environ["ACCELERATE_ZERO_SIMULATED_NODES"] = str(NODES)
    per_node, batches = world_size // NODES, _batches(world_size)
    out: dict[str, Any] = {"nvme": {}, "bf16": {}}
    nvme_masters = {}
    for name, layout in _layouts(per_node).items():
        if name == "zeropp":
            continue
        offload = {
            "offload_optimizer": {"device": "nvme", "nvme_path": f"{folder}/nvme-{name}"},
            "offload_param": {"device": "nvme", "nvme_path": f"{folder}/nvme-{name}"},
        }
        engine = _engine({**layout, **offload})
        _train(engine, batches, rank)
        nvme_masters[name] = _masters(engine, f"{folder}/ckpt-nvme-{name}", rank)
    bf16_masters = {}
    for name, layout in _layouts(per_node).items():
        offload = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
        engine = _engine({**layout, **offload}, bf16=True)
        _train(engine, batches, rank)
        bf16_masters[name] = _masters(engine, f"{folder}/ckpt-bf16-{name}", rank)
    if rank == 0:
        start = {k: v.detach().bfloat16().float() for k, v in _model().named_parameters()}
        for name, masters in nvme_masters.items():
            out["nvme"][name] = max((masters[k] - nvme_masters["flat"][k]).abs().max().item() for k in masters)
        for name, masters in bf16_masters.items():
            out["bf16"][name] = {
                "max": max((masters[k] - bf16_masters["flat"][k]).abs().max().item() for k in start),
                "update": update_error(masters, bf16_masters["flat"], start),
            }
    return out


def test_layouts_with_bf16_and_offload(tmp_path) -> None:
    out = run_distributed(_compositions, 4, str(tmp_path), timeout=600)[0]
    assert out["nvme"]["hpz"] <= 1e-6 and out["nvme"]["mics"] <= 1e-6, out["nvme"]
    assert out["bf16"]["hpz"]["max"] == 0.0, out["bf16"]
    assert out["bf16"]["mics"]["max"] <= 1e-4, out["bf16"]
    assert 0.0 < out["bf16"]["zeropp"]["update"] <= 0.3, out["bf16"]


# ---------------------------------------------------------------------------------------- another node count
def _save_on_two_by_two(rank: int, world_size: int, folder: str) -> None:
    os.environ["ACCELERATE_ZERO_SIMULATED_NODES"] = str(NODES)
    engine = _engine({"mics_shard_size": 2})
    _train(engine, _batches(world_size, steps=1), rank)
    engine.save_checkpoint(folder, tag="t")


def _resume_on_two_by_four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import accelerate_zero

    os.environ["ACCELERATE_ZERO_SIMULATED_NODES"] = str(NODES)
    engine = _engine({"zero_hpz_partition_size": 4})
    engine.load_checkpoint(folder, tag="t")
    _train(engine, _batches(world_size, steps=1, seed=9), rank)
    with accelerate_zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_a_checkpoint_resumes_on_another_node_count(tmp_path) -> None:
    run_distributed(_save_on_two_by_two, 4, str(tmp_path))
    resumed = run_distributed(_resume_on_two_by_four, 8, str(tmp_path))[0]
    model = _model()  # one process, the same batches: 4 sequences per micro-step, then 8
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in [*_batches(4, steps=1), *_batches(8, steps=1, seed=9)]:
        for tokens in step:
            (model(input_ids=tokens, labels=tokens).loss / GRAD_ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    expected = dict(model.named_parameters())
    assert max((resumed[k] - expected[k]).abs().max().item() for k in resumed) < 1e-5


# ------------------------------------------------------------------------------------ through the transformers Trainer
def _trainer_with_parallelism_config(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """`TrainingArguments(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))`: the engine
    runs replicate x shard and trains as flat stage 3 does."""
    from accelerate import ParallelismConfig

    from accelerate_zero import Trainer, TrainingArguments
    from tests.helpers.dist import plain_torchrun_environment
    from tests.integration import trainer_checks as checks

    plain_torchrun_environment()
    out: dict[str, Any] = {}
    for name, parallelism in (("flat", None), ("hsdp", ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))):
        model = checks.tiny_llama()
        kwargs = checks.args_kwargs(f"{folder}/{name}", 2, parallelism_config=parallelism)
        args = TrainingArguments(zero_config=checks.zero_config(3), **kwargs)
        trainer = Trainer(model=model, args=args, train_dataset=checks.dataset())
        trainer.train()
        out[name] = {
            "kind": trainer.zero_engine.layout.plan.kind,
            "state": trainer.accelerator.get_state_dict(model),
            "losses": checks.losses(trainer),
        }
    return out


def test_trainer_parallelism_config_is_replicate_x_shard(tmp_path) -> None:
    out = run_distributed(_trainer_with_parallelism_config, 4, str(tmp_path))[0]
    assert out["flat"]["kind"] == "flat" and out["hsdp"]["kind"] == "replicate_x_shard"
    flat, hsdp = out["flat"]["state"], out["hsdp"]["state"]
    assert max((flat[k] - hsdp[k]).abs().max().item() for k in flat) <= 1e-6
    assert out["hsdp"]["losses"] == pytest.approx(out["flat"]["losses"], abs=1e-6)


# ------------------------------------------------------------------------------------- activation checkpointing
def _with_activation_checkpointing(rank: int, world_size: int) -> dict[str, float]:
    """Recomputed forwards in backward gather from hpZ's secondary copy; MiCS's from its group. Also hpZ under
    DeepSpeed's default reuse distance, where units stay gathered until their backward (no secondary copy)."""
    import accelerate_zero

    os.environ["ACCELERATE_ZERO_SIMULATED_NODES"] = str(NODES)
    per_node, batches = world_size // NODES, _batches(world_size, steps=3)
    layouts = {
        **_layouts(per_node),
        "hpz_kept": {"zero_hpz_partition_size": per_node, "stage3_max_reuse_distance": 10**9},
    }
    layouts.pop("zeropp")
    weights = {}
    for name, layout in layouts.items():
        for reentrant in (True, False):
            engine = _engine(layout)
            engine.module.gradient_checkpointing_enable({"use_reentrant": reentrant})
            _train(engine, batches, rank)
            with accelerate_zero.GatheredParameters(list(engine.module.parameters())):
                weights[name, reentrant] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        f"{name} reentrant={reentrant}": max((w[k] - weights["flat", reentrant][k]).abs().max().item() for k in w)
        for (name, reentrant), w in weights.items()
    }


def test_layouts_with_activation_checkpointing() -> None:
    for case, diff in run_distributed(_with_activation_checkpointing, 4)[0].items():
        assert diff <= 1e-6, (case, diff)
