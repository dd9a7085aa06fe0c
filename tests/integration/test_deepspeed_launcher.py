"""`accelerate-zero deepspeed`, DeepSpeed's launcher command line: real 2-process CPU launches of
tests/integration/scripts/deepspeed_train.py (the feature is the launch itself).

One launch checks what each process gets (`--local_rank=<i>` before the script's arguments, DeepSpeed's
environment, the config from `--deepspeed_config`); a second one, whose rank 1 exits with 3 before importing torch,
checks that the launcher stops rank 0 and returns 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelerate_zero.cli.main import main
from tests.helpers.dist import free_port, scaled_seconds


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "scripts" / "deepspeed_train.py"


@pytest.fixture(autouse=True)
def _launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_ZERO_PG_TIMEOUT", scaled_seconds(60))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.chdir(REPO)


def test_deepspeed_command_line_launches_every_rank_with_local_rank(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    port = str(free_port())
    code = main(
        ["deepspeed", "--num_gpus", "2", "--master_port", port, str(SCRIPT)]
        + ["--deepspeed", "--deepspeed_config", str(config), "--out", str(tmp_path)]
    )
    assert code == 0
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["argv"][:1] == [f"--local_rank={rank}"]  # DeepSpeed passes it first
        assert record["local_rank_given"] == record["args_local_rank"] == rank
        assert record["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_SIZE": "2",
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
        }
        assert (record["world_size"], record["stage"], record["steps"]) == (2, 2, 1)


def test_a_failing_rank_stops_the_others_and_its_code_is_returned(tmp_path: Path) -> None:
    port = str(free_port())
    code = main(
        ["deepspeed", "--num_gpus", "2", "--master_port", port, str(SCRIPT), "--out", str(tmp_path)]
        + ["--fail_rank", "1"]
    )
    assert code == 3
    assert not (tmp_path / "rank0.json").exists()
