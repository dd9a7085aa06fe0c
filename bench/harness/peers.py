"""The systems we compare with, each wrapping the same model the way its users do, with its own byte counter
(bench/README.md, "engine_bench.py", lists them). This module imports only the standard library: the pure-Python
report code reads `PEERS` without torch. How each accumulates: DDP and ZeRO-R under `no_sync()` until the boundary,
FSDP2 its default path (a reduce-scatter every micro-step), the engines given `gradient_accumulation_steps`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Peer:
    """What the report says about a system."""

    label: str
    memory: tuple[int, int]
    """ZeRO paper bytes per parameter for fp32 Adam: (replicated, divided by W). No separate master copy."""
    counted_by: str
    """What counts its collectives' bytes."""


STAGE_MEMORY = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}
PEERS = {
    "ddp": Peer("torch DDP + AdamW", (16, 0), "comm hook"),
    "ddp_bucket_view": Peer("torch DDP (gradient_as_bucket_view) + AdamW", (16, 0), "comm hook"),
    "ddp_zero_r": Peer("torch DDP + ZeroRedundancyOptimizer(AdamW)", (8, 8), "comm hook + wrapped dist.broadcast"),
    "fsdp2": Peer(
        "torch FSDP2 (fully_shard per Linear)", (0, 16), "wrapped dist.all_gather_single / reduce_scatter_single"
    ),
    **{
        f"az{stage}": Peer(f"accelerate_zero stage {stage}", STAGE_MEMORY[stage], "engine.comm_stats()")
        for stage in range(4)
    },
    **{
        f"ds{stage}": Peer(f"DeepSpeed 0.19 stage {stage}", STAGE_MEMORY[stage], "DeepSpeed comms logger")
        for stage in (1, 2, 3)
    },
}
FORMULA_TEXT = {(16, 0): "16Ψ", (8, 8): "8Ψ+8Ψ/W", (4, 12): "4Ψ+12Ψ/W", (0, 16): "16Ψ/W"}

COMMS_LOGGER = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
"""DeepSpeed's comms logger, counting every deepspeed.comm call (`ds_comm`)."""


@dataclass(frozen=True)
class System:
    """A model wrapped for training by one peer, and that peer's own byte counter."""

    step: Callable[[], torch.Tensor]
    """Runs one optimizer step (`grad_accum` micro-steps); returns the mean micro-step loss."""
    comm: Callable[[], dict[str, dict[str, float]]]
    """Bytes moved since the last `reset_comm()`, per collective kind and in total (ring convention)."""
    reset_comm: Callable[[], None]
    engine: Any = None
    """The accelerate_zero or DeepSpeed engine (None for the torch peers)."""
    close: Callable[[], None] = lambda: None
    """Puts back the torch.distributed functions this peer wrapped to count bytes (ZeRO-R's broadcasts, FSDP2's
    collectives): a process that builds another peer afterwards (a test) calls it."""


# [Note: the loss alive in backward]
# Every loop holds the micro-step's loss, as returned, through its backward and drops it after: the engines take it
# whole (`engine.backward(loss)` divides by the accumulation itself), and a loss can be a view of a whole buffer
# (mse_loss's scalar views its elementwise losses: 8 x 1024 fp32 on the Linear stack). The torch loops used to keep
# only `loss / grad_accum`, freeing that buffer before backward, and the engine loop kept it on through the next
# micro-step's forward: 32,768 bytes of difference in the live-tensor peaks (stage3_bench.py phases --live_tensors).
MicroLoss = Callable[["nn.Module"], "torch.Tensor"]
"""The loss of one micro-step, given the wrapped model (DDP module, FSDP2 root or engine)."""
AfterBackward = Callable[[bool], None]
"""Called after every micro-step's backward with whether it was the boundary (readings between micro-steps)."""


def preload(name: str) -> None:
    """Imports what peer `name` needs (and, for DeepSpeed, joins its comm layer to the existing process group)."""
    if name.startswith("ds"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        return
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import accelerate_zero  # noqa: F401


def build(
    name: str,
    model: nn.Module,
    loss: MicroLoss,
    *,
    lr: float = 1e-4,
    grad_accum: int = 1,
    zero_config: dict[str, Any] | None = None,
    after_backward: AfterBackward | None = None,
    shard_types: tuple[type, ...] | None = None,
) -> System:
    """Wraps `model` as peer `name` does and returns its step.

    Args:
        name: a key of `PEERS`.
        model: the same fresh model on every rank.
        loss: the micro-step loss of the wrapped model.
        lr: AdamW's learning rate (every peer trains with `torch.optim.AdamW`).
        grad_accum: micro-steps per optimizer step; the torch peers divide each loss by it, the engines are told.
        zero_config: the DeepSpeed-style config of `az*` and `ds*` (required for them, ignored by the others);
            `gradient_accumulation_steps` is set from `grad_accum`.
        after_backward: called after each micro-step's backward (see `AfterBackward`).
        shard_types: FSDP2's units (None: each `nn.Linear`).
    """
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}: one of {', '.join(PEERS)}")
    after = after_backward or (lambda boundary: None)
    if name.startswith(("az", "ds")):
        if zero_config is None:
            raise ValueError(f"peer {name!r} needs zero_config (a DeepSpeed-style config dict)")
        config = dict(zero_config, gradient_accumulation_steps=grad_accum)
        return _engine(name, model, loss, lr, grad_accum, config, after)
    if name == "fsdp2":
        return _fsdp2(model, loss, lr, grad_accum, after, shard_types)
    return _ddp(name, model, loss, lr, grad_accum, after)


