"""`deepspeed.initialize` and `deepspeed.add_config_arguments` with DeepSpeed 0.19.8's signatures and returns.

[Note: DeepSpeed's precedence between code and config]
DeepSpeed lets objects passed in code win over the config's blocks: a client optimizer (or a callable making one)
overrides the config's `optimizer` block, a client scheduler its `scheduler` block; `model_parameters` (tensors or
param-group dicts) is what the config's optimizer is built over. Our own `accelerate_zero.initialize` refuses
both at once (one of them is then unused). Here DeepSpeed's rule applies: the overridden block is dropped from the
config before the engine sees it (and the engine logs which), and an optimizer built from the config over
`model_parameters` is handed to the engine as a client optimizer. The config itself goes through the same loading
and checks as every other entry point (`ZeroConfig.from_any`, `resolve_config`).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accelerate_zero.config import ZeroConfig, resolve_config
from accelerate_zero.deepspeed.comm import TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed
from accelerate_zero.deepspeed.engine import DeepSpeedEngine
from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable
from accelerate_zero.engine.engine import initialize as zero_initialize
from accelerate_zero.engine.stage3.construction import PartitionedConstruction
from accelerate_zero.optim.factory import build_optimizer


logger = logging.getLogger(__name__)


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer | None, Any, Any]:
    """Builds the engine for `model`, as `deepspeed.initialize` does.

    Args:
        args: an argparse namespace: `args.deepspeed_config` (or the deprecated `deepscale_config`) names the
            config; `args.local_rank`, if set, must be this process's LOCAL_RANK and is set to it.
        model: the model (built normally, or under `zero.Init`).
        optimizer: a torch optimizer, or a callable taking the parameters (`model_parameters`, default all of
            the model's) and returning one; overrides the config's `optimizer` block. None: the block's optimizer,
            or none at all (the model is then prepared for inference: frozen, stage 3 still shards it).
        model_parameters: the tensors or param-group dicts the optimizer is built over.
        training_data: a torch dataset: the returned loader gives this rank its share, one micro-batch at a time.
        lr_scheduler: a scheduler, or a callable taking the optimizer; overrides the config's `scheduler` block.
        distributed_port: MASTER_PORT when the process group is created here without one in the environment.
        mpu: refused (model parallelism is not available).
        dist_init_required: False: a process group must exist already.
        collate_fn: merges samples into a batch for the training loader.
        config: the DeepSpeed config, as a dict or a path (.json/.yaml).
        mesh_param: refused (device meshes come from the config's `sequence_parallel_size`).
        config_params: the old name of `config`.

    Returns:
        (engine, optimizer, training_dataloader, lr_scheduler): the engine (`engine(batch)`,
        `engine.backward(loss)`, `engine.step()`), its optimizer (None without one), the loader (None without
        `training_data`) and the scheduler (None without one).

    Raises:
        DeepSpeedUnavailable: `mpu` or `mesh_param` is given.
        ValueError: no model, no config, a config given twice, or `args.local_rank` not this process's.
        ZeroConfigError: the config is invalid (every problem listed), on every rank, before any training.
    """
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        name = "mpu" if mpu is not None else "mesh_param"
        raise DeepSpeedUnavailable(
            f"deepspeed.initialize({name}=...): model parallelism and custom device meshes are not available; data "
            "parallelism spans every rank (sequence_parallel_size in the config cuts sequences)"
        )
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    zero = ZeroConfig.from_any(_config_source(args, config, config_params))
    _align_local_rank(args)
    with PartitionedConstruction.paused():  # initialize inside zero.Init builds nothing partitioned itself
        zero, client_optimizer = _optimizer_and_config(zero, model, optimizer, model_parameters)
        if lr_scheduler is not None and zero.scheduler is not None:
            logger.info("the scheduler passed to initialize overrides the config's scheduler block (DeepSpeed's rule)")
            zero = _without(zero, "scheduler")
        inference = client_optimizer is None
        if inference:
            model.requires_grad_(False)
            client_optimizer = torch.optim.SGD([{"params": []}], lr=0.0)
        engine = zero_initialize(model, client_optimizer, zero, lr_scheduler, engine_class=DeepSpeedEngine)
    engine.collate_fn = collate_fn
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data)
    return engine, None if inference else engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config DeepSpeed would read: `config`, else `config_params`, else `args.deepspeed_config`."""
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated, please use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError("both --deepscale_config and --deepspeed_config are given: keep --deepspeed_config")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError(
                "a DeepSpeed config is given both in args.deepspeed_config and to initialize(config=...): pass one"
            )
        config = from_args
    if config is None:
        raise ValueError(
            "DeepSpeed requires --deepspeed_config to specify configuration file: pass config= (a dict or a path) "
            "or args with deepspeed_config"
        )
    return config


def _align_local_rank(args: Any) -> None:
    """DeepSpeed's check and update of `args.local_rank` against the launcher's LOCAL_RANK."""
    if "LOCAL_RANK" not in os.environ or not hasattr(args, "local_rank"):
        return
    env_local_rank = int(os.environ["LOCAL_RANK"])
    given = args.local_rank
    if given is not None and (isinstance(given, bool) or not isinstance(given, int)):
        raise ValueError(f"args.local_rank of {given!r} is an unknown type {type(given)}")
    if given is not None and given >= 0 and given != env_local_rank:
        raise ValueError(
            f"Mismatch in local rank setting, args.local_rank={given} but env['LOCAL_RANK']={env_local_rank}."
        )
    args.local_rank = env_local_rank


def _optimizer_and_config(
    zero: ZeroConfig, model: nn.Module, optimizer: Any, model_parameters: Any
) -> tuple[ZeroConfig, torch.optim.Optimizer | None]:
    """The torch optimizer for the engine and the config without the block it replaces
    ([Note: DeepSpeed's precedence between code and config])."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise ValueError(f"Client Optimizer is of unexpected type {type(optimizer)}")
    parameters = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if optimizer is not None:
        if zero.optimizer is not None:
            logger.info("the optimizer passed to initialize overrides the config's optimizer block (DeepSpeed's rule)")
            zero = _without(zero, "optimizer")
        built = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(parameters)
        return zero, _without_empty_groups(built)
    if zero.optimizer is None:
        return zero, None
    # The block's values are DeepSpeed's, with "auto" left unfilled by nobody: resolve it as the engine would.
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    block = resolve_config(zero, world_size=world_size).optimizer
    built = build_optimizer(parameters, block.type, block.params)
    return _without(zero, "optimizer"), _without_empty_groups(built)


def _without_empty_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # DeepSpeed drops param groups without parameters ("Removing param_group that has no 'params'").
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
    return optimizer


def _without(zero: ZeroConfig, block: str) -> ZeroConfig:
    raw = zero.to_dict()
    raw.pop(block, None)
    return ZeroConfig.from_any(raw)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's command-line arguments (`--deepspeed`, `--deepspeed_config`, and the deprecated
    `--deepscale`, `--deepscale_config`) to `parser`, in a "DeepSpeed" group; returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file."
    )
    return parser
