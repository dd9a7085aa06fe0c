"""`accelerate-zero launch` refuses, before starting any process, what would stop every rank at startup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelerate_zero.cli.main import main
from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.integrations.accelerate.launch_checks import machine_problems, node_span_warnings
from accelerate_zero.integrations.accelerate.launch_config import nvme_path_problems, resolve_leaving_auto


pytestmark = pytest.mark.usefixtures("clean_launch_env")  # tests/unit/conftest.py


def _fail_if_started(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(args: object) -> int:
        raise AssertionError("a process was started")

    monkeypatch.setattr("accelerate_zero.integrations.accelerate.launcher._run_accelerate_launcher", started)


def test_batch_rule_at_the_launch_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fail_if_started(monkeypatch)
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 8,
                "zero_optimization": {"stage": 2},
            }
        )
    )
    flags = ["launch", "--num_processes", "2", "--deepspeed_config_file", str(ds), "train.py"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "nothing was started" in err
    assert (
        "train_batch_size=32 != train_micro_batch_size_per_gpu=4 * gradient_accumulation_steps=8 * world_size=2" in err
    )
    # the same file holds at world size 1 (32 = 4 x 8 x 1): then the launch goes ahead
    monkeypatch.setattr("accelerate_zero.integrations.accelerate.launcher._run_accelerate_launcher", lambda args: 0)
    assert main(["launch", "--num_processes", "1", "--deepspeed_config_file", str(ds), "train.py"]) == 0


def test_nvme_path_below_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fail_if_started(monkeypatch)
    blocker = tmp_path / "weights.bin"
    blocker.write_text("not a folder")
    flags = ["launch", "--num_processes", "2", "--zero_stage", "2", "--offload_optimizer_device", "nvme"]
    assert main([*flags, "--offload_optimizer_nvme_path", str(blocker / "swap"), "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"zero_optimization.offload_optimizer.nvme_path='{blocker / 'swap'}'" in err
    assert f"'{blocker}' is a file" in err


def test_nvme_path_problems_only_for_paths_that_cannot_be_folders(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()

    def config(path: Path) -> dict:
        return {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(path)}}}

    assert nvme_path_problems(config(tmp_path / "dir" / "not" / "yet")) == []
    assert nvme_path_problems(config(tmp_path / "dir")) == []
    assert len(nvme_path_problems(config(tmp_path / "file"))) == 1
    assert len(nvme_path_problems(config(tmp_path / "file" / "a" / "b"))) == 1


def test_resolve_leaving_auto_keeps_autos_and_checks_the_rest() -> None:
    resolved = resolve_leaving_auto({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 3)
    assert resolved.auto_keys == ["gradient_accumulation_steps"]
    assert resolved.config["gradient_accumulation_steps"] == "auto"
    assert resolved.config["train_batch_size"] == 12  # inferred with accumulation 1
    with pytest.raises(ZeroConfigError, match="world_size=3"):
        resolve_leaving_auto(
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": "auto"}, 3
        )


@pytest.mark.parametrize(
    ("exit_codes", "expected"),
    [((2, 2), 2), ((2, -15), 2), ((1, -15), 1), ((2, 1), 1)],
)
def test_a_command_line_error_of_the_script_is_one_line(
    exit_codes: tuple[int, int], expected: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import argparse

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from accelerate_zero.integrations.accelerate import launcher

    failures = {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in enumerate(exit_codes)}

    def failing_launch(args: object) -> None:
        raise ChildFailedError("train.py", failures)

    monkeypatch.setattr(launcher, "launch_command", failing_launch)
    assert launcher._run_accelerate_launcher(argparse.Namespace()) == expected
    one_line = "the script exited with code 2 (command-line error) on rank 0" in caplog.text
    assert one_line == (expected == 2)
    assert ("Root Cause" in caplog.text) == (expected != 2)


def _alst_yaml(tmp_path: Path, processes: int, **sizes: int) -> str:
    """accelerate_configs/zero3_sp2_demo.yaml (DeepSpeed ALST's recipe) on `processes`, with more
    `parallelism_config_*` sizes."""
    import yaml

    demo = Path(__file__).resolve().parents[2] / "accelerate_configs" / "zero3_sp2_demo.yaml"
    config = yaml.safe_load(demo.read_text())
    config["num_processes"] = processes
    config["parallelism_config"].update({f"parallelism_config_{key}": value for key, value in sizes.items()})
    path = tmp_path / f"alst_{processes}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_parallelism_block_is_checked_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """[Note: data parallelism derived from the processes]: an ALST YAML with `dp_shard_size: 1` on 4 processes
    passes validate, doctor and the launcher (dp = 4 / 2), and every rank then trains; a size that contradicts
    processes / sp_size fails there, naming the value and the fix, instead of on every rank."""
    monkeypatch.setattr("accelerate_zero.integrations.accelerate.launcher._run_accelerate_launcher", lambda args: 0)
    works = _alst_yaml(tmp_path, 4, dp_shard_size=1)
    for command in (["validate", works], ["doctor", works], ["launch", "--config_file", works, "train.py"]):
        assert main(command) == 0, (command, capsys.readouterr().err)
    capsys.readouterr()
    _fail_if_started(monkeypatch)
    contradicting = _alst_yaml(tmp_path, 4, dp_shard_size=4)
    three = _alst_yaml(tmp_path, 3)
    for command in (["validate", contradicting], ["doctor", contradicting], ["launch", "--config_file", three, "x"]):
        assert main(command) == 2, command
    out, err = capsys.readouterr()
    err += out  # doctor reports on stdout
    assert (
        err.count(
            "dp_replicate_size=1, dp_shard_size=4, sp_size=2) on 4 processes: data parallelism is processes / sp_size = 2"
        )
        == 2
    )
    assert "remove dp_shard_size (it is derived: 2) or set it to 2" in err
    assert "ParallelismConfig(sp_size=2) on 3 processes" in err and "train_batch_size" not in err


# ---- machine flags and node layout ([Note: launch mistakes that hang] in launch_checks.py) ---------------------


def test_machine_flags_that_would_hang_are_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fail_if_started(monkeypatch)
    cases = {
        ("--machine_rank", "2", "--main_process_ip", "10.0.0.1"): "--machine_rank 2 is outside --num_machines 2",
        ("--machine_rank", "1"): "--num_machines 2 without --main_process_ip",
        ("--machine_rank", "0"): "--num_machines 2 without --main_process_ip",
    }
    for flags, message in cases.items():
        common = ["launch", "--num_processes", "4", "--num_machines", "2", "--zero_stage", "1"]
        assert main([*common, *flags, "t.py"]) == 2
        assert message in capsys.readouterr().err


def test_machine_problems_name_the_flag_and_the_fix() -> None:
    assert machine_problems(0, 1, None) == []
    assert machine_problems(1, 2, "10.0.0.1") == []
    assert machine_problems(-1, 1, None) == [
        "--machine_rank -1 is outside --num_machines 1: machines are numbered 0 to 0; give each machine its own "
        "--machine_rank in that range"
    ]
    (problem,) = machine_problems(1, 2, "")
    assert problem.startswith("--num_machines 2 without --main_process_ip: every machine (machine rank 1 too)")


def test_hierarchical_groups_spanning_nodes_are_warned_with_their_cost() -> None:
    """DeepSpeed builds hpZ groups of consecutive ranks whatever the node and says nothing: accepted here too, with
    the cost named (backward's all-gathers cross nodes)."""

    def warnings(zero: dict, world_size: int, machines: int) -> list[str]:
        config = ZeroConfig.from_any({"zero_optimization": {"stage": 3, **zero}})
        return node_span_warnings(config, world_size, machines)

    assert warnings({"zero_hpz_partition_size": 8}, 16, 2) == []
    assert warnings({"zero_hpz_partition_size": 4}, 16, 2) == []
    assert warnings({"zero_hpz_partition_size": 16}, 16, 1) == []
    (hpz,) = warnings({"zero_hpz_partition_size": 16}, 16, 2)
    assert hpz.startswith("zero_optimization.zero_hpz_partition_size=16 spans nodes (8 processes per node)")
    assert "backward's all-gathers cross nodes" in hpz and "set it to 8" in hpz
    assert warnings({"zero_hpz_partition_size": 3}, 12, 2) == []  # 6 per node: two groups of 3 in each node
    (mics,) = warnings({"mics_shard_size": 4}, 6, 2)  # 3 per node: groups of 4 straddle nodes
    assert mics.startswith("zero_optimization.mics_shard_size=4 spans nodes (3 processes per node)")


def test_the_launcher_warns_about_hpz_across_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("accelerate_zero.integrations.accelerate.launcher._run_accelerate_launcher", lambda args: 0)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}))
    flags = ["--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1", "--machine_rank", "0"]
    with caplog.at_level("WARNING", logger="accelerate_zero.integrations.accelerate.launcher"):
        assert main(["launch", *flags, "--deepspeed_config_file", str(ds), "t.py"]) == 0
    assert "zero_hpz_partition_size=4 spans nodes (2 processes per node)" in caplog.text
