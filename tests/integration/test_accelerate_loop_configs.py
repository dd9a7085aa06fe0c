"""The seeds' accelerate DeepSpeed configs, unchanged, run a plain accelerate loop under `accelerate-zero launch`.

The configs below are copied verbatim from the project's seed notes (open-r1's `recipes/accelerate_configs/zero2.yaml`
and `zero3.yaml`, and the tutorial's `zero2_config.yaml`/`zero3_config.yaml` with `mixed_precision: bf16`). The
script (tests/integration/scripts/accelerate_loop.py) feeds float32 batches from a DataLoader to an `nn.Sequential`
whose weights the engine keeps in 16-bit: the prepared model must cast its inputs (issue 13, part 3) and the loss
must fall. Each launch is planned by the launcher and run on the pooled ranks (tests/integration/planned_launch.py). Launch-line flags fill what a config leaves to the machine (`--num_processes 2` on this 2-core runner,
the precision of the configs that set none); the files themselves are not edited.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from accelerate_zero.config import ZeroConfig
from accelerate_zero.engine.setup import cast_forward_inputs, forward_input_dtype
from tests.helpers.dist import scaled_seconds
from tests.integration.planned_launch import planned_environment, run_as_planned


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "scripts" / "accelerate_loop.py"

RECIPE_ZERO2 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_multinode_launcher: standard
  zero3_init_flag: false
  zero_stage: 2  # ZeRO-2

  # Optimizer state partitioning
  offload_optimizer_device: none  # Keep optimizer on GPU

  # Gradient partitioning
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0

  # Communication optimization
  overlap_comm: true  # Overlap communication with computation
  reduce_scatter: true  # Use reduce-scatter instead of all-reduce

  # Memory optimization
  allgather_bucket_size: 5e8
  reduce_bucket_size: 5e8

distributed_type: DEEPSPEED
"""

RECIPE_ZERO3 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 3  # ZeRO-3

  # Parameter partitioning
  stage3_prefetch_bucket_size: 5e8
  stage3_param_persistence_threshold: 1e6
  stage3_gather_16bit_weights_on_model_save: true

  # Offloading (optional)
  offload_optimizer_device: none  # Can use "cpu" to save GPU memory
  offload_param_device: none  # Can use "cpu" for even larger models

  # Communication optimization
  overlap_comm: true
  stage3_max_live_parameters: 1e9
  stage3_max_reuse_distance: 1e9

distributed_type: DEEPSPEED
"""

TUTORIAL_ZERO2 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 2
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0
  overlap_comm: true
distributed_type: DEEPSPEED
num_processes: 8
machine_rank: 0
num_machines: 1
mixed_precision: bf16
"""

TUTORIAL_ZERO3 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 3
  stage3_prefetch_bucket_size: 5e8
  stage3_param_persistence_threshold: 1e6
  overlap_comm: true
  offload_optimizer_device: none
distributed_type: DEEPSPEED
num_processes: 8
mixed_precision: bf16
"""


@pytest.fixture(autouse=True)
def _launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    timeout = scaled_seconds(60)  # before the loop below clears ACCELERATE_ZERO_TEST_TIMEOUT_SCALE
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_ZERO_", "ACCELERATE_DEEPSPEED_", "ACCELERATE_USE_", "ACCELERATE_MIXED")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_ZERO_PG_TIMEOUT", timeout)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.chdir(REPO)


SEEDS = {
    "recipe-zero2-fp16": (RECIPE_ZERO2, ["--mixed_precision", "fp16"], 2, 4, "torch.float16"),
    "recipe-zero3-bf16": (RECIPE_ZERO3, ["--mixed_precision", "bf16"], 3, 1, "torch.bfloat16"),
    "tutorial-zero2-bf16": (TUTORIAL_ZERO2, [], 2, 4, "torch.bfloat16"),
    "tutorial-zero3-bf16": (TUTORIAL_ZERO3, [], 3, 1, "torch.bfloat16"),
}


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each seed config's launch, planned by `accelerate-zero launch` and run on the pooled ranks
    (tests/integration/planned_launch.py)."""
    folders, runs = {}, []
    for name, (config, flags, *_) in SEEDS.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "config.yaml").write_text(config)
        launch = ["--config_file", str(folder / "config.yaml"), "--num_processes", "2", *flags]
        runs.append((planned_environment(launch, SCRIPT), ["--out", str(folder / "out")]))
        folders[name] = folder / "out"
    run_as_planned(SCRIPT, runs)
    return folders


@pytest.mark.parametrize("name", list(SEEDS))
def test_seed_config_trains_a_plain_loop_fed_float32(seed_runs: dict[str, Path], name: str) -> None:
    _, _, stage, accumulation, dtype = SEEDS[name]
    runs = [json.loads((seed_runs[name] / f"rank{rank}.json").read_text()) for rank in range(2)]
    for run in runs:
        assert (run["stage"], run["world_size"], run["gradient_accumulation_steps"]) == (stage, 2, accumulation)
        assert (run["input_dtype"], run["param_dtype"], run["output_dtype"]) == ("torch.float32", dtype, dtype)
    first = statistics.mean(loss for run in runs for loss in run["losses"][:8])
    last = statistics.mean(loss for run in runs for loss in run["losses"][-8:])
    assert last < 0.5 * first, f"the loss did not fall: {first=} {last=}"


def test_cast_keeps_integers_and_labels() -> None:
    ids, mask = torch.tensor([[1, 2]]), torch.tensor([[True, False]])
    embeds, labels = torch.randn(1, 2, 3), torch.tensor([3.14159])
    args, kwargs = cast_forward_inputs(
        (embeds, [embeds, ids]),
        {"input_ids": ids, "mask": mask, "extra": {"x": embeds}, "labels": labels},
        torch.bfloat16,
    )
    assert args[0].dtype == args[1][0].dtype == kwargs["extra"]["x"].dtype == torch.bfloat16
    assert kwargs["input_ids"] is ids and kwargs["mask"] is mask and kwargs["labels"] is labels
    assert list(kwargs) == ["input_ids", "mask", "extra", "labels"]


@pytest.mark.parametrize(
    ("blocks", "dtype"),
    [
        ({}, None),
        ({"bf16": {"enabled": True}}, torch.bfloat16),
        ({"fp16": {"enabled": True}}, None),  # DeepSpeed's key: fp16 casts only under auto_cast
        ({"fp16": {"enabled": True, "auto_cast": True}}, torch.float16),
    ],
)
def test_forward_input_dtype(blocks: dict, dtype: torch.dtype | None) -> None:
    config = ZeroConfig.from_any({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, **blocks})
    assert forward_input_dtype(config) == dtype
