"""What a pooled rank process runs: the loop that takes test bodies from its queue and the reset between them.

tests/helpers/dist.py starts these processes and hands them bodies; the note there, "what a pooled rank resets
between test bodies", says what a body can rely on. This module never imports dist.py (a rank needs none of the
pool's pytest side).
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.heap import freeze_new_imports


PG_TIMEOUT_SECONDS = 60


def _reset_singletons() -> None:
    """Clears the process-wide state libraries keep between bodies (see the note at the top)."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()
    hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if hf_deepspeed is not None:
        hf_deepspeed.unset_hf_deepspeed_config()
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "ACCELERATE_ZERO_PG_TIMEOUT": str(PG_TIMEOUT_SECONDS),
        # As torchrun and accelerate launch set it for several processes per machine: accelerate's PartialState and
        # transformers' TrainingArguments otherwise give torch a thread per core in every rank, and the ranks' OpenMP
        # threads spin against each other (a 2-rank SFT step ran 12x slower in CPU time on 2 cores).
        "OMP_NUM_THREADS": "1",
    }


def _run_body(rank: int, world_size: int, task: tuple, baseline: dict) -> bytes:
    _, port, fn, args, parent_environ, parent_cwd = task
    # As a freshly spawned rank would: pytest's environment and folder at the time of the call, plus the rank's.
    os.environ.clear()
    os.environ.update(parent_environ)
    os.environ.update(_rank_environment(rank, world_size, port))
    os.chdir(parent_cwd)
    sys.path[:] = baseline["path"]
    torch.manual_seed(baseline["seed"])
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            # Serialized, not shared: a tensor put on the queue as-is lives in this process's shared memory.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            _raise_if_leaked(fn)
            return buffer.getvalue()
    finally:
        _reset_singletons()


def _raise_if_leaked(fn: Callable[..., Any]) -> None:
    """A body that returns with torch's process-wide modes still set (a TorchFunctionMode on the stack, dynamo's
    stance other than "default") fails by name: every later body on the pooled rank would run under them (a compiled
    model silently eager, every torch call intercepted), and a user's process would too."""
    from torch.overrides import _get_current_function_mode_stack

    leaked = [type(mode).__qualname__ for mode in _get_current_function_mode_stack()]
    if "torch._dynamo" in sys.modules:
        from torch._dynamo import eval_frame

        if eval_frame._stance.stance != "default":
            leaked.append(f"dynamo stance {eval_frame._stance.stance!r}")
            torch.compiler.set_stance("default")
        from torch._dynamo import config as dynamo_config

        for name, entry in dynamo_config._config.items():
            if dynamo_config._is_default(name):
                continue  # reading a deprecated option warns: read only those a body set
            value = getattr(dynamo_config, name)
            if value != entry.default:
                leaked.append(f"torch._dynamo.config.{name}={value!r}")
                setattr(dynamo_config, name, entry.default)
    if leaked:
        raise AssertionError(f"{fn.__module__}.{fn.__qualname__} returned with process-wide state left set: {leaked}")


def rank_loop(rank: int, world_size: int, tasks: Any, results: Any, stack_file: str) -> None:
    os.environ.update(_rank_environment(rank, world_size, port=0))
    torch.set_num_threads(1)
    stacks = open(stack_file, "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.enable(file=stacks)  # a segfault in a rank writes its Python stack there
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the parent asks on a hang
    baseline = {"path": list(sys.path), "seed": torch.initial_seed()}
    parent = os.getppid()
    freeze_new_imports()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:  # stop when pytest is gone
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        call_id = task[0]
        try:
            results.put((call_id, rank, "ok", _run_body(rank, world_size, task, baseline)))
        except BaseException:
            results.put((call_id, rank, "error", traceback.format_exc()))
        freeze_new_imports()
