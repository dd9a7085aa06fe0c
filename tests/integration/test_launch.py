"""`accelerate-zero launch` smoke tests: real 2-process CPU launches of tests/integration/scripts/train_tiny.py.

Each launch costs a few seconds (every rank imports torch), so each test launches once and checks everything it
can in the files the ranks write. Most launches run `main(["launch", ...])` in this process (the launcher's own
imports are already paid); the two-machine test starts two `accelerate-zero launch` processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from accelerate_zero.cli.main import main
from tests.helpers.dist import free_port, scaled_seconds
from tests.integration.planned_launch import planned_environment, run_as_planned


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "scripts" / "train_tiny.py"
CONFIGS = REPO / "accelerate_configs"


@pytest.fixture(autouse=True)
def _launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    timeout = scaled_seconds(30)  # before the loop below clears ACCELERATE_ZERO_TEST_TIMEOUT_SCALE
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_ZERO_", "ACCELERATE_DEEPSPEED_", "ACCELERATE_USE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_ZERO_PG_TIMEOUT", timeout)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.chdir(REPO)


def launch(out: Path, *flags: str, script_args: tuple[str, ...] = ()) -> int:
    return main(["launch", "--main_process_port", "0", *flags, str(SCRIPT), "--out", str(out), *script_args])


def results(out: Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def check_run(out: Path, stage: int) -> list[dict[str, Any]]:
    runs = results(out)
    for rank, run in enumerate(runs):
        assert (run["rank"], run["world_size"], run["stage"], len(run["losses"])) == (rank, 2, stage, 3)
        assert run["env"]["ACCELERATE_ZERO_ZERO_STAGE"] == str(stage)
        assert json.loads(run["env"]["ACCELERATE_ZERO_CONFIG"])["zero_optimization"]["stage"] == stage
        assert "ACCELERATE_USE_DEEPSPEED" not in run["env"]
        assert (run["accelerate_distributed_type"], run["accelerate_num_processes"]) == (
            "DistributedType.MULTI_CPU",
            2,
        )
    return runs


SHIPPED = {"zero1.yaml": 1, "zero2.yaml": 2, "zero3.yaml": 3, "zero3_offload.yaml": 3, "zero3_nvme.yaml": 3}
LAUNCHED = "zero3.yaml"
"""The shipped config launched for real; the others are planned by the launcher and run on the pooled ranks
(tests/integration/planned_launch.py)."""


@pytest.fixture(scope="module")
def planned_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    launches = {name: ["--config_file", str(CONFIGS / name)] for name in SHIPPED if name != LAUNCHED}
    launches["zero2.yaml --zero_stage 1"] = ["--config_file", str(CONFIGS / "zero2.yaml"), "--zero_stage", "1"]
    folders, runs = {}, []
    for label, flags in launches.items():
        folders[label] = tmp_path_factory.mktemp(label.split(".")[0])
        runs.append((planned_environment(flags, SCRIPT), ["--out", str(folders[label])]))
    run_as_planned(SCRIPT, runs)
    return folders


@pytest.mark.parametrize(("name", "stage"), list(SHIPPED.items()))
def test_shipped_config_trains_on_two_processes(
    tmp_path: Path, name: str, stage: int, planned_runs: dict[str, Path]
) -> None:
    if name == LAUNCHED:
        assert launch(tmp_path, "--config_file", str(CONFIGS / name)) == 0
    check_run(planned_runs.get(name, tmp_path), stage)


def test_flag_overrides_the_config_file(planned_runs: dict[str, Path]) -> None:
    check_run(planned_runs["zero2.yaml --zero_stage 1"], 1)


def test_deepspeed_config_file_with_a_multi_gpu_config(tmp_path: Path) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": 0.5,
                "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
            }
        )
    )
    accelerate_config = tmp_path / "multi_gpu.yaml"
    accelerate_config.write_text("distributed_type: MULTI_GPU\nmixed_precision: 'no'\nnum_processes: 2\n")
    out = tmp_path / "out"
    assert launch(out, "--config_file", str(accelerate_config), "--deepspeed_config_file", str(ds)) == 0
    for run in check_run(out, 1):
        assert run["config"]["gradient_clipping"] == 0.5
        assert run["config"]["zero_optimization"]["reduce_bucket_size"] == 1000


def test_bad_config_exits_2_before_any_process_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (CONFIGS / "zero2.yaml").read_text().replace("  zero_stage: 2", "  zero_stage: 2\n  overlap_com: true")
    )
    out = tmp_path / "out"
    assert launch(out, "--config_file", str(bad)) == 2
    err = capsys.readouterr().err
    assert "unknown key 'deepspeed_config.overlap_com'" in err and "did you mean 'overlap_comm'?" in err
    assert "Traceback" not in err
    assert not out.exists()  # the script creates it first thing: no rank started


def test_a_failing_rank_fails_the_launch_promptly(tmp_path: Path) -> None:
    start = time.monotonic()
    code = launch(tmp_path, "--config_file", str(CONFIGS / "zero2.yaml"), script_args=("--fail_rank", "1"))
    assert code != 0
    assert time.monotonic() - start < 60
    assert (tmp_path / "started_rank0").exists() and (tmp_path / "started_rank1").exists()
    assert not (tmp_path / "rank0.json").exists()


def test_two_machines_on_loopback(tmp_path: Path) -> None:
    port = free_port()
    common = ["--num_processes", "2", "--num_machines", "2", "--main_process_ip", "127.0.0.1"]
    common += ["--main_process_port", str(port), "--config_file", str(CONFIGS / "zero1.yaml")]
    machines = [
        subprocess.Popen(
            [sys.executable, "-m", "accelerate_zero.cli.main", "launch", *common, "--machine_rank", str(rank)]
            + [str(SCRIPT), "--out", str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [machine.communicate(timeout=120)[0] for machine in machines]
    finally:
        for machine in machines:
            machine.kill()
    assert [machine.returncode for machine in machines] == [0, 0], "\n".join(outputs)
    check_run(tmp_path, 1)


def test_a_machine_without_the_main_address_is_refused_in_seconds(tmp_path: Path) -> None:
    """A real second machine's launch line without --main_process_ip used to wait at the rendezvous until killed;
    it exits 2 before starting anything ([Note: launch mistakes that hang] in launch_checks.py)."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "accelerate_zero.cli.main", "launch", "--num_processes", "2", "--num_machines", "2"]
        + ["--machine_rank", "1", "--config_file", str(CONFIGS / "zero1.yaml"), str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=float(scaled_seconds(60)),
    )
    assert done.returncode == 2, done.stderr
    assert "--num_machines 2 without --main_process_ip" in done.stderr
    assert not list(tmp_path.iterdir())  # no rank started
    assert time.monotonic() - start < float(scaled_seconds(60))
