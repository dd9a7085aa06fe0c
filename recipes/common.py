"""What the recipes share: the YAML + command-line config, the embedded default, data loading, the letters task's
answer check, and the exact-match evaluation that runs on every rank (ZeRO-3 needs all ranks in `generate`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from datasets import Dataset, load_dataset
from transformers import HfArgumentParser


RECIPES = Path(__file__).resolve().parent
ASSETS = RECIPES / "assets"
EMBEDDED_MODEL = str(ASSETS / "tiny-llama")
EMBEDDED_TRAIN = str(ASSETS / "data" / "letters_train.jsonl")
EMBEDDED_EVAL = str(ASSETS / "data" / "letters_eval.jsonl")


# ------------------------------------------------------------------------------------------------------ noise
class _DropMessage(logging.Filter):
    """Drops the log records of one logger whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_known_noise() -> None:
    """Silences messages every recipe run would print on every rank although nothing is wrong, and nothing else.

    * bitsandbytes (imported by peft, which transformers' Trainer imports) logs a warning on CPUs with AVX512-BF16
      that its optional `kernels` package is missing; its plain CPU kernels are used instead.
    * peft's `prepare_model_for_kbit_training` calls transformers' `gradient_checkpointing_enable` and
      `is_gradient_checkpointing`, which transformers 5 deprecates in favour of `activation_checkpointing_*`.
    Runs when this module is imported, which every recipe does before importing transformers' Trainer or peft.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community")
    )
    for old in ("gradient_checkpointing_enable", "is_gradient_checkpointing"):
        warnings.filterwarnings(
            "ignore", message=f"`{old}` is deprecated and will be removed in v6", category=FutureWarning
        )


quiet_known_noise()


# ----------------------------------------------------------------------------------------------------- config
def parse_config(dataclass_types: tuple[type, ...], argv: list[str] | None = None) -> tuple[Any, ...]:
    """Fills `dataclass_types` from `--config FILE` (a flat YAML mapping field -> value), then the command line.

    Every field of every dataclass can be set in the YAML and overridden on the command line (`--field value`,
    which wins); a YAML key that no dataclass has, or an unknown flag, is an error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Every rank parses the same command line: only rank 0 prints usage, help and errors (the others exit with the
    # same code, which the launcher reports in one line).
    if os.environ.get("RANK", "0") != "0":
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return _parse_config(dataclass_types, argv)
    return _parse_config(dataclass_types, argv)


def _parse_config(dataclass_types: tuple[type, ...], argv: list[str]) -> tuple[Any, ...]:
    # argparse's generated usage lists every TrainingArguments field (~130 lines) above a one-line error
    parser = HfArgumentParser(
        dataclass_types, usage="%(prog)s [--config FILE] [--FIELD VALUE ...] (--help lists them)"
    )
    parser.add_argument("--config", type=str, default=None, help="flat YAML file of field: value")
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS  # the namespace then holds only what the command line sets
    given = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config = given.pop("config", None)
    if config is not None:
        values = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(values, dict):
            parser.error(f"{config}: expected a mapping of field: value, got {type(values).__name__}")
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            parser.error(f"{config}: unknown fields {unknown}")
    return tuple(parser.parse_dict({**values, **given}))


# ------------------------------------------------------------------------------------------------------- data
def load_rows(name_or_path: str, split: str = "train", config_name: str | None = None) -> Dataset:
    """A dataset split from a local file (.jsonl/.json/.parquet/.csv), a local dataset folder, or a hub name."""
    suffixes = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    path = Path(name_or_path)
    if path.is_file() and path.suffix in suffixes:
        return load_dataset(suffixes[path.suffix], data_files={split: str(path)}, split=split)
    return load_dataset(name_or_path, config_name, split=split)


def to_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation of a row: a `messages` column, or `prompt` + `completion` (strings or message lists)."""
    if "messages" in row:
        return row["messages"]
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        return [*prompt, *completion]
    raise ValueError(f"a chat row needs `messages` or `prompt` + `completion` columns, got {sorted(row)}")


def prompt_and_answer(row: dict[str, Any]) -> tuple[list[dict[str, str]], str]:
    """The prompt (every turn before the last assistant turn) and the reference answer of a row.

    The answer is the `answer` column if there is one, else the last assistant message."""
    messages = to_messages(row)
    last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
    answer = row.get("answer") or messages[last]["content"]
    return messages[:last], answer.strip()


# -------------------------------------------------------------------------------------------------- the task
def normalize(text: str) -> str:
    return " ".join(text.split())


def is_correct(completion: str, answer: str) -> bool:
    """Exact match after collapsing whitespace."""
    return normalize(completion) == normalize(answer)


def is_well_formed(completion: str, answer: str) -> bool:
    """The answer's shape: as many space-separated items as the reference, each as long as the reference's.

    For the letters task: single letters separated by spaces, one per letter of the puzzle."""
    items, expected = completion.split(), answer.split()
    return len(items) == len(expected) and all(len(a) == len(b) for a, b in zip(items, expected, strict=True))


# -------------------------------------------------------------------------------------------------- evaluation
def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_slice(n: int) -> tuple[list[int], int]:
    """This rank's indices of `n` items, padded (by repeating one) to the same length on every rank so every rank
    calls `generate` the same number of times; and how many of them are real (the rest are not counted)."""
    rank, world_size = world()
    mine = list(range(rank, n, world_size))
    real = len(mine)
    return mine + [mine[-1] if mine else 0] * (-(-n // world_size) - real), real


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module, tokenizer: Any, prompts: list[list[dict[str, str]]], max_new_tokens: int, **sampling: Any
) -> list[str]:
    """Completions of chat `prompts` (one batch, left-padded), decoded without special tokens."""
    text = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    batch = tokenizer(text, return_tensors="pt", padding=True, add_special_tokens=False, padding_side="left")
    device = next(iter(model.parameters())).device
    batch = {k: v.to(device) for k, v in batch.items()}
    out = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **sampling,
    )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def exact_match(
    model: torch.nn.Module, tokenizer: Any, rows: Dataset, batch_size: int = 64, max_new_tokens: int = 16
) -> dict[str, float]:
    """Greedy exact-match accuracy on `rows`, overall and per `task` (if the rows have one), summed over ranks.

    Every rank must call it (each generates its share; under ZeRO-3 the engine keeps all ranks stepping in
    `generate` until every rank is done). Returns the same numbers on every rank."""
    mine, real = rank_slice(len(rows))
    tasks = sorted(set(rows["task"])) if "task" in rows.column_names else []
    # [correct, total] overall then per task; summed across ranks at the end
    tally = torch.zeros(1 + len(tasks), 2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for start in range(0, len(mine), batch_size):
        indices = mine[start : start + batch_size]
        pairs = [prompt_and_answer(rows[i]) for i in indices]
        completions = generate_completions(model, tokenizer, [p for p, _ in pairs], max_new_tokens, do_sample=False)
        for position, (index, (_, answer), completion) in enumerate(zip(indices, pairs, completions, strict=True)):
            if start + position >= real:
                continue  # padding that only keeps this rank in step with the others
            ok = float(is_correct(completion, answer))
            tally[0] += torch.tensor([ok, 1.0], dtype=torch.float64)
            if tasks:
                tally[1 + tasks.index(rows[index]["task"])] += torch.tensor([ok, 1.0], dtype=torch.float64)
    model.train(was_training)
    tally = all_sum(tally, model.device)
    result = {"accuracy": (tally[0, 0] / tally[0, 1].clamp(min=1)).item(), "n": int(tally[0, 1].item())}
    for i, task in enumerate(tasks):
        result[f"accuracy_{task}"] = (tally[1 + i, 0] / tally[1 + i, 1].clamp(min=1)).item()
    return result


def all_sum(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` summed over all ranks (sent from `device`: NCCL needs it on the GPU), back on the CPU."""
    if world()[1] == 1:
        return tensor
    reduced = tensor.to(device)
    dist.all_reduce(reduced)
    return reduced.cpu()


def print_rank0(*args: Any) -> None:
    if world()[0] == 0:
        print(*args, flush=True)


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
