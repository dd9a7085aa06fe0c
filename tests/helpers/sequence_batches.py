"""The tiny Llama, its variable-length samples and the recording collator that
tests/distributed/test_sequence_parallel_loops.py trains under sequence parallelism (each rank's batches kept, so the
one-process reference trains on the same)."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.models import tiny_llama_config


VOCAB = 64


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB))


def samples(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    lengths = torch.randint(6, 14, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator)} for n in lengths]


class RecordingCollator:
    """Pads at the end (token 0, label -100, mask 0) and keeps a copy of every batch it made (in this process)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(row["input_ids"]) for row in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row["input_ids"])], mask[i, : len(row["input_ids"])] = row["input_ids"], 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return batch


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import accelerate_zero

    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


class ListCollator:
    """TRL's datasets give lists of token ids: tensors for `RecordingCollator`."""

    def __init__(self, inner: RecordingCollator) -> None:
        self.inner = inner

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.inner([{"input_ids": torch.tensor(row["input_ids"])} for row in rows])
