"""GRPO (group relative policy optimization) with a rule-based reward, in a plain ZeroAccelerator loop.

Usage:
    accelerate-zero launch --config_file accelerate_configs/zero3_demo.yaml recipes/grpo.py --config recipes/configs/grpo_demo.yaml
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml recipes/grpo.py \
        --config recipes/configs/grpo_demo.yaml --model_name_or_path recipes/assets/tiny-llama --max_steps 5

The demo config starts from the SFT demo's output (out/sft-demo). Each step, every rank takes `prompts_per_rank`
prompts and samples `num_generations` completions of each with `generate`; a rule scores each completion
(`correct_reward` for the exact answer, plus `format_reward` for an answer of the right shape that ends the turn);
advantages are the rewards normalized within each prompt's group; the policy then takes `num_iterations` optimizer
steps on the clipped objective minus `beta` times a KL estimate against a frozen reference model. The reference model
is prepared without an optimizer: a frozen inference engine, sharded like the policy at stage 3. Under stage 3 every
rank runs the same number of `generate` and forward calls (the engine keeps all ranks stepping in `generate`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    EMBEDDED_EVAL,
    EMBEDDED_MODEL,
    EMBEDDED_TRAIN,
    all_sum,
    exact_match,
    is_correct,
    is_well_formed,
    load_rows,
    parse_config,
    prompt_and_answer,
    rank_slice,
    world,
)
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from accelerate_zero import ZeroAccelerator


@dataclasses.dataclass
class GRPOConfig:
    model_name_or_path: str = dataclasses.field(default=EMBEDDED_MODEL, metadata={"help": "e.g. the SFT output"})
    dataset_name: str = dataclasses.field(default=EMBEDDED_TRAIN, metadata={"help": "prompts with answers"})
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    eval_dataset_name: str | None = dataclasses.field(default=EMBEDDED_EVAL, metadata={"help": "None: no eval"})
    eval_dataset_split: str = "train"
    eval_samples: int = dataclasses.field(default=200, metadata={"help": "held-out prompts for greedy exact match"})
    probe_prompts: int = dataclasses.field(default=64, metadata={"help": "held-out prompts for the sampled reward"})
    output_dir: str = "out/grpo-demo"
    seed: int = 42
    max_steps: int = 30
    prompts_per_rank: int = dataclasses.field(default=8, metadata={"help": "prompts each rank samples per step"})
    num_generations: int = dataclasses.field(default=8, metadata={"help": "completions per prompt (the group)"})
    max_new_tokens: int = 16
    temperature: float = 1.0
    num_iterations: int = dataclasses.field(default=2, metadata={"help": "optimizer steps per generated batch"})
    learning_rate: float = 2e-4
    epsilon: float = dataclasses.field(default=0.2, metadata={"help": "clip range of the probability ratio"})
    beta: float = dataclasses.field(default=0.04, metadata={"help": "weight of the KL term (0: no reference)"})
    correct_reward: float = 1.0
    partial_reward: float = 0.5
    format_reward: float = 0.25
    logging_steps: int = 1


def reward(completion: str, answer: str, ended: bool, config: GRPOConfig) -> tuple[float, bool, bool]:
    """The rule: `correct_reward` for the exact answer, `partial_reward` times the fraction of the answer's items in
    the right place, and `format_reward` for the right shape; nothing for a completion that does not end its turn."""
    if not ended:
        return 0.0, False, False
    correct, well_formed = is_correct(completion, answer), is_well_formed(completion, answer)
    items, expected = completion.split(), answer.split()
    placed = sum(a == b for a, b in zip(items, expected, strict=False)) / max(len(expected), len(items), 1)
    total = config.correct_reward * correct + config.partial_reward * placed + config.format_reward * well_formed
    return total, correct, well_formed


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - mean) / (std + 1e-4) within each group of `group_size` consecutive completions of one prompt."""
    grouped = rewards.view(-1, group_size)
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + 1e-4)).view(-1)


