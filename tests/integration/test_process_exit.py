"""A script that never calls `destroy_process_group` still exits cleanly once an engine ran on the group.

Why this matters: a gloo group left alive at interpreter exit can abort the process ("terminate called without
an active exception", SIGABRT): a gloo thread releasing a finished collective's tensor needs the GIL while the
interpreter finalizes (seen under gdb). `accelerate-zero launch` then reported finished runs as failed: 1 launch
in 30 of tests/integration/scripts/train_tiny.py, 4 in 28 of the plain accelerate loop (whose group accelerate
creates), 0 in 46 with the engine's exit handler. Each case runs a one-process script in a fresh interpreter and
records, from an exit handler registered before the engine's (exit handlers run last-in first-out), whether the
group was still alive after the engine's handler ran.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.processes import Started, started_together


REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch
    import torch.distributed as dist
    from accelerate_zero.engine.groups import init_data_parallel_group

    report = sys.argv[1]
    atexit.register(lambda: open(report, "w").write(str(dist.is_initialized())))
    if sys.argv[3] == "script":  # as accelerate's PartialState does before the engine exists
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_data_parallel_group(torch.device("cpu"))
    assert dist.is_initialized()
    if sys.argv[2] == "raise":
        raise RuntimeError("the training script fails")
    """
)


CASES = [
    (ending, returncode, alive_at_exit, creator)
    for ending, returncode, alive_at_exit in [("normal", 0, "False"), ("raise", 1, "True")]
    for creator in ("engine", "script")
]


@pytest.fixture(scope="module")
def exits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], tuple[Started, Path]]]:
    """Every case's interpreter, started together (tests/helpers/processes.py), with the file its handler writes."""
    folder = tmp_path_factory.mktemp("exits")
    reports = {(ending, creator): folder / f"{ending}_{creator}" for ending, _, _, creator in CASES}
    commands = {case: [sys.executable, "-c", SCRIPT, str(report), *case] for case, report in reports.items()}
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    with started_together(commands, cwd=REPO, env=env) as started:
        yield {case: (started[case], reports[case]) for case in reports}


@pytest.mark.parametrize(("ending", "returncode", "alive_at_exit", "creator"), CASES)
def test_the_group_is_destroyed_at_a_normal_exit_only(
    exits: dict[tuple[str, str], tuple[Started, Path]], ending: str, returncode: int, alive_at_exit: str, creator: str
) -> None:
    started, report = exits[ending, creator]
    done = started.finished(timeout=120)
    assert done.returncode == returncode, done.stderr
    # After an uncaught exception the group is left to the launcher: a collective teardown could wait on a peer.
    assert report.read_text() == alive_at_exit
