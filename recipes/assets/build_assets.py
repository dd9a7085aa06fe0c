"""Builds the recipes' embedded default: a tokenizer, the "letters" chat datasets and a tiny random-init Llama.

Usage:
    python recipes/assets/build_assets.py                  # rewrites recipes/assets/{tokenizer,tiny-llama,data}
    python recipes/assets/build_assets.py --out /tmp/assets --seed 1

Everything is made here, offline and deterministically from `--seed`: nothing is downloaded, and running the script
again writes the same files. The recipes use these assets when no model, tokenizer or dataset is named.

* `data/letters_{train,eval}.jsonl`: chat examples of two letter puzzles with a checkable answer, e.g.
  user "reverse: k d a f" -> assistant "f a d k", and user "sort: k d a f" -> assistant "a d f k" (3 to 7 letters
  from a-z, separated by spaces so that each letter is one token). Each line holds `messages` (user, assistant),
  `task` and `answer`. No eval prompt appears in the train split.
* `tiny-llama/`: the tokenizer and a `LlamaForCausalLM` (random init, fp32 safetensors, ~1M parameters). The
  untrained model answers nothing correctly; `recipes/sft.py` teaches it in a few minutes on a CPU.
* The tokenizer is a byte-level BPE trained with the `tokenizers` library on the train split, saved as a
  `PreTrainedTokenizerFast` with pad/bos/eos tokens and a chat template whose assistant turns sit in a
  `{% generation %}` block, so `apply_chat_template(..., return_assistant_tokens_mask=True)` marks the tokens the
  loss is taken on.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


ASSETS = Path(__file__).resolve().parent
TASKS = ("reverse", "sort")
MIN_LETTERS, MAX_LETTERS = 3, 7
SPECIAL = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|end|>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# The assistant's answer and its end-of-turn token are the generation block: the tokens SFT learns from.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def solve(task: str, letters: list[str]) -> str:
    """The reference answer of a puzzle: what the reward and the exact-match evaluation compare against."""
    if task == "reverse":
        return " ".join(reversed(letters))
    if task == "sort":
        return " ".join(sorted(letters))
    raise ValueError(f"unknown task {task!r}: expected one of {TASKS}")


def make_example(rng: random.Random) -> dict:
    task = rng.choice(TASKS)
    letters = [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_LETTERS, MAX_LETTERS))]
    answer = solve(task, letters)
    prompt = f"{task}: {' '.join(letters)}"
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "task": task, "answer": answer}


def make_splits(seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train/eval splits: eval prompts are drawn first and never reused for training."""
    rng = random.Random(seed)
    eval_rows: dict[str, dict] = {}
    while len(eval_rows) < n_eval:
        row = make_example(rng)
        eval_rows.setdefault(row["messages"][0]["content"], row)
    train: list[dict] = []
    seen = set(eval_rows)
    while len(train) < n_train:
        row = make_example(rng)
        prompt = row["messages"][0]["content"]
        if prompt not in seen:
            seen.add(prompt)
            train.append(row)
    return train, list(eval_rows.values())


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def build_tokenizer(rows: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: any text encodes; each segment between special tokens gets a leading space, so a letter
    is the same token (" k") at the start of a turn and inside it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL["pad"], SPECIAL["bos"], SPECIAL["eos"], *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [message["content"] for row in rows for message in row["messages"]]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=SPECIAL["pad"],
        bos_token=SPECIAL["bos"],
        eos_token=SPECIAL["eos"],
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=128,
        padding_side="left",  # generation pads prompts on the left; the SFT collator pads labels itself
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=16,
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ASSETS, help="folder to write tokenizer/, tiny-llama/, data/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_train", type=int, default=8000)
    parser.add_argument("--n_eval", type=int, default=200)
    parser.add_argument("--vocab_size", type=int, default=320)
    args = parser.parse_args()

    train, held_out = make_splits(args.seed, args.n_train, args.n_eval)
    write_jsonl(args.out / "data" / "letters_train.jsonl", train)
    write_jsonl(args.out / "data" / "letters_eval.jsonl", held_out)
    tokenizer = build_tokenizer(train, args.vocab_size)
    model = build_model(tokenizer, args.seed)
    model_dir = args.out / "tiny-llama"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {len(train)} train / {len(held_out)} eval examples and a {n_params:,}-parameter model to {args.out}")


if __name__ == "__main__":
    main()
