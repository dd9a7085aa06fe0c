"""DeepSpeed's monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`) for the engine's events.

The package knows nothing of the engine: it receives values (`StepValues`), names them as DeepSpeed's engine does
(`events.py`) and hands them to the writers the config turns on (`writers.py`). The engine's only call is
`engine/step_log.py`'s, once after each optimizer step.
"""

from accelerate_zero.monitor.events import Event, StepValues, step_events
from accelerate_zero.monitor.writers import Monitors, build_monitors


__all__ = ["Event", "Monitors", "StepValues", "build_monitors", "step_events"]
