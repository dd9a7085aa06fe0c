"""What `import accelerate_zero` loads: the engine, not the integrations' libraries (loaded on first use)."""

import json
import os
import sys
from collections.abc import Iterator

import pytest

from tests.helpers.processes import Started, started_together


_PROBE = """
import sys
import accelerate_zero
print(sorted(name for name in ("accelerate", "transformers", "deepspeed") if name in sys.modules))
print(accelerate_zero.ZeroAccelerator.__module__, "accelerate" in sys.modules)
print(sorted(name for name in accelerate_zero.__all__ if not hasattr(accelerate_zero, name)))
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Started]]:
    """The probes in fresh interpreters (the test session has long imported accelerate and transformers), started
    together (tests/helpers/processes.py)."""
    config = tmp_path_factory.mktemp("probes") / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}))
    code = {"engine": _PROBE, "deepspeed": _DEEPSPEED_PROBE.replace("DS_CONFIG", repr(str(config)))}
    # as a user's shell has it: no launcher's variables
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE"))}
    commands = {name: [sys.executable, "-c", text] for name, text in code.items()}
    with started_together(commands, env=env, cwd=config.parent) as started:
        yield started


def _printed(probe: Started) -> str:
    """What `probe` printed; fails the test with its error output when it did not exit cleanly."""
    done = probe.finished()
    assert done.returncode == 0, f"the probe exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def test_import_loads_the_engine_only_and_integrations_on_first_use(probes: dict[str, Started]):
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
from accelerate_zero import TrainingArguments, ZeroAccelerator

ZeroAccelerator.unwrap_model(None, torch.nn.Linear(1, 1))
# a DeepSpeed config passed as `deepspeed=` is read as our zero_config (tests/integration/test_migration.py)
arguments = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, deepspeed=DS_CONFIG)
print("ours:", "deepspeed" in sys.modules, arguments.zero_stage)
from accelerate.utils import extract_model_from_parallel

extract_model_from_parallel(torch.nn.Linear(1, 1))  # what transformers' save_pretrained and TRL's trainers call
print("accelerate:", "deepspeed" in sys.modules, importlib.util.find_spec("deepspeed") is not None)
"""


def test_what_the_readme_says_about_importing_deepspeed(probes: dict[str, Started]):
    """README ("Launching"): accelerate_zero (its integrations, TRL's modules, our unwrap, and TrainingArguments given
    a DeepSpeed config as `deepspeed=`) imports no deepspeed; with deepspeed installed, accelerate's `extract_model_from_parallel`, which transformers'
    `save_pretrained` and TRL's trainers call, imports it."""
    lines = {
        line.split(":")[0]: line.split()[1:]
        for line in _printed(probes["deepspeed"]).splitlines()
        if line.startswith(("ours:", "accelerate:"))
    }
    assert lines["ours"] == ["False", "3"], "accelerate_zero's code imported deepspeed"
    imported, installed = lines["accelerate"]
    assert imported == installed, "accelerate imports deepspeed exactly when it is installed"
