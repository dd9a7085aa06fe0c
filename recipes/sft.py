"""Supervised fine-tuning of a causal LM on chat data, trained with ZeRO through the Trainer integration.

Usage:
    accelerate-zero launch --config_file accelerate_configs/zero3_demo.yaml recipes/sft.py --config recipes/configs/sft_demo.yaml
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml recipes/sft.py \
        --config recipes/configs/sft_demo.yaml --max_steps 50 --packing true --output_dir out/sft-packed

Every field of the YAML (the script arguments below and every `TrainingArguments` field) can be overridden on the
command line. Without a model or dataset named, the recipe trains the embedded tiny Llama on the embedded "letters"
puzzles (recipes/assets, made by recipes/assets/build_assets.py): nothing is downloaded. The loss is taken on the
assistant tokens only (the chat template's `{% generation %}` block, else everything after the prompt). The run
ends by saving the model (`from_pretrained` loads it) and by evaluating greedy exact-match accuracy on held-out
prompts, before and after training.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import (
    EMBEDDED_EVAL,
    EMBEDDED_MODEL,
    EMBEDDED_TRAIN,
    exact_match,
    load_rows,
    parse_config,
    print_rank0,
    rss_bytes,
    to_messages,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed

# transformers' Trainer and TrainingArguments (plus `zero_config`), training with the ZeRO engine
from accelerate_zero import Trainer, TrainingArguments


@dataclasses.dataclass
class SFTScriptArguments:
    model_name_or_path: str = dataclasses.field(default=EMBEDDED_MODEL, metadata={"help": "hub name or folder"})
    tokenizer_name_or_path: str | None = dataclasses.field(default=None, metadata={"help": "None: the model's"})
    chat_template: str | None = dataclasses.field(default=None, metadata={"help": "Jinja text or file to use"})
    dataset_name: str = dataclasses.field(default=EMBEDDED_TRAIN, metadata={"help": "hub name, folder or file"})
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    eval_dataset_name: str | None = dataclasses.field(
        default=EMBEDDED_EVAL, metadata={"help": "held-out chats for the exact-match evaluation; None skips it"}
    )
    eval_dataset_split: str = "train"
    eval_samples: int = dataclasses.field(default=200, metadata={"help": "held-out prompts evaluated (0: all)"})
    eval_batch_size: int = 64
    eval_max_new_tokens: int = 16
    max_length: int = dataclasses.field(default=128, metadata={"help": "tokens per example (or per packed row)"})
    packing: bool = dataclasses.field(default=False, metadata={"help": "pack examples into rows of max_length"})


def tokenize_chats(batch: dict[str, list], tokenizer: Any, max_length: int) -> dict[str, list[list[int]]]:
    """input_ids and labels of a batch of conversations; labels are -100 except on the assistant's tokens."""
    chats = [to_messages(dict(zip(batch, values, strict=True))) for values in zip(*batch.values(), strict=True)]
    if "{% generation %}" in (tokenizer.chat_template or ""):
        encoded = tokenizer.apply_chat_template(
            chats, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        all_ids, masks = encoded["input_ids"], encoded["assistant_masks"]
    else:  # a template without a generation block: train on what follows the prompt (the last assistant turn)
        all_ids = tokenizer.apply_chat_template(chats, tokenize=True, return_dict=True)["input_ids"]
        prompts = tokenizer.apply_chat_template(
            [chat[:-1] for chat in chats], tokenize=True, return_dict=True, add_generation_prompt=True
        )["input_ids"]
        masks = [[0] * len(p) + [1] * (len(ids) - len(p)) for ids, p in zip(all_ids, prompts, strict=True)]
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for ids, mask in zip(all_ids, masks, strict=True):
        ids, mask = ids[:max_length], mask[:max_length]
        rows["input_ids"].append(ids)
        rows["labels"].append([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    return rows


def pack(batch: dict[str, list], max_length: int) -> dict[str, list]:
    """Greedily packs whole examples into rows of at most max_length tokens; position_ids restart at each
    example, which (with no attention_mask) makes transformers mask attention between the packed examples."""
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    current: dict[str, list] = {key: [] for key in rows}
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        if current["input_ids"] and len(current["input_ids"]) + len(ids) > max_length:
            for key in rows:
                rows[key].append(current[key])
            current = {key: [] for key in rows}
        current["input_ids"] += ids
        current["labels"] += labels
        current["position_ids"] += list(range(len(ids)))
    if current["input_ids"]:
        for key in rows:
            rows[key].append(current[key])
    return rows


class Collator:
    """Right-pads a batch: pad tokens, -100 labels; an attention_mask, or (packed rows) position_ids instead."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        fill = {"input_ids": self.pad_token_id, "labels": -100}
        batch = {
            key: torch.tensor([f[key] + [value] * (length - len(f[key])) for f in features])
            for key, value in fill.items()
        }
        if "position_ids" in features[0]:
            batch["position_ids"] = torch.tensor(
                [f["position_ids"] + list(range(length - len(f["position_ids"]))) for f in features]
            )
        else:
            lengths = torch.tensor([len(f["input_ids"]) for f in features])
            batch["attention_mask"] = (torch.arange(length)[None, :] < lengths[:, None]).long()
        return batch


def all_ranks(value: Any) -> list[Any]:
    """`value` from every rank, in rank order (called on every rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class ThroughputMemoryCallback(TrainerCallback):
    """Prints the parameters each rank holds when training starts; adds tokens/s since the previous log and each
    rank's memory (MiB) to every training log.

    The memory is what the ZeRO engines hold on that rank (`engine.memory_breakdown()["total"]`) when the trainer
    has engines, else the process's resident memory. Logs happen on every rank at the same steps, so the per-rank
    values are all-gathered there."""

    def __init__(self, model_numel: int, model_bytes: int) -> None:
        self.trainer: Any = None
        self.model_numel, self.model_bytes = model_numel, model_bytes
        self._last = (time.perf_counter(), 0)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last = (time.perf_counter(), state.num_input_tokens_seen)
        engines = getattr(getattr(self.trainer, "accelerator", None), "zero_engines", None) or []
        if engines:
            self._print_parameters_held(engines)

    def _print_parameters_held(self, engines: list[Any]) -> None:
        """How many of the model's parameters each rank holds between gathers (stage 3: about 1/W of them)."""
        held_bytes = 0
        for engine in engines:
            breakdown = engine.memory_breakdown()
            held_bytes += breakdown["parameters"] + breakdown.get("host_parameters", 0)
        per_rank = all_ranks(held_bytes)
        bytes_per_element = self.model_bytes / max(self.model_numel, 1)
        stage = engines[0].config.zero_optimization.stage
        print_rank0(f"parameters held by each rank at ZeRO stage {stage} (the model has {self.model_numel:,}):")
        for rank, held in enumerate(per_rank):
            share = held / max(self.model_bytes, 1)
            print_rank0(
                f"  rank {rank}: {round(held / bytes_per_element):>12,}  ({share:.1%}; 1/W = {1 / len(per_rank):.1%})"
            )

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs:
            return
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        logs["tokens_per_s"] = round((tokens - self._last[1]) / max(now - self._last[0], 1e-9), 1)
        self._last = (now, tokens)
        engines = getattr(getattr(self.trainer, "accelerator", None), "zero_engines", None) or []
        held = sum(engine.memory_breakdown()["total"] for engine in engines) if engines else rss_bytes()
        kind = "zero" if engines else "rss"
        for rank, value in enumerate(all_ranks(held)):
            logs[f"mem_{kind}_rank{rank}_MiB"] = round(value / 2**20, 2)


def load_tokenizer(script_args: SFTScriptArguments, model_path: str) -> Any:
    """The tokenizer (the model's unless named), with the chosen chat template and a pad token."""
    tokenizer = AutoTokenizer.from_pretrained(script_args.tokenizer_name_or_path or model_path)
    if script_args.chat_template:
        template = Path(script_args.chat_template)
        tokenizer.chat_template = template.read_text() if template.is_file() else script_args.chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_chat_data(script_args: SFTScriptArguments, training_args: Any, tokenizer: Any) -> tuple[Any, Any]:
    """The tokenized (optionally packed) training set, and the held-out rows (None without an eval dataset)."""
    train = load_rows(script_args.dataset_name, script_args.dataset_train_split, script_args.dataset_config)
    with training_args.main_process_first(desc="tokenizing"):
        train = train.map(
            tokenize_chats,
            batched=True,
            fn_kwargs={"tokenizer": tokenizer, "max_length": script_args.max_length},
            remove_columns=train.column_names,
        )
        if script_args.packing:
            train = train.map(pack, batched=True, fn_kwargs={"max_length": script_args.max_length})
    held_out = None
    if script_args.eval_dataset_name:
        held_out = load_rows(script_args.eval_dataset_name, script_args.eval_dataset_split)
        if script_args.eval_samples:
            held_out = held_out.select(range(min(script_args.eval_samples, len(held_out))))
    return train, held_out


def train_and_evaluate(
    model: torch.nn.Module,
    script_args: SFTScriptArguments,
    training_args: Any,
    tokenizer: Any,
    baseline: Callable[[], torch.nn.Module] | None = None,
) -> None:
    """Trains `model` with the Trainer, saves it, and prints held-out exact match before and after training
    (written to `<output_dir>/eval_results.json`). The untrained score is measured on `baseline()` when given
    (recipes/qlora.py: never run inference on a 4-bit model about to train), else on `model`."""
    train, held_out = load_chat_data(script_args, training_args, tokenizer)

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        return exact_match(model, tokenizer, held_out, script_args.eval_batch_size, script_args.eval_max_new_tokens)

    model_numel = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = evaluate(baseline() if baseline is not None else model) if held_out is not None else None
    callback = ThroughputMemoryCallback(model_numel, model_bytes)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=Collator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    callback.trainer = trainer
    trainer.train()
    trainer.save_model(training_args.output_dir)
    print_rank0(f"saved the model (or adapter) and tokenizer to {training_args.output_dir}")
    if held_out is not None:
        after = evaluate(trainer.model)
        print_rank0(f"held-out exact match ({after['n']} prompts, greedy):")
        for key in (k for k in after if k.startswith("accuracy")):
            print_rank0(f"  {key:<20} untrained {before[key]:6.1%}   trained {after[key]:6.1%}")
        if trainer.is_world_process_zero():
            results = {"untrained": before, "trained": after}
            Path(training_args.output_dir, "eval_results.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    script_args, training_args = parse_config((SFTScriptArguments, TrainingArguments))
    set_seed(training_args.seed)
    tokenizer = load_tokenizer(script_args, script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path, dtype=torch.float32)
    train_and_evaluate(model, script_args, training_args, tokenizer)


if __name__ == "__main__":
    main()
