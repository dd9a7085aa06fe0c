"""DeepSpeed's own API (0.19.8) over accelerate_zero: `import accelerate_zero.deepspeed as deepspeed`.

A script written for DeepSpeed (its tutorials, DeepSpeed-Chat, OpenRLHF-style trainers) runs by changing
`import deepspeed` to `import accelerate_zero.deepspeed as deepspeed` and the launcher's name
(`accelerate-zero deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json`):

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    deepspeed.init_distributed()
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = MyModel()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("out", client_state={"epoch": 1})

What DeepSpeed has and this package does not (pipeline parallelism, DeepSpeed-Inference, tensor parallelism, its
kernels and monitors) raises `DeepSpeedUnavailable` naming it and what to use instead, at the first use of the name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from accelerate_zero import __version__ as __accelerate_zero_version__
from accelerate_zero.config import ZeroConfigError as DeepSpeedConfigError
from accelerate_zero.deepspeed import comm, ops, zero
from accelerate_zero.deepspeed.accelerator import get_accelerator
from accelerate_zero.deepspeed.comm import TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed
from accelerate_zero.deepspeed.dataloader import DeepSpeedDataLoader, RepeatingLoader
from accelerate_zero.deepspeed.engine import DeepSpeedEngine
from accelerate_zero.deepspeed.initialization import add_config_arguments, initialize
from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable, module_refusal


__version__ = "0.19.8"
"""The DeepSpeed API version this package follows (scripts compare `deepspeed.__version__`);
`__accelerate_zero_version__` is ours."""
version = __version__
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
__git_hash__ = __git_branch__ = git_hash = git_branch = None

dist = comm
"""DeepSpeed sets `deepspeed.dist` to its comm module; scripts call `deepspeed.dist.get_rank()`."""
HAS_TRITON = False
MUON_OPTIMIZER = "muon"
DeepSpeedOptimizerCallable = Callable[[Any], Any]
DeepSpeedSchedulerCallable = Callable[[Any], Any]
logger = logging.getLogger("DeepSpeed")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Logs `message` on the given ranks (all when `ranks` is None or holds -1), as DeepSpeed's `log_dist`."""
    rank = comm.get_rank() if comm.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def __getattr__(name: str) -> Any:
    refusal = module_refusal(name)
    if refusal is not None:
        raise DeepSpeedUnavailable(refusal)
    raise AttributeError(f"module 'accelerate_zero.deepspeed' has no attribute {name!r}")


__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedDataLoader",
    "DeepSpeedEngine",
    "DeepSpeedUnavailable",
    "RepeatingLoader",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "__accelerate_zero_version__",
    "add_config_arguments",
    "comm",
    "dist",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "log_dist",
    "ops",
    "zero",
]
