"""What the processes run for tests/integration/test_trl_numerics.py: TRL's own SFT/DPO/GRPO trainers in one process
(`reference`) and ours on 2 ranks at stages 2 and 3 (`zero_runs`), on the same distinct examples, so that at every
micro-step the two ranks' data shards together are the reference's batch. Results are plain values and tensors.

Every run: 2 optimizer steps of 2 accumulated micro-batches, bf16 left at TRL's default (True: the reference
autocasts over fp32 weights, the engine computes with bf16 weights and steps fp32 masters), clipping at TRL's 1.0,
and plain SGD instead of TRL's AdamW: Adam's first step is `lr * sign(g)`, so a gradient error that keeps most signs
(a rank's data counted twice, a micro-step dropped) would leave most weights where they should be, while under SGD
the weight change is the gradient itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.dist import plain_torchrun_environment


ASSETS = Path(__file__).resolve().parents[2] / "recipes" / "assets"
LETTERS = ASSETS / "data" / "letters_train.jsonl"
STEPS, ACCUMULATION, PER_RANK, WORLD = 2, 2, 2, 2
ROWS = STEPS * ACCUMULATION * PER_RANK * WORLD
"""SFT and DPO examples one run consumes: every one distinct, each used once."""
GENERATIONS = 2
PROMPTS = ROWS // GENERATIONS
"""GRPO prompts one run consumes, each completed GENERATIONS times."""
TRAINERS = ("sft", "dpo", "grpo")
_CLASSES = {
    "sft": ("SFTConfig", "SFTTrainer"),
    "dpo": ("DPOConfig", "DPOTrainer"),
    "grpo": ("GRPOConfig", "GRPOTrainer"),
}


# ---- model and data -------------------------------------------------------------------------------------------------


def build_model(folder: Path) -> str:
    """A ~17k-parameter Llama with uneven shapes (hidden 24, heads 6 wide, vocabulary 297: bf16 on this CPU is ~7x
    slower than fp32) and the assets' tokenizer, saved: GRPO builds its reference model from the policy's path."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def letters(count: int) -> list[dict[str, Any]]:
    """The first `count` puzzles of the recipes' training set with distinct prompts."""
    rows: dict[str, dict[str, Any]] = {}
    with open(LETTERS) as file:
        for line in file:
            row = json.loads(line)
            rows.setdefault(row["messages"][0]["content"], row)
            if len(rows) == count:
                return list(rows.values())
    raise ValueError(f"{LETTERS} holds fewer than {count} distinct prompts")


def solve(prompt: str) -> str:
    task, _, text = prompt.partition(": ")
    return " ".join(reversed(text.split()) if task == "reverse" else sorted(text.split()))


def mistaken(answer: str) -> str:
    """A wrong answer sharing few tokens with the right one. DPO learns from the difference of the two answers'
    gradients: answers one letter apart leave a small difference of large terms, mostly bf16 rounding."""
    return " ".join(chr(ord("a") + (ord(c) - ord("a") + 13) % 26) for c in reversed(answer.split()))


def dataset(trainer: str) -> Any:
    from datasets import Dataset

    if trainer == "sft":  # chats, the loss on the assistant's tokens (the template's generation block)
        return Dataset.from_list([{"messages": row["messages"]} for row in letters(ROWS)])
    if trainer == "dpo":
        return Dataset.from_list(
            [
                {"prompt": r["messages"][0]["content"], "chosen": r["answer"], "rejected": mistaken(r["answer"])}
                for r in letters(ROWS)
            ]
        )
    return Dataset.from_list(
        [{"prompt": r["messages"][0]["content"], "answer": r["answer"]} for r in letters(PROMPTS)]
    )


# ---- GRPO with fixed completions ------------------------------------------------------------------------------------


def fixed_completion(prompt: str, copy: int) -> str:
    """The `copy`-th sample of `prompt`: the right answer for copy 0, a shorter wrong one (last letter dropped) else.

    One process samples the whole batch from one generator and two ranks sample halves from two, so sampled
    completions cannot agree; with these, both runs score, normalise and learn from the same completions.
    """
    answer = solve(prompt)
    return answer if copy == 0 else answer.rsplit(" ", 1)[0]