def completion_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Log-probabilities of the completion tokens under `model` (same positions as `generate` used)."""
    n = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[:, -n - 1 : -1]
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample_group(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict], config: GRPOConfig
) -> tuple[dict[str, torch.Tensor], list[tuple[float, bool, bool]]]:
    """`num_generations` sampled completions of each prompt, their token tensors and their rewards."""
    prompts, answers = zip(*(prompt_and_answer(row) for row in rows), strict=True)
    text = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    text = [t for t in text for _ in range(config.num_generations)]
    enc = tokenizer(text, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    enc = enc.to(model.device)
    model.eval()
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=config.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=config.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.train()
    completion_ids = out[:, enc["input_ids"].shape[1] :]
    is_eos = completion_ids == tokenizer.eos_token_id
    # the completion is every token up to and including its first end-of-turn token
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    positions = torch.arange(completion_ids.shape[1], device=out.device)
    completion_mask = (positions[None, :] <= first_eos[:, None]).long()
    attention_mask = torch.cat([enc["attention_mask"], completion_mask], dim=1)
    decoded = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    ended = is_eos.any(1).tolist()
    scored = [
        reward(completion, answers[i // config.num_generations], ended[i], config)
        for i, completion in enumerate(decoded)
    ]
    batch = {
        "input_ids": out,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask.float(),
    }
    return batch, scored


@torch.no_grad()
def probe_reward(model: torch.nn.Module, tokenizer: Any, rows: Any, config: GRPOConfig) -> float:
    """Mean reward of `num_generations` samples of each of `rows` (held-out prompts), over all ranks.

    Sampled from a fixed seed, outside the training RNG stream, so the number before and after training differs
    only by what the policy learned. Every rank calls `generate` the same number of times."""
    mine, real = rank_slice(len(rows))
    total = torch.zeros(2, dtype=torch.float64)
    with torch.random.fork_rng():
        torch.manual_seed(config.seed + 1000 + world()[0])
        for start in range(0, len(mine), config.prompts_per_rank):
            chunk = mine[start : start + config.prompts_per_rank]
            _, scored = sample_group(model, tokenizer, [rows[i] for i in chunk], config)
            for j, (value, _, _) in enumerate(scored):
                if start + j // config.num_generations < real:
                    total += torch.tensor([value, 1.0], dtype=torch.float64)
    total = all_sum(total, model.device)
    return (total[0] / total[1].clamp(min=1)).item()


def grpo_loss(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], config: GRPOConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss: minus the clipped surrogate, plus beta * KL (k3 estimator), averaged over each completion's tokens,
    then over completions. Returns the loss and the mean KL."""
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    advantages = batch["advantages"].unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.epsilon)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    kl = torch.zeros_like(per_token)
    if config.beta > 0:
        delta = batch["ref_logprobs"] - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + config.beta * kl
    mask = batch["completion_mask"]
    lengths = mask.sum(1).clamp(min=1)
    loss = ((per_token * mask).sum(1) / lengths).mean()
    return loss, ((kl * mask).sum(1) / lengths).mean().detach()