def _engine(
    name: str, model: nn.Module, loss: MicroLoss, lr: float, grad_accum: int, config: dict, after: AfterBackward
) -> System:
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    config["zero_optimization"] = dict(config["zero_optimization"], stage=int(name[-1]))  # the name says the stage
    if name.startswith("ds"):
        import deepspeed
        from deepspeed.comm.comm import comms_logger

        config["comms_logger"] = COMMS_LOGGER
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        comm = functools.partial(_logged_comm, comms_logger, dist.get_world_size())
        reset = comms_logger.comms_dict.clear
    else:
        import accelerate_zero

        engine = accelerate_zero.initialize(model, optimizer, config=config)
        comm, reset = engine.comm_stats, engine.reset_comm_stats

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for _ in range(grad_accum):
            boundary = engine.is_gradient_accumulation_boundary()
            micro = loss(engine)
            engine.backward(micro)  # divides by gradient_accumulation_steps itself
            total += micro.detach() / grad_accum
            del micro  # [Note: the loss alive in backward]
            after(boundary)
            engine.step()
        return total

    return System(step, comm, reset, engine)


def _logged_comm(logger: Any, world_size: int) -> dict[str, dict[str, float]]:
    """DeepSpeed's comms logger records as {op: calls, payload_bytes, bytes_per_rank}.

    The logger records the size of the argument named `tensor`: the full buffer of an all-reduce, reduce,
    broadcast or reduce-scatter, but one rank's input of an all-gather (the full buffer is W times that).
    """
    from .readings import ring_factor, with_total

    by_kind: dict[str, dict[str, float]] = {}
    for op, sizes in logger.comms_dict.items():
        for msg_size, record in sizes.items():
            calls = record[0]
            payload = msg_size * (world_size if op.startswith("all_gather") else 1)
            entry = by_kind.setdefault(op, {"calls": 0, "payload_bytes": 0, "bytes_per_rank": 0.0})
            entry["calls"] += calls
            entry["payload_bytes"] += calls * payload
            entry["bytes_per_rank"] += calls * payload * ring_factor(op, world_size)
    return with_total(by_kind)


def _ddp(name: str, model: nn.Module, loss: MicroLoss, lr: float, grad_accum: int, after: AfterBackward) -> System:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from .readings import ByteCounter

    counter = ByteCounter(dist.get_world_size())
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=name == "ddp_bucket_view")
    ddp.register_comm_hook(counter, _counting_allreduce_hook())
    close = _count_broadcasts(counter) if name == "ddp_zero_r" else lambda: None
    if name == "ddp_zero_r":
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr
        )
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(grad_accum):
            boundary = micro == grad_accum - 1
            # Non-boundary micro-steps accumulate locally; the boundary's backward all-reduces the sum.
            with contextlib.nullcontext() if boundary else ddp.no_sync():
                raw = loss(ddp)  # [Note: the loss alive in backward]
                value = raw / grad_accum
                value.backward()
                del raw
            after(boundary)
            total += value.detach()
        optimizer.step()
        return total

    return System(step, counter.as_dict, counter.reset, close=close)


def _counting_allreduce_hook() -> Callable[..., Any]:
    """DDP's default all-reduce hook (divide by W, all-reduce the bucket), counting the bucket's bytes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(counter: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        counter.record("all_reduce", buffer.numel() * buffer.element_size())
        return default_hooks.allreduce_hook(None, bucket)

    # DDP compares the hook's annotations with the real types; `from __future__ import annotations` made them strings.
    hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
    return hook


def _count_broadcasts(counter: Any) -> Callable[[], None]:
    """Wraps torch.distributed.broadcast in this process so ZeroRedundancyOptimizer's broadcasts are counted;
    returns what puts it back."""
    import torch.distributed as dist

    original = dist.broadcast

    @functools.wraps(original)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.record("broadcast", tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.broadcast = counted
    return functools.partial(setattr, dist, "broadcast", original)


def _count_fsdp_collectives(counter: Any) -> Callable[[], None]:
    """Wraps the two torch.distributed calls FSDP2 makes (`_fsdp_collectives` looks them up at call time); returns
    what puts them back.

    The full buffer of an all-gather is its output, of a reduce-scatter its input.
    """
    import torch.distributed as dist

    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    @functools.wraps(all_gather)
    def counted_all_gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.record("all_gather", output.numel() * output.element_size())
        return all_gather(output, *args, **kwargs)

    @functools.wraps(reduce_scatter)
    def counted_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        full = kwargs["input"] if "input" in kwargs else args[1]
        counter.record("reduce_scatter", full.numel() * full.element_size())
        return reduce_scatter(*args, **kwargs)

    dist.all_gather_single = counted_all_gather  # type: ignore[assignment]
    dist.reduce_scatter_single = counted_reduce_scatter  # type: ignore[assignment]

    def restore() -> None:
        dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter

    return restore


def _fsdp2(
    model: nn.Module,
    loss: MicroLoss,
    lr: float,
    grad_accum: int,
    after: AfterBackward,
    shard_types: tuple[type, ...] | None,
) -> System:
    """`fully_shard` on each unit, then on the root, resharding after forward (ZeRO-3's layout)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .readings import ByteCounter

    counter = ByteCounter(dist.get_world_size())
    close = _count_fsdp_collectives(counter)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, shard_types or (nn.Linear,)):
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(grad_accum):
            raw = loss(model)  # alive through backward, as the engines' loss is ([Note: the loss alive in backward])
            value = raw / grad_accum
            value.backward()
            del raw
            after(micro == grad_accum - 1)
            total += value.detach()
        optimizer.step()
        return total

    return System(step, counter.as_dict, counter.reset, close=close)
