"""The monitoring blocks of a DeepSpeed config (`tensorboard`, `wandb`, `csv_monitor`, `comet`, `comms_logger`,
`flops_profiler`), with DeepSpeed 0.19.8's keys and defaults. What each one does here is in accelerate_zero/monitor;
`config/deepspeed_keys.py` says which are built and refuses the others by name when they are on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from accelerate_zero.config.blocks import Block, KeyPolicy, _f


@dataclass(kw_only=True)
class TensorBoardConfig(Block):
    """`tensorboard`: the engine's events as TensorBoard scalars (torch.utils.tensorboard's SummaryWriter)."""

    _PATH: ClassVar[str] = "tensorboard"

    enabled: bool = False
    """Write the events; needs the `tensorboard` package."""
    output_path: str = ""
    """Folder the job's folder is made in ("" : the current folder, as DeepSpeed)."""
    job_name: str = "DeepSpeedJobName"
    """The job's folder inside `output_path`."""


@dataclass(kw_only=True)
class WandbConfig(Block):
    """`wandb`: the engine's events logged to Weights & Biases."""

    _PATH: ClassVar[str] = "wandb"

    enabled: bool = False
    """Log the events; needs the `wandb` package."""
    group: str | None = None
    """The wandb group of the run."""
    team: str | None = None
    """The wandb team (entity)."""
    project: str = "deepspeed"
    """The wandb project."""


@dataclass(kw_only=True)
class CSVMonitorConfig(Block):
    """`csv_monitor`: the engine's events as CSV files, one per event name (`step,<name>` rows)."""

    _PATH: ClassVar[str] = "csv_monitor"

    enabled: bool = False
    """Write the files."""
    output_path: str = ""
    """Folder the job's folder is made in ("": the current folder, as DeepSpeed)."""
    job_name: str = "DeepSpeedJobName"
    """The job's folder inside `output_path`."""


@dataclass(kw_only=True)
class CometConfig(Block):
    """`comet`: the engine's events logged to Comet."""

    _PATH: ClassVar[str] = "comet"

    enabled: bool = False
    """Log the events; needs the `comet_ml` package."""
    samples_log_interval: int = _f(100, ge=1)
    """Samples between two submissions."""
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


@dataclass(kw_only=True)
class CommsLoggerConfig(Block):
    """`comms_logger`: counts, sizes and times of the engine's collectives.

    DeepSpeed 0.19.8 turns its logger on whenever the block is present, even with `enabled: false`; here `enabled`
    decides (the configs that write `"comms_logger": {"enabled": false}` mean it off)."""

    _PATH: ClassVar[str] = "comms_logger"

    enabled: bool = False
    """Record every collective."""
    prof_all: bool = True
    """Time every kind of collective (else only those in `prof_ops`)."""
    prof_ops: list[str] = _f(factory=list)
    """Collectives to time when `prof_all` is false, by DeepSpeed's op names ("all_gather_into_tensor",
    "reduce_scatter_tensor", "all_reduce", ...) or ours (a kind is timed when its name begins with one)."""
    verbose: bool = False
    """Log one line per collective on rank 0."""
    debug: bool = False
    """Name each record after the function that issued the collective."""


@dataclass(kw_only=True)
class FlopsProfilerConfig(Block):
    """`flops_profiler`: the model's floating-point operations measured at one step."""

    _PATH: ClassVar[str] = "flops_profiler"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_DICT

    enabled: bool = False
    """Profile step `profile_step`."""
    recompute_fwd_factor: float = _f(0.0, ge=0)
    """Share of the forward recomputed in backward (activation checkpointing), added to the total."""
    profile_step: int = _f(1, ge=1)
    """The optimizer step that is profiled."""
    module_depth: int = -1
    """Depth of the per-module listing (-1: all)."""
    top_modules: int = _f(1, ge=0)
    """Modules listed per depth in the aggregated profile."""
    detailed: bool = True
    """Print the per-module profile."""
    output_file: str | None = None
    """Write the profile there instead of stdout."""


MONITOR_BLOCKS = (TensorBoardConfig, WandbConfig, CSVMonitorConfig, CometConfig)
"""The blocks DeepSpeed's `MonitorMaster` reads (`monitor.config.get_monitor_config`)."""
