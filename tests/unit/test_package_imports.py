"""What `import accelerate_zero` loads: the engine, not the integrations' libraries (loaded on first use)."""

import subprocess
import sys
from collections.abc import Iterator

import pytest


_PROBE = """
import sys
import accelerate_zero
print(sorted(name for name in ("accelerate", "transformers", "deepspeed") if name in sys.modules))
print(accelerate_zero.ZeroAccelerator.__module__, "accelerate" in sys.modules)
print(sorted(name for name in accelerate_zero.__all__ if not hasattr(accelerate_zero, name)))
"""


@pytest.fixture(scope="module")
def probes() -> Iterator[dict[str, subprocess.Popen]]:
    """Both probes in fresh interpreters (the test session has long imported accelerate and transformers), started
    together: each spends seconds of one core importing, and neither needs the other."""
    started = {
        name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, code in (("engine", _PROBE), ("deepspeed", _DEEPSPEED_PROBE))
    }
    yield started
    for process in started.values():
        process.kill()
        process.communicate()


def _printed(probe: subprocess.Popen) -> str:
    """What `probe` printed; fails the test with its error output when it did not exit cleanly."""
    stdout, stderr = probe.communicate(timeout=300)
    assert probe.returncode == 0, f"the probe exited {probe.returncode}:\n{stderr[-4000:]}"
    return stdout


def test_import_loads_the_engine_only_and_integrations_on_first_use(probes: dict[str, subprocess.Popen]):
    loaded, accelerator, missing = _printed(probes["engine"]).splitlines()
    assert loaded == "[]", f"`import accelerate_zero` imported {loaded}; the engine needs none of them"
    assert accelerator == "accelerate_zero.integrations.accelerate.accelerator True"
    assert missing == "[]", f"names in accelerate_zero.__all__ that cannot be reached: {missing}"


_DEEPSPEED_PROBE = """
import importlib.util
import sys

import torch

import accelerate_zero.integrations.transformers
import accelerate_zero.integrations.trl
from accelerate_zero import ZeroAccelerator

ZeroAccelerator.unwrap_model(None, torch.nn.Linear(1, 1))
print("ours:", "deepspeed" in sys.modules)
from accelerate.utils import extract_model_from_parallel

extract_model_from_parallel(torch.nn.Linear(1, 1))  # what transformers' save_pretrained and TRL's trainers call
print("accelerate:", "deepspeed" in sys.modules, importlib.util.find_spec("deepspeed") is not None)
"""


def test_what_the_readme_says_about_importing_deepspeed(probes: dict[str, subprocess.Popen]):
    """README ("Launching"): accelerate_zero (its integrations, TRL's modules and our unwrap included) imports no
    deepspeed; with deepspeed installed, accelerate's `extract_model_from_parallel`, which transformers'
    `save_pretrained` and TRL's trainers call, imports it."""
    lines = {
        line.split(":")[0]: line.split()[1:]
        for line in _printed(probes["deepspeed"]).splitlines()
        if line.startswith(("ours:", "accelerate:"))
    }
    assert lines["ours"] == ["False"], "accelerate_zero's code imported deepspeed"
    imported, installed = lines["accelerate"]
    assert imported == installed, "accelerate imports deepspeed exactly when it is installed"
