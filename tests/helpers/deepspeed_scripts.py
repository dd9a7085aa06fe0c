"""Training scripts written against DeepSpeed's own API, run unchanged with `deepspeed` and with
`accelerate_zero.deepspeed` (the module is the `ds` argument): the tests compare what both produce.

- `tutorial`: DeepSpeed's tutorial shape (`add_config_arguments`, `--deepspeed_config`, `initialize` with a client
  optimizer over param groups, a LambdaLR and `training_data`, the loop over the returned loader);
- `chat_sft`: a DeepSpeed-Chat SFT step written offline (a causal LM built under `zero.Init`, weights loaded inside
  `GatheredParameters(modifier_rank=0)`, weight-decay param groups, `model(**batch).loss`);
- `rlhf_actor`: an OpenRLHF-style actor step with a frozen reference model given its own engine (no optimizer).
Each returns this rank's losses and, on rank 0, the trained weights (gathered).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.helpers.models import make_model, param_groups, tiny_llama_config


def _full_weights(ds: Any, module: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    params = list(module.parameters())
    with ds.zero.GatheredParameters(params):
        weights = {name: p.detach().float().clone() for name, p in module.named_parameters()}
    return weights if rank == 0 else None


def tutorial(ds: Any, config: dict, folder: str, rank: int) -> dict[str, Any]:
    path = Path(folder) / "ds_config.json"
    if rank == 0:
        path.write_text(json.dumps(config))
    ds.init_distributed()
    ds.comm.barrier()
    parser = ds.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path), f"--local_rank={rank}"])
    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model, lr=0.02, decay=0.1), lr=0.02)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    generator = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 7, generator=generator), torch.randn(48, 3, generator=generator)
    )
    engine, _, loader, scheduler = ds.initialize(
        args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler, training_data=data
    )
    # Both loaders read this attribute when iterated: no worker processes (DeepSpeed's default is 2; in a spawned
    # test rank each would import the test modules again), the same batches.
    loader.num_local_io_workers = 0
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "lr": engine.get_lr(),
        "steps": engine.global_steps,
        "boundary": engine.is_gradient_accumulation_boundary(),
        "weights": _full_weights(ds, engine.module, rank),
    }


def _llama(ds: Any, config: dict, reference: dict[str, torch.Tensor], rank: int) -> nn.Module:
    """A tiny Llama built the DeepSpeed-Chat way: under zero.Init at stage 3, then the given weights loaded inside
    GatheredParameters(modifier_rank=0), as transformers' loading does under ZeRO-3."""
    import torch._dynamo  # noqa: F401  (DeepSpeed's zero.Init needs it imported first with transformers 5)
    from transformers import LlamaForCausalLM

    stage3 = config["zero_optimization"]["stage"] == 3
    with ds.zero.Init(config_dict_or_path=config, enabled=stage3):
        model = LlamaForCausalLM(tiny_llama_config())
    with ds.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(reference[name])
    return model


def _grouped_parameters(model: nn.Module, weight_decay: float) -> list[dict]:
    """DeepSpeed-Chat's get_optimizer_grouped_parameters: no decay on biases and norms."""
    no_decay = ("bias", "norm.weight", "layernorm.weight")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]


def chat_sft(ds: Any, config: dict, reference: dict[str, torch.Tensor], rank: int) -> dict[str, Any]:
    ds.init_distributed()
    model = _llama(ds, config, reference, rank)
    optimizer = torch.optim.AdamW(_grouped_parameters(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    engine, optimizer, _, scheduler = ds.initialize(
        model=model, optimizer=optimizer, config=config, lr_scheduler=scheduler, dist_init_required=True
    )
    engine.train()
    generator = torch.Generator().manual_seed(5 + rank)
    losses = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 64, (2, 12), generator=generator)
        batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}
        loss = engine(**batch, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "lr": engine.get_lr(), "weights": _full_weights(ds, engine.module, rank)}


def _token_logps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def rlhf_actor(
    ds: Any, config: dict, eval_config: dict, reference: dict[str, torch.Tensor], rank: int
) -> dict[str, Any]:
    ds.init_distributed()
    actor = _llama(ds, config, reference, rank)
    ref = _llama(ds, eval_config, reference, rank)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=2e-3)
    actor_engine, *_ = ds.initialize(model=actor, optimizer=optimizer, config=config)
    ref_engine, ref_optimizer, *_ = ds.initialize(model=ref, config=eval_config)
    ref_engine.eval()
    generator = torch.Generator().manual_seed(11 + rank)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, 64, (2, 10), generator=generator)
        advantages = torch.randn(2, 1, generator=generator)
        with torch.no_grad():
            ref_logps = _token_logps(ref_engine(input_ids=tokens).logits, tokens)
        logps = _token_logps(actor_engine(input_ids=tokens).logits, tokens)
        kl = (logps - ref_logps) ** 2
        loss = (-(advantages * logps) + 0.1 * kl).mean()
        actor_engine.backward(loss)
        actor_engine.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "ref_optimizer": ref_optimizer is None,
        "weights": _full_weights(ds, actor_engine.module, rank),
    }


def resumed(writer: Any, reader: Any, config: dict, folder: str, rank: int) -> dict[str, Any]:
    """A run saved halfway by `writer` (DeepSpeed or ours) and continued by a fresh engine of `reader` that loads
    that checkpoint: AdamW with weight decay, a warmup LambdaLR, `client_state`. Returns the continuation."""
    writer.init_distributed()
    generator = torch.Generator().manual_seed(21 + rank)
    accumulation = config["gradient_accumulation_steps"]
    batches = [(torch.randn(4, 7, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(8)]

    def engine_of(ds: Any) -> Any:
        torch.manual_seed(0)
        model = make_model()
        optimizer = torch.optim.AdamW(param_groups(model, lr=0.02, decay=0.1), lr=0.02)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return ds.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)[0]

    def train(engine: Any, part: list) -> list[float]:
        losses = []
        for x, y in part:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    half = 2 * accumulation
    first = engine_of(writer)
    train(first, batches[:half])
    first.save_checkpoint(folder, client_state={"epoch": 1})
    second = engine_of(reader)
    _, client_state = second.load_checkpoint(folder)
    return {
        "losses": train(second, batches[half:]),
        "lr": second.get_lr(),
        "steps": second.global_steps,
        "client_state": {k: v for k, v in (client_state or {}).items() if k == "epoch"},
        "weights": _full_weights(reader, second.module, rank),
    }