def main() -> None:
    (config,) = parse_config((GRPOConfig,))
    if not Path(config.model_name_or_path).exists() and config.model_name_or_path.startswith(("out/", "./out/")):
        raise SystemExit(f"{config.model_name_or_path} does not exist: run the SFT demo first (recipes/README.md)")
    set_seed(config.seed)
    accelerator = ZeroAccelerator()
    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(config.model_name_or_path, dtype=torch.float32)
    rows = load_rows(config.dataset_name, config.dataset_train_split, config.dataset_config)
    loader = DataLoader(rows, batch_size=config.prompts_per_rank, shuffle=True, collate_fn=list, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ref_model = None
    if config.beta > 0:  # frozen, no optimizer: an inference engine (sharded at stage 3)
        reference = AutoModelForCausalLM.from_pretrained(config.model_name_or_path, dtype=torch.float32)
        ref_model = accelerator.prepare(reference)
    stage = accelerator.zero_config.zero_optimization.stage
    accelerator.print(
        f"GRPO with ZeRO stage {stage} on {accelerator.num_processes} processes: {config.prompts_per_rank} prompts x "
        f"{config.num_generations} completions per rank and step, {config.num_iterations} updates per batch"
    )
    held_out, results = None, {}
    if config.eval_dataset_name:
        held_out = load_rows(config.eval_dataset_name, config.eval_dataset_split)
        held_out = held_out.select(range(min(config.eval_samples, len(held_out))))
        results["before"] = exact_match(model, tokenizer, held_out, batch_size=100)
        probe = held_out.select(range(min(config.probe_prompts, len(held_out))))
        results["before"]["sampled_reward"] = probe_reward(model, tokenizer, probe, config)

    torch.manual_seed(config.seed + accelerator.process_index)  # each rank samples differently, reproducibly
    results["rewards"] = train(accelerator, model, ref_model, optimizer, loader, tokenizer, config)

    state_dict = accelerator.get_state_dict(model)  # every rank takes part: stage 3 gathers unit by unit to rank 0
    if accelerator.is_main_process:  # the other ranks hold no full state dict (their parameters are shards)
        accelerator.unwrap_model(model).save_pretrained(config.output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(config.output_dir)
    accelerator.print(f"saved the model and tokenizer to {config.output_dir}")
    if held_out is not None:
        before = results["before"]
        after = results["after"] = exact_match(model, tokenizer, held_out, batch_size=100)
        after["sampled_reward"] = probe_reward(model, tokenizer, probe, config)
        accelerator.print(
            f"held-out reward ({len(probe)} prompts x {config.num_generations} samples at temperature "
            f"{config.temperature}): before {before['sampled_reward']:.3f}   after {after['sampled_reward']:.3f}"
        )
        accelerator.print(f"held-out exact match ({after['n']} prompts, greedy):")
        for key in (k for k in after if k.startswith("accuracy")):
            accelerator.print(f"  {key:<20} before {before[key]:6.1%}   after {after[key]:6.1%}")
    if accelerator.is_main_process:
        Path(config.output_dir, "grpo_results.json").write_text(json.dumps(results, indent=1))
    accelerator.end_training()


def train(
    accelerator: ZeroAccelerator,
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    optimizer: Any,
    loader: DataLoader,
    tokenizer: Any,
    config: GRPOConfig,
) -> list[float]:
    """The GRPO loop; returns the mean reward (over all ranks) of each step."""
    history: list[float] = []
    batches = iter(loader)
    start = time.perf_counter()
    for step in range(1, config.max_steps + 1):
        try:
            rows = next(batches)
        except StopIteration:
            batches = iter(loader)
            rows = next(batches)
        batch, scored = sample_group(model, tokenizer, rows, config)
        rewards = torch.tensor([r for r, _, _ in scored], device=accelerator.device)
        batch["advantages"] = group_advantages(rewards, config.num_generations)
        with torch.no_grad():
            batch["old_logprobs"] = completion_logprobs(model, batch, config.temperature)
            if ref_model is not None:
                batch["ref_logprobs"] = completion_logprobs(ref_model, batch, config.temperature)
        for _ in range(config.num_iterations):
            logprobs = completion_logprobs(model, batch, config.temperature)
            loss, kl = grpo_loss(logprobs, batch, config)
            accelerator.backward(loss)  # steps the optimizer (accumulation 1)
            optimizer.step()
            optimizer.zero_grad()
        stats = torch.tensor(
            [
                rewards.mean().item(),
                sum(c for _, c, _ in scored) / len(scored),
                sum(f for _, _, f in scored) / len(scored),
                kl.item(),
                loss.item(),
                batch["completion_mask"].sum(1).mean().item(),
            ],
            device=accelerator.device,
        )
        stats = accelerator.reduce(stats, reduction="mean")
        history.append(stats[0].item())
        if step % config.logging_steps == 0 or step == config.max_steps:
            accelerator.print(
                f"step {step:3d}/{config.max_steps}  reward {stats[0]:.3f}  correct {stats[1]:.3f}  "
                f"format {stats[2]:.3f}  kl {stats[3]:.4f}  loss {stats[4]:+.4f}  "
                f"completion_len {stats[5]:.1f}  {time.perf_counter() - start:.0f}s"
            )
        if not math.isfinite(stats[4].item()):
            raise FloatingPointError(f"step {step}: the loss is {stats[4].item()}")
    return history


if __name__ == "__main__":
    main()
