"""Where the benchmarks find DeepSpeed: in its own virtualenv, never in this project's (it is compared, not used).

`$DS_VENV` if set, else `.ds-venv` at the top of this checkout (ignored by git). Create it once with

    python3 -m venv .ds-venv && DS_BUILD_OPS=0 .ds-venv/bin/pip install deepspeed "torch==2.13.0" transformers

Every benchmark takes `--ds_venv` too; a DeepSpeed system is skipped with a note when the folder does not exist.
"""

from __future__ import annotations

import os
from pathlib import Path


DEFAULT_DS_VENV = Path(os.environ.get("DS_VENV", Path(__file__).resolve().parent.parent / ".ds-venv"))
