"""Process-group facts, passed explicitly to everything that communicates (no module globals)."""

from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


DEFAULT_TIMEOUT_SECONDS = 1800
TIMEOUT_ENV = "ACCELERATE_ZERO_PG_TIMEOUT"


@dataclass(frozen=True, eq=False)
class DataParallelGroup:
    """The data-parallel process group the engine shards over."""

    group: dist.ProcessGroup | None
    """None means torch's default group."""
    rank: int
    world_size: int

    @functools.cached_property
    def backend(self) -> str:
        return dist.get_backend(self.group)


def has_accelerator() -> bool:
    """True when torch sees an accelerator (CUDA or another backend torch.accelerator knows)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def default_device() -> torch.device:
    """The local accelerator when there is one (`LOCAL_RANK` picks which), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def process_group_timeout() -> datetime.timedelta:
    """The timeout for the process group, from `ACCELERATE_ZERO_PG_TIMEOUT` (seconds) or 30 minutes.

    A collective that waits longer fails instead of hanging: a rank that died makes the others raise.
    """
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_SECONDS))
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. 600") from None
    return datetime.timedelta(seconds=seconds)


def init_data_parallel_group(device: torch.device, group: dist.ProcessGroup | None = None) -> DataParallelGroup:
    """Returns the data-parallel group, creating torch's default group first if nobody has.

    Under a launcher (`torchrun`, `accelerate-zero launch`) the rendezvous comes from the environment; a plain
    `python script.py` gets a one-process group, so the same script runs alone and distributed.
    """
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = process_group_timeout()
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DataParallelGroup(group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group))
