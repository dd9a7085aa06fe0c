"""A script that never calls `destroy_process_group` still exits cleanly when the engine created the group.

Why this matters: a gloo group left alive at interpreter exit can abort the process ("terminate called without
an active exception", SIGABRT) while gloo's threads are torn down, so `accelerate-zero launch` reported about one
finished run in 30 as failed (tests/integration/test_launch.py on CI). Each case runs a one-process script in a
fresh interpreter and records, from an exit handler registered before the engine's (exit handlers run last-in
first-out), whether the group was still alive after the engine's handler ran.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch
    import torch.distributed as dist
    from accelerate_zero.engine.groups import init_data_parallel_group

    report = sys.argv[1]
    atexit.register(lambda: open(report, "w").write(str(dist.is_initialized())))
    init_data_parallel_group(torch.device("cpu"))
    assert dist.is_initialized()
    if sys.argv[2] == "raise":
        raise RuntimeError("the training script fails")
    """
)


@pytest.mark.parametrize(
    ("ending", "returncode", "alive_at_exit"),
    [("normal", 0, "False"), ("raise", 1, "True")],
)
def test_the_group_the_engine_created_is_destroyed_at_a_normal_exit_only(
    tmp_path: Path, ending: str, returncode: int, alive_at_exit: str
) -> None:
    report = tmp_path / "alive_at_exit"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(report), ending],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == returncode, done.stderr
    # After an uncaught exception the group is left to the launcher: a collective teardown could wait on a peer.
    assert report.read_text() == alive_at_exit
