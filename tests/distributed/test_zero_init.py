"""`accelerate_zero.deepspeed.zero.Init` on 3 ranks: partitioned as built, exact, and adopted by `initialize`.

One pooled body checks: the bytes of tensors alive (counted by walking every live tensor, not by our bookkeeping)
grow by about 1/3 of the model while it is built and after, where an eager build holds all of it; the values equal
an eager build's with the same seed, including weights re-initialised after their module was partitioned (a
parent's `nn.init.zeros_`, `.data.mul_`, transformers' `post_init`); `GatheredParameters(modifier_rank=1)` before
`initialize` makes rank 1's writes every rank's; `initialize` at stage 3 holds 1/3 of every unit and trains exactly
as an engine over the eager-built model, at stage 2 it gets the full weights back; `zero.Init(module=...)`
partitions a built model; arguments it lacks are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bench.harness.readings import live_tensor_bytes
from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config
from tests.helpers.settle import settled


WIDTH, BLOCKS = 48, 6


def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage a live tensor holds (parameters included), found by the garbage collector,
    once gloo has let go of the buffers zero.Init all-gathered (tests/helpers/settle.py; a 576-byte gathered
    `head.weight` still alive in a baseline once made an eager build look 576 bytes smaller than its parameters)."""
    return settled(_storage_bytes)


def _storage_bytes() -> int:
    with torch._C.DisableTorchFunction():  # inside zero.Init: look at the placeholders, do not gather them
        return live_tensor_bytes()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        nn.init.zeros_(self.down.bias)  # after `down` was attached (and partitioned)
        self.down.weight.data.mul_(0.5)  # a read-modify-write through .data
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.down(torch.tanh(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, probe: Any = None) -> None:
        super().__init__()
        self.embed = nn.Linear(7, WIDTH)
        blocks = []
        for index in range(BLOCKS):
            blocks.append(_Block())
            if probe is not None and index % 2:  # every other block: each probe walks every live object
                probe()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, 3)
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _model_bytes() -> int:
    return sum(p.numel() * 4 for p in _Stack().parameters())


def _train(engine: Any, rank: int, world_size: int) -> list[float]:
    generator = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        x, y = torch.randn(2 * world_size, 7, generator=generator), torch.randn(2 * world_size, 3, generator=generator)
        mine = slice(2 * rank, 2 * rank + 2)
        loss = nn.functional.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _memory_and_values(ds: Any, rank: int) -> dict[str, Any]:
    from accelerate_zero.engine.stage3 import init_shards

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    before = _live_tensor_bytes()
    peaks: list[int] = []
    with ds.zero.Init(config_dict_or_path=_config(3)):
        model = _Stack(probe=lambda: peaks.append(_live_tensor_bytes() - before))
    out["held_partitioned"] = _live_tensor_bytes() - before
    out["peak_partitioned"] = max(peaks)
    out["placeholders"] = all(p.numel() == 0 for p in model.parameters())
    torch.manual_seed(0)
    eager_before = _live_tensor_bytes()
    eager = _Stack()
    out["held_eager"] = _live_tensor_bytes() - eager_before
    full = {name: init_shards.gather(p) for name, p in model.named_parameters()}
    out["equal_to_eager"] = all(torch.equal(full[n], p) for n, p in eager.named_parameters())
    out["zeroed_bias"] = bool((full["blocks.0.down.bias"] == 0).all())
    return out


def _llama_and_modifier(ds: Any, rank: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    out: dict[str, Any] = {}
    torch.manual_seed(1)
    with ds.zero.Init(config_dict_or_path=_config(3)):
        llama = LlamaForCausalLM(tiny_llama_config())
    torch.manual_seed(1)
    reference = LlamaForCausalLM(tiny_llama_config())
    with ds.zero.GatheredParameters(list(llama.parameters())):
        out["llama_equal"] = all(
            torch.equal(a, b) for a, b in zip(llama.parameters(), reference.parameters(), strict=True)
        )
    weight = llama.model.norm.weight
    with ds.zero.GatheredParameters(weight, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                weight.fill_(float(rank) + 0.5)
    with ds.zero.GatheredParameters([weight]):
        out["modified"] = weight.clone()
    out["norm_is_placeholder"] = weight.numel() == 0
    return out


def _initialize(ds: Any, rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (3, 2):
        torch.manual_seed(0)
        with ds.zero.Init(config_dict_or_path=_config(stage)):
            model = _Stack()
        engine, *_ = ds.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=_config(stage)
        )
        torch.manual_seed(0)
        eager = _Stack()
        reference, *_ = ds.initialize(
            model=eager, optimizer=torch.optim.AdamW(eager.parameters(), lr=1e-2), config=_config(stage)
        )
        if stage == 3:
            padded = sum(flat.plan.numel for unit in engine.units for flat in unit.flats)
            out["held_vs_padded"] = (engine.memory_breakdown()["parameters"], 4 * padded // world_size)
        out[f"losses {stage}"] = (_train(engine, rank, world_size), _train(reference, rank, world_size))
        engine.destroy()
        reference.destroy()
    torch.manual_seed(0)
    built = _Stack()
    ds.zero.Init(module=built, config_dict_or_path=_config(3))
    out["module_partitioned"] = all(p.numel() == 0 for p in built.parameters())
    try:
        ds.zero.Init(mpu=object())
        out["refusal"] = None
    except ds.DeepSpeedUnavailable as error:
        out["refusal"] = str(error)
    return out


def _zero_init_checks(rank: int, world_size: int) -> dict[str, Any]:
    import accelerate_zero.deepspeed as ds

    ds.init_distributed()
    return {**_memory_and_values(ds, rank), **_llama_and_modifier(ds, rank), **_initialize(ds, rank, world_size)}


def test_zero_init_partitions_while_building_and_initialize_adopts_it() -> None:
    world_size = 3
    results = run_distributed(_zero_init_checks, world_size)
    total, block = _model_bytes(), sum(p.numel() * 4 for p in _Block().parameters())
    for rank, r in enumerate(results):
        assert r["placeholders"] and r["equal_to_eager"] and r["zeroed_bias"] and r["llama_equal"], rank
        assert r["held_eager"] >= total
        # ~1/3 of the model (each parameter padded to a multiple of 3 elements) plus small temporaries
        assert r["held_partitioned"] < total / world_size + 2048, (r["held_partitioned"], total)
        assert r["peak_partitioned"] < total / world_size + block + 2048, (r["peak_partitioned"], total)
        assert torch.equal(r["modified"], torch.full_like(r["modified"], 1.5)) and r["norm_is_placeholder"]
        held, expected = r["held_vs_padded"]
        assert held == expected, (held, expected)
        for stage in (3, 2):
            mine, eager = r[f"losses {stage}"]
            assert mine == eager, (stage, mine, eager)
        assert r["module_partitioned"]
        assert r["refusal"] is not None and "mpu" in r["refusal"]
