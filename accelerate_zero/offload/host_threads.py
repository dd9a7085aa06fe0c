"""HostThreads: the threads the host side of an offloaded optimizer step runs on.

[Note: threads for host work]
Launchers (torchrun, accelerate launch) set OMP_NUM_THREADS=1 when they start several processes per node, so that
ranks computing on the CPU do not oversubscribe its cores. With a GPU per rank, the rank's host work is the
offloaded optimizer step and the norm of host gradients: on one thread a 7B shard's AdamW takes seconds. So while
that work runs, torch uses the cores that belong to this rank: all of its CPU affinity when a launcher bound it to
fewer cores than the machine has (numactl, `--bind-cores`), else an equal share of the node's cores (affinity /
LOCAL_WORLD_SIZE). `offload_optimizer.cpuadam_cores_perc` (DeepSpeed's key) takes that share of them, at least
one: below 1 it leaves cores to the threads that keep driving the GPU while a host step runs beside them.
`ACCELERATE_ZERO_HOST_THREADS` sets the count instead of both. A setting above it is never lowered, and outside the
step the process's own setting stands (data loading, the training itself). On a CPU device nothing changes: there
the host work is the training, run under the user's setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import TracebackType

import torch


THREADS_ENV = "ACCELERATE_ZERO_HOST_THREADS"


def host_threads_for(device: torch.device, offloaded: bool, share: float | None) -> HostThreads | None:
    """The threads of an offloaded step beside a GPU (`share`: `cpuadam_cores_perc`); None where nothing changes."""
    return HostThreads(threads_for_rank(share=share)) if offloaded and device.type != "cpu" else None


def threads_for_rank(
    environ: Mapping[str, str] = os.environ, affinity: set[int] | None = None, share: float | None = None
) -> int:
    """How many threads this rank's host work should use ([Note: threads for host work]).

    Args:
        environ: the process environment (`ACCELERATE_ZERO_HOST_THREADS`, `LOCAL_WORLD_SIZE`).
        affinity: the cores this process may run on; None: read from the OS.
        share: the part of the rank's cores to use (`offload_optimizer.cpuadam_cores_perc`); None: all.

    Raises:
        ValueError: `ACCELERATE_ZERO_HOST_THREADS` is not a positive integer.
    """
    raw = environ.get(THREADS_ENV)
    if raw is not None:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(
                f"{THREADS_ENV}={raw!r} is not a positive number of threads: set it to e.g. 8, or unset it"
            )
        return threads
    cores = affinity if affinity is not None else _affinity()
    if len(cores) < (os.cpu_count() or len(cores)):  # the launcher bound this rank: its cores are its own
        own = len(cores)
    else:
        own = len(cores) // max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, int(own * share) if share is not None else own)


def _affinity() -> set[int]:
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else set(range(os.cpu_count() or 1))


class HostThreads:
    """A context that raises torch's intra-op threads to `threads` while it is open, then restores them."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._restore: int | None = None

    def __enter__(self) -> HostThreads:
        current = torch.get_num_threads()
        if current < self.threads:
            self._restore = current
            torch.set_num_threads(self.threads)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._restore is not None:
            torch.set_num_threads(self._restore)
            self._restore = None
