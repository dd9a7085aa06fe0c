"""A 2-process save killed for real (SIGKILL, every process of the job) leaves the previous checkpoint loadable.

tests/unit/test_checkpoint_io.py raises an exception at every rename of a one-process save; here real 2-process jobs
(tests/integration/scripts/killed_save.py, each rank a process started with torchrun's variables) train a stage-3
engine, save checkpoint A, train on and start saving B, and stop inside B's save at one of four points: a rank
half-way through writing its file (the other waiting for it), B's folder in place before `latest` names it, B
replacing A under the same tag, and an asynchronous save of B whose writer thread is half-way through a rank file
while training goes on. The test kills every process of the job with SIGKILL (no exception handler, exit handler
or destructor runs); a fresh job (the suite's pooled ranks: other processes than the killed ones) must load A,
bit-identical and with A's counters, from `latest`; and its next save must publish and clear what the killed one
left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import free_port, scaled_seconds
from tests.integration.planned_launch import run_as_planned


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "scripts" / "killed_save.py"
POINTS = ("rank_file", "publish", "resave", "async")
JOB_SECONDS = 120  # a few seconds idle: a job that hangs fails this test, not the session


class _Job:
    """The 2 rank processes of one job, started as torchrun starts them (its variables; a session each, so no
    signal meant for one reaches the other); output in <out>/job.log (jobs run side by side: no pipe to fill)."""

    def __init__(self, out: Path, *args: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        self.log = open(out / "job.log", "w")  # noqa: SIM115 - closed in kill()
        self.ranks = []
        for rank in range(2):
            env = {**os.environ, "PYTHONPATH": str(REPO), "ACCELERATE_ZERO_PG_TIMEOUT": scaled_seconds(60)}
            env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2")
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
            command = [sys.executable, str(SCRIPT), "--out", str(out), *args]
            self.ranks.append(
                subprocess.Popen(
                    command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def running(self) -> bool:
        return all(rank.poll() is None for rank in self.ranks)

    def kill(self) -> list[int | None]:
        """SIGKILL to every rank still running (nothing gets to clean up); each rank's exit status, once it is gone."""
        for rank in self.ranks:
            if rank.poll() is None:
                os.kill(rank.pid, signal.SIGKILL)
        self.log.close()
        return [rank.wait(timeout=30) for rank in self.ranks]


def _kill_inside_the_save(job: _Job, out: Path, point: str) -> dict[str, Any]:
    deadline = time.monotonic() + JOB_SECONDS
    try:
        while not (out / "paused").exists():
            if not job.running() or time.monotonic() > deadline:
                raise AssertionError(
                    f"the job did not stop inside the save at {point!r}:\n{(out / 'job.log').read_text()}"
                )
            time.sleep(0.1)
    finally:
        statuses = job.kill()
    assert sorted(int(path.read_text()) for path in out.glob("pid_rank*")) == sorted(r.pid for r in job.ranks)
    folder = out / "ckpt"
    partial = folder / ".global_step4.partial"
    return {
        "statuses": statuses,  # -SIGKILL for both: the kill ended them, neither had exited on its own
        "latest": (folder / "latest").read_text(),
        "entries": sorted(os.listdir(folder)),
        "partial": sorted(os.listdir(partial)) if partial.is_dir() else None,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("killed_save")
    jobs = {point: _Job(root / point, "--pause", point) for point in POINTS}  # side by side: they wait to die
    try:
        killed = {point: _kill_inside_the_save(job, root / point, point) for point, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()  # a job the loop above did not reach (it raised)
    (root / "loader").mkdir()
    run_as_planned(SCRIPT, [({}, ["--out", str(root / "loader"), "--load", *(str(root / p) for p in POINTS)])])
    loaded = {p: [json.loads((root / p / f"loaded_rank{r}.json").read_text()) for r in range(2)] for p in POINTS}
    return root, killed, loaded


# What the killed save left: (the folder `latest` names, every entry of the checkpoint folder).
LEFT_BEHIND = {
    "rank_file": ("global_step2", [".global_step4.partial", "global_step2", "latest"]),
    "publish": ("global_step2", ["global_step2", "global_step4", "latest"]),
    "resave": (".last.old", [".last.old", ".last.trash", "last", "latest"]),
    "async": ("global_step2", [".global_step4.partial", "global_step2", "latest"]),
}


@pytest.mark.parametrize("point", POINTS)
def test_the_job_died_inside_the_save_of_b(runs: Any, point: str) -> None:
    _, killed, _ = runs
    assert killed[point]["statuses"] == [-signal.SIGKILL, -signal.SIGKILL]
    latest, entries = LEFT_BEHIND[point]
    assert (killed[point]["latest"], killed[point]["entries"]) == (latest, entries)
    if point in ("rank_file", "async"):  # rank 1 died half-way through its file, rank 0 waiting: no meta.json yet
        assert "rank00001.safetensors" in killed[point]["partial"] and "meta.json" not in killed[point]["partial"]


@pytest.mark.parametrize("point", POINTS)
def test_a_fresh_job_loads_checkpoint_a_from_latest(runs: Any, point: str) -> None:
    _, killed, loaded = runs
    for result in loaded[point]:
        assert "error" not in result, result["error"]
        assert result["loaded"] == killed[point]["latest"]
        assert result["client_state"] == {"checkpoint": "A"}
        assert result["global_steps"] == 2
        assert result["equals_a"]  # every rank's gathered weights are A's, bit for bit
    if point in ("rank_file", "async"):
        for result in loaded[point]:
            assert result["load_b"].startswith("FileNotFoundError: checkpoint folder"), result["load_b"]


@pytest.mark.parametrize("point", POINTS)
def test_the_next_save_publishes_and_clears_what_the_killed_one_left(runs: Any, point: str) -> None:
    _, _, loaded = runs
    assert "error" not in loaded[point][0], loaded[point][0]["error"]
    after = loaded[point][0]["after_next_save"]
    expected = {
        "rank_file": ("global_step3", ["global_step2", "global_step3", "latest"]),
        "publish": ("global_step3", ["global_step2", "global_step3", "global_step4", "latest"]),
        "resave": ("last", ["last", "latest"]),
        "async": ("global_step3", ["global_step2", "global_step3", "latest"]),
    }[point]
    assert (after["latest"], after["entries"]) == expected
