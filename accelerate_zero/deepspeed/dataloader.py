"""DeepSpeedDataLoader: the loader `deepspeed.initialize(training_data=...)` returns, batch for batch DeepSpeed's.

DeepSpeed's loader (runtime/dataloader.py of 0.19.8, without curriculum learning) is a torch `DataLoader` over a
`DistributedSampler` (shuffled, seed 0, one share per data-parallel rank) with `train_micro_batch_size_per_gpu`
samples per batch, `2` worker processes unless told otherwise, and `dataloader_drop_last`; iterating it makes a new
`DataLoader`. Call `loader.data_sampler.set_epoch(epoch)` for a new order each epoch, as with DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler


class DeepSpeedDataLoader:
    """A rank's micro-batches of `dataset` (see the module docstring).

    Args:
        dataset: a map-style or iterable torch dataset.
        batch_size: samples per batch on this rank.
        pin_memory: page-locked batches (for a GPU).
        collate_fn: merges samples into a batch; None: torch's default.
        num_local_io_workers: worker processes; None: 2, as DeepSpeed.
        data_sampler: a sampler; None: a `DistributedSampler` over the data-parallel ranks.
        data_parallel_world_size: the data-parallel ranks.
        data_parallel_rank: this rank among them.
        dataloader_drop_last: drop the last incomplete batch.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        *,
        pin_memory: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_local_io_workers: int | None,
        data_sampler: Any,
        data_parallel_world_size: int,
        data_parallel_rank: int,
        dataloader_drop_last: bool,
    ) -> None:
        if data_sampler is None:
            data_sampler = DistributedSampler(dataset, num_replicas=data_parallel_world_size, rank=data_parallel_rank)
        self.dataset, self.batch_size, self.pin_memory = dataset, batch_size, pin_memory
        self.collate_fn, self.data_sampler = collate_fn, data_sampler
        self.num_local_io_workers = 2 if num_local_io_workers is None else num_local_io_workers
        self.dataloader_drop_last = dataloader_drop_last
        batches = len(data_sampler) / batch_size
        self.len = int(batches) if dataloader_drop_last else math.ceil(batches)
        self.dataloader: DataLoader | None = None
        self.data: Iterator[Any] | None = None

    def __iter__(self) -> DeepSpeedDataLoader:
        self.dataloader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            pin_memory=self.pin_memory,
            sampler=self.data_sampler,
            collate_fn=self.collate_fn,
            num_workers=self.num_local_io_workers,
            drop_last=self.dataloader_drop_last,
        )
        self.data = iter(self.dataloader)
        return self

    def __len__(self) -> int:
        return self.len

    def __next__(self) -> Any:
        if self.data is None:
            iter(self)
        return next(self.data)


class RepeatingLoader:
    """Iterates `loader` for ever, starting it again when it ends (DeepSpeed's `RepeatingLoader`)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
