"""`deepspeed.comm` as scripts call it: torch.distributed's own functions under DeepSpeed's names.

DeepSpeed's `comm` wraps torch.distributed (adding its comms logger's `prof`/`log_name`/`debug` keywords, which
scripts almost never pass). Here every collective *is* torch.distributed's function (nothing is wrapped, so
nothing can drift), plus DeepSpeed's helpers that torch names differently (`allgather_fn` is
`all_gather_into_tensor`, `reduce_scatter_fn` is `reduce_scatter_tensor`, ...) and `init_distributed`.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch.distributed as _dist
from torch.distributed import (  # noqa: F401  (re-exported: deepspeed.comm's names)
    P2POp,
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_backend,
    get_global_rank,
    get_rank,
    get_world_size,
    irecv,
    is_available,
    is_initialized,
    isend,
    monitored_barrier,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)

from accelerate_zero.deepspeed.accelerator import get_accelerator  # noqa: F401  (deepspeed.comm re-exports it)
from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable
from accelerate_zero.engine.groups import init_data_parallel_group, resolve_device


logger = logging.getLogger(__name__)

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
default_pg_timeout = datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", "30")))
allgather_fn = all_gather_into_tensor
reduce_scatter_fn = reduce_scatter_tensor
inference_all_reduce = all_reduce


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Creates torch's default process group if nobody has, as DeepSpeed's `init_distributed` does.

    The rendezvous comes from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK:
    `accelerate-zero deepspeed`, torchrun); a plain `python script.py` gets a one-process group. `dist_backend`,
    `init_method`, `rank`, `world_size` and `timeout` are torch's `init_process_group` arguments (default backend:
    nccl on a GPU, else gloo).

    Raises:
        RuntimeError: `dist_init_required=False` and no group exists.
        DeepSpeedUnavailable: started by mpirun without the launcher's variables (DeepSpeed's MPI discovery).
    """
    if _dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError(
            "Distributed backend is not initialized. Please set dist_init_required to True or initialize before "
            "calling deepspeed.initialize()"
        )
    if auto_mpi_discovery and "RANK" not in os.environ and int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        raise DeepSpeedUnavailable(
            "init_distributed: MPI discovery (mpirun without RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) is not "
            "available; start the script with `accelerate-zero deepspeed` or torchrun"
        )
    explicit = dist_backend is not None or init_method is not None or rank >= 0 or world_size >= 0
    if not explicit and timeout is None and "DEEPSPEED_TIMEOUT" not in os.environ:
        init_data_parallel_group(resolve_device(None))
        return
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or ("nccl" if resolve_device(None).type == "cuda" else "gloo")
    _dist.init_process_group(
        backend=backend,
        init_method=init_method,
        timeout=timeout or default_pg_timeout,
        rank=rank,
        world_size=world_size,
    )


def get_local_rank() -> int:
    """This process's index on its node (LOCAL_RANK, set by every launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group() -> _dist.ProcessGroup:
    return _dist.group.WORLD


def get_all_ranks_from_group(group: _dist.ProcessGroup | None = None) -> list[int]:
    return _dist.get_process_group_ranks(group if group is not None else _dist.group.WORLD)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


def configure(deepspeed_config: object = None, **kwargs: object) -> None:
    """DeepSpeed's comms-logger settings: only the default (no logging) is available here; the config's
    `comms_logger` block turns the engine's logger on."""
    if kwargs.get("enabled") or getattr(getattr(deepspeed_config, "comms_config", None), "comms_logger_enabled", 0):
        raise DeepSpeedUnavailable(f"deepspeed.comm.configure(enabled=True): {_COMMS_LOGGER}")


_INTERNALS = "DeepSpeed's comm internals (its backends, timers, logger) are not available: use torch.distributed"
_COMMS_LOGGER = (
    "DeepSpeed's module-level comms logger is not available: the config's comms_logger block times the engine's "
    "collectives and prints DeepSpeed's summary every steps_per_print; engine.step_log.comms_log.log_summary() "
    "prints it at once"
)
_CLUSTER_ENV = "cluster environment detection is not available; start with `accelerate-zero deepspeed` or torchrun"
_HINTS = {
    "log_summary": _COMMS_LOGGER,
    "reset_log": _COMMS_LOGGER,
    "has_comm_data": _COMMS_LOGGER,
    "get_comm_operation_count": _COMMS_LOGGER,
    "get_logged_comm_ops": _COMMS_LOGGER,
    "timed_op": _COMMS_LOGGER,
    "get_debug_log_name": _COMMS_LOGGER,
    "get_msg_size_from_args": _COMMS_LOGGER,
    "initialize_mesh_device": "device meshes are built from the config (sequence_parallel_size, mics_shard_size)",
    "all_reduce_coalesced": "call all_reduce per tensor, or on one flattened tensor",
    "all_gather_coalesced": "call all_gather_into_tensor per tensor",
    "has_all_reduce_coalesced": "call all_reduce per tensor, or on one flattened tensor",
    "enable_symm_mem_for_group": "symmetric memory is not available",
    "init_deepspeed_backend": "init_distributed creates torch's process group; there is no other backend",
    "set_backend": "init_distributed creates torch's process group; there is no other backend",
    "ProcessGroup": "use torch.distributed.ProcessGroup (new_group returns one)",
    "mpi_discovery": _CLUSTER_ENV,
    "in_aml": _CLUSTER_ENV,
    "in_aws_sm": _CLUSTER_ENV,
    "in_dlts": _CLUSTER_ENV,
    "patch_aml_env_for_torch_nccl_backend": _CLUSTER_ENV,
    "patch_aws_sm_env_for_torch_nccl_backend": _CLUSTER_ENV,
    "get_local_rank_from_launcher": "use get_local_rank() (LOCAL_RANK)",
    "get_world_rank_from_launcher": "use get_rank()",
    "get_world_size_from_launcher": "use get_world_size()",
    "get_default_args": "DeepSpeed's comm utilities are not available",
    "get_tensor_position": "DeepSpeed's comm utilities are not available",
    "get_tensor_kwarg": "DeepSpeed's comm utilities are not available",
    **{
        name: _INTERNALS
        for name in (
            "CCLBackend",
            "TorchBackend",
            "CommsLogger",
            "cdb",
            "ccl_backend",
            "hccl_backend",
            "mpi_backend",
            "nccl_backend",
            "comms_logger",
            "timer",
            "timers",
            "timer_summary",
            "utils",
            "get_caller_func",
        )
    },
}


def __getattr__(name: str) -> object:
    hints = _HINTS
    if name in hints:
        raise DeepSpeedUnavailable(f"deepspeed.comm.{name} is not available in accelerate_zero: {hints[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
