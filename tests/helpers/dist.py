"""Spawn N gloo ranks on this machine and collect what each returns.

Starting a rank costs seconds (importing torch), so a test runs many checks inside one spawned group and
returns their results; the assertions happen in the pytest process.
"""

from __future__ import annotations

import faulthandler
import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


PG_TIMEOUT_SECONDS = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        ACCELERATE_ZERO_PG_TIMEOUT=str(PG_TIMEOUT_SECONDS),
    )
    torch.set_num_threads(1)
    faulthandler.enable()  # a segfault in a rank prints its Python stack
    try:
        # Serialized, not shared: a tensor put on the queue as-is lives in this process's shared memory.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def plain_torchrun_environment() -> None:
    """Drops accelerate's variables (ACCELERATE_*, except the process-group timeout) from this rank's environment, so
    the code under test sees what plain `torchrun` gives it."""
    for name in [n for n in os.environ if n.startswith("ACCELERATE_") and n != "ACCELERATE_ZERO_PG_TIMEOUT"]:
        del os.environ[name]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; returns the results by rank.

    `fn` must be importable (a module-level function). The process group is created by the code under test
    (from RANK/WORLD_SIZE/MASTER_* in the environment) with a timeout, so a rank that fails makes the others
    fail instead of hanging.

    Raises:
        AssertionError: with every failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    context = mp.start_processes(
        _rank_main, args=(world_size, port, fn, args, queue), nprocs=world_size, start_method="spawn", join=False
    )
    received: list[tuple[int, str, Any]] = []
    try:
        # Read while the ranks run: a result larger than the pipe buffer blocks its rank until it is read.
        while not context.join(timeout=0.2):
            received += _drain(queue)
    except Exception as error:
        received += _drain(queue)
        details = "\n".join(f"rank {r}:\n{tb}" for r, status, tb in received if status == "error")
        raise AssertionError(f"distributed run failed: {error}\n{details}") from None
    received += _drain(queue)
    results = {
        rank: torch.load(io.BytesIO(value), weights_only=True) for rank, status, value in received if status == "ok"
    }
    return [results[rank] for rank in range(world_size)]


def _drain(queue: Any) -> list[tuple[int, str, Any]]:
    items = []
    while not queue.empty():
        items.append(queue.get())
    return items
