"""Where DeepSpeed's virtualenv is: its one home is now harness/launch.py (`DEFAULT_DS_VENV`, `deepspeed_python`).

This name stays until trainer_bench.py and phase_peaks.py (edited by another piece of work today) import it from
the harness; then this file goes.
"""

from __future__ import annotations

from harness.launch import DEFAULT_DS_VENV


__all__ = ["DEFAULT_DS_VENV"]