def reward(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1 for the right answer, plus a length term: the two copies of a prompt always score differently."""
    return [float(c.strip() == a) + 0.05 * len(c) for c, a in zip(completions, answer, strict=True)]


def with_fixed_completions(base: type) -> type:
    """`base` (a GRPOTrainer) whose generation runs as usual (at stage 3 inside the policy's gather), after which its
    samples are replaced by `fixed_completion`s. A prompt's copies are told apart by their order: TRL's sampler puts
    them next to each other and, as PER_RANK * ACCUMULATION is a multiple of GENERATIONS, on one rank."""

    class FixedCompletions(base):
        def _generate_single_turn(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            super()._generate_single_turn(prompt_ids, *args, **kwargs)
            tokenizer, seen, completions = self.processing_class, {}, []
            for ids in prompt_ids:
                copy = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
                text = fixed_completion(tokenizer.decode(ids, skip_special_tokens=True), copy)
                completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
            return completions, None

    return FixedCompletions


# ---- one training run -----------------------------------------------------------------------------------------------


def arguments(trainer: str, output_dir: str, stage: int | None) -> Any:
    """TRL's config (`stage` None, the whole batch in one process) or ours at `stage` (a rank's share of it)."""
    import trl

    from accelerate_zero.integrations import trl as zero_trl

    values: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=PER_RANK if stage is not None else PER_RANK * WORLD,
        gradient_accumulation_steps=ACCUMULATION,
        optim="sgd",
        learning_rate=0.5,  # moves the weights by ~0.1: far above bf16's rounding of the update
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        ddp_timeout=120,
        seed=0,
    )
    if trainer == "sft":
        values.update(assistant_only_loss=True, train_sampling_strategy="sequential")
    elif trainer == "dpo":
        values.update(train_sampling_strategy="sequential")
    else:  # beta > 0: a reference model; RepeatSampler shuffles prompts with `seed`, the same order in both runs
        values.update(num_generations=GENERATIONS, max_completion_length=4, beta=0.1)
    config = _CLASSES[trainer][0]
    if stage is None:
        return getattr(trl, config)(**values)
    zero = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return getattr(zero_trl, config)(zero_config=zero, **values)


def train(trainer: str, model_dir: str, output_dir: str, stage: int | None) -> tuple[dict[str, Any], Any]:
    """One run: its logged metrics per step and trained fp32 weights (on rank 0), and the trainer."""
    import trl
    from transformers import AutoTokenizer

    from accelerate_zero.integrations import trl as zero_trl

    cls = getattr(trl if stage is None else zero_trl, _CLASSES[trainer][1])
    kwargs: dict[str, Any] = {}
    if trainer == "grpo":
        cls, kwargs = with_fixed_completions(cls), {"reward_funcs": reward}
    args = arguments(trainer, output_dir, stage)
    run = cls(
        model=load(model_dir),
        args=args,
        train_dataset=dataset(trainer),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        **kwargs,
    )
    run.train()
    out = {
        "bf16": args.bf16,
        "steps": run.state.global_step,
        "logs": [log for log in run.state.log_history if "loss" in log],
        "weights": parameters(run.model) if stage is None else fp32_masters(run, output_dir),
    }
    if stage is not None:
        out["stage"] = run.zero_engine.stage
    return out, run


def load(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def fp32_masters(run: Any, output_dir: str) -> dict[str, torch.Tensor]:
    """The engine's fp32 master weights, full, on rank 0 ({} elsewhere), through a checkpoint and its consolidation:
    the bf16 weights the model computes with are these rounded, which would add bf16's rounding to the comparison."""
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict

    folder = Path(output_dir) / "masters"
    run.zero_engine.save_checkpoint(str(folder), tag="final", exclude_frozen_parameters=False)
    if dist.get_rank() != 0:
        return {}
    run.model.config.save_pretrained(folder)  # stage 3 parameter shapes come from the config
    state = consolidated_state_dict(folder, dtype=torch.float32)
    return {name: state[name] for name, _ in run.model.named_parameters() if name in state}


# ---- ZeroDistributedBackend.gather_params ---------------------------------------------------------------------------


def gather_params(run: Any) -> dict[str, Any]:
    """What TRL's `self._dist.gather_params(params)` gives inside and after the context, for the trained policy (all
    its parameters, then one) and the frozen reference model: shapes and values (values on every rank)."""
    backend = run._dist
    policy = dict(run.model.named_parameters())
    ref = dict(run.ref_model.named_parameters())
    one = "model.layers.1.mlp.down_proj.weight"
    out: dict[str, Any] = {"backend": type(backend).__name__, "is_zero3": backend.is_zero3}
    out["shapes_before"] = {n: tuple(p.shape) for n, p in policy.items()}
    with backend.gather_params(list(policy.values())):
        out["policy"] = {n: p.detach().clone() for n, p in policy.items()}
    out["shapes_after"] = {n: tuple(p.shape) for n, p in policy.items()}
    with backend.gather_params([policy[one]]):
        out["one"] = {one: policy[one].detach().clone()}
    with backend.gather_params(list(ref.values())):
        out["ref"] = {n: p.detach().clone() for n, p in ref.items()}
    return out


# ---- bodies ---------------------------------------------------------------------------------------------------------


def reference(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """One process: builds the model, then trains it with TRL's own trainers on the whole batch."""
    plain_torchrun_environment()
    root = Path(folder)
    model_dir = build_model(root / "model")
    out: dict[str, Any] = {"initial": parameters(load(model_dir))}
    for trainer in TRAINERS:
        out[trainer], _ = train(trainer, model_dir, str(root / f"reference-{trainer}"), stage=None)
    return out


def zero_runs(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Two ranks: our trainers at stages 2 and 3 on the model `reference` built and the same data; after GRPO (the
    TRL trainer with a distributed backend), what its `gather_params` gives."""
    plain_torchrun_environment()
    root = Path(folder)
    model_dir = str(root / "model")
    out: dict[str, Any] = {}
    for stage in (2, 3):
        for trainer in TRAINERS:
            out[f"{trainer}-{stage}"], run = train(trainer, model_dir, str(root / f"zero-{trainer}-{stage}"), stage)
        out[f"gather-{stage}"] = gather_params(run)
    return out
