"""The Trainer's asynchronous checkpoint saves and their deferred rotation, and resuming from a DCP folder.

[Note: the Trainer's asynchronous saves]
With `checkpoint.writer.decoupled: true` in the ZeRO config ([Note: DeepSpeed's checkpoint writer] in
config/checkpoint_writer.py), `_save_checkpoint` writes the Trainer's own files as usual and the engine state with
`async_save=True`: it is published under `checkpoint-N/zero_model/` once every rank's writer is done, and until then
the folder counts as incomplete (`last_complete_checkpoint`, `_check_complete`), so a job killed during the write
resumes from the previous checkpoint. transformers rotates (`save_total_limit`) at the end of `_save_checkpoint`,
which would delete the previous checkpoint, the last one published, while the new one is still being written. So
the rotation is deferred: the next save, or the end of `train()`, first waits for the writer (raising its error on
every rank, if it failed) and then rotates, keeping the best model's checkpoint as transformers does. Meanwhile the
output folder holds one checkpoint more than the limit.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from accelerate_zero.checkpoint import async_save
from accelerate_zero.config.checkpoint_writer import decoupled


_PENDING = "_zero_deferred_rotation"


def saves_asynchronously(args: Any) -> bool:
    """Whether the arguments' ZeRO config asks for asynchronous saves (`checkpoint.writer.decoupled: true`)."""
    return decoupled(args.zero_fill.config)


@contextlib.contextmanager
def rotation_deferred(trainer: Any, run_dir: str) -> Iterator[None]:
    """While the block runs (transformers' `_save_checkpoint`), `save_total_limit` reads None, so it rotates
    nothing; the rotation it would have done runs in `finish_saves`. The arguments the block pickled into the new
    checkpoint (`training_args.bin`) are written again with the real limit."""
    args = trainer.args
    limit = args.save_total_limit
    args.save_total_limit = None
    try:
        yield
    finally:
        args.save_total_limit = limit
    setattr(trainer, _PENDING, run_dir)
    arguments = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}" / TRAINING_ARGS_NAME
    if args.should_save and arguments.is_file():
        torch.save(args, arguments)


def finish_saves(trainer: Any, engine: Any) -> None:
    """Waits for `engine`'s save in flight (every rank must call it), then runs the rotation it deferred."""
    async_save.finish(engine.layout.world)
    run_dir = trainer.__dict__.pop(_PENDING, None)
    if run_dir is not None and trainer.args.should_save:
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=trainer.args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )


def resume_from_dcp(trainer: Any, engine: Any, folder: str, trainer_scheduler: Any) -> None:
    """Loads a DCP checkpoint written by FSDP2 or torchtitan ([Note: DCP checkpoints in] in checkpoint/dcp_load.py)
    and continues the Trainer's count from its step: the folder has no `trainer_state.json`, so the Trainer's step
    becomes the engine's, and a scheduler the Trainer built (`trainer_scheduler`, None when the engine owns it) is
    stepped to it, giving the learning rate of that step. The data order restarts from the first batch, as with
    `ignore_data_skip=True`: a DCP folder does not say where the other framework's loader was.
    """
    engine.load_checkpoint(folder)
    step = int(engine.global_steps)
    trainer.state.global_step = step
    if trainer_scheduler is not None:
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": no optimizer step here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                trainer_scheduler.step()


def check_fsdp_scheduler(config: Any, checkpoint_format: str) -> None:
    """An FSDP Trainer rebuilds its scheduler from its arguments and loads scheduler.pt into it: a schedule from the
    ZeRO config's `scheduler` block (DeepSpeed's WarmupLR, ...) would not fit it.

    Raises:
        ValueError: the config has a `scheduler` block.
    """
    if config.scheduler is not None:
        raise ValueError(
            f"save_checkpoint_format={checkpoint_format!r} with a `scheduler` block in the ZeRO config: an FSDP "
            "Trainer resumes the scheduler it builds from its arguments (lr_scheduler_type, warmup_steps), which "
            "this one is not. Remove the block and set lr_scheduler_type/warmup_steps, or save the 'zero' format"
        )


SAVE_PRETRAINED_SHARD_BYTES = 50 * 10**9
"""transformers 5's `save_pretrained` default `max_shard_size` ("50GB")."""
