"""The writers of DeepSpeed's monitor blocks, on well-kept libraries: the csv module, torch.utils.tensorboard's
`SummaryWriter`, wandb and comet_ml (the last two only when installed: `ZeroConfig.from_any` refuses them by name
otherwise). Files go where DeepSpeed puts them: `<output_path>/<job_name>/` (the current folder when `output_path`
is ""), `<name with / as _>.csv` for the CSV monitor, with DeepSpeed's `step,<last part of the name>` header."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from accelerate_zero.monitor.events import Event


class Writer(Protocol):
    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


class CSVMonitor:
    """`csv_monitor`: one file per event name, rows `step,value` under DeepSpeed's header."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.folder = Path(output_path or ".") / job_name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.started: set[str] = {p.stem for p in self.folder.glob("*.csv")}

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(self.folder / f"{filename}.csv", "a", newline="") as file:
                writer = csv.writer(file)
                if filename not in self.started:
                    self.started.add(filename)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        return None


class TensorBoardMonitor:
    """`tensorboard`: each event one scalar (`add_scalar(name, value, step)`), flushed after every step."""

    def __init__(self, output_path: str, job_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_path or ".", job_name))

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMonitor:
    """`wandb`: one `wandb.log` per event, at its step (as DeepSpeed's WandbMonitor)."""

    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        import wandb

        self.wandb = wandb
        wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        self.wandb.finish()


class CometMonitor:
    """`comet`: each event name logged (`log_metric`) when `samples_log_interval` samples have passed since it last
    was, as DeepSpeed's CometMonitor schedules it."""

    def __init__(self, block: Any) -> None:
        import comet_ml

        self.interval = block.samples_log_interval
        self.last: dict[str, int] = {}
        self.experiment = comet_ml.start(
            api_key=block.api_key,
            project=block.project,
            workspace=block.workspace,
            experiment_key=block.experiment_key,
            mode=block.mode,
            online=block.online,
        )
        if block.experiment_name is not None:
            self.experiment.set_name(block.experiment_name)

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            if name not in self.last or step - self.last[name] >= self.interval:
                self.last[name] = step
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()


class Monitors:
    """The writers the config turns on (rank 0 only); `write_events` hands each event to all of them."""

    def __init__(self, writers: list[Writer]) -> None:
        self.writers = writers

    def write_events(self, events: Sequence[Event]) -> None:
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class ScriptMonitor:
    """DeepSpeed's `engine.monitor` (its MonitorMaster) as scripts use it: `enabled` says whether the config turns a
    monitor on, and `write_events` hands the script's own `(name, value, step)` events to the same writers as the
    engine's (rank 0 writes; the other ranks' calls do nothing, as in DeepSpeed)."""

    def __init__(self, monitors: Monitors | None, enabled: bool) -> None:
        self.monitors, self.enabled = monitors, enabled

    def write_events(self, events: Sequence[Event]) -> None:
        if self.monitors is not None:
            self.monitors.write_events(events)


def build_monitors(config: Any, rank: int) -> Monitors | None:
    """The monitors `config` (a `ZeroConfig`) turns on, on rank 0; None on other ranks or when none is on."""
    if rank != 0:
        return None
    writers: list[Writer] = []
    if config.csv_monitor.enabled:
        writers.append(CSVMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.tensorboard.enabled:
        writers.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.wandb.enabled:
        writers.append(WandbMonitor(config.wandb.project, config.wandb.group, config.wandb.team))
    if config.comet.enabled:
        writers.append(CometMonitor(config.comet))
    return Monitors(writers) if writers else None


def any_enabled(config: Any) -> bool:
    """Whether `config` turns on a monitor (every rank then records the step's loss for `train_loss`)."""
    return any(getattr(config, name).enabled for name in ("csv_monitor", "tensorboard", "wandb", "comet"))
