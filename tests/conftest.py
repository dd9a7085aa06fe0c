"""Session-wide test setup: the `slow` tier and how many rank processes the session started
(tests/helpers/dist.py keeps a pool of ranks per world size, so this stays a few per world size unless a test
failed or asked for fresh ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.heap import freeze_new_imports


INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Integration tests start real launches and Trainer runs: minutes together. `-m "not slow"` leaves them out
    # for a quick development loop; the default command runs everything.
    import torch

    no_cuda = pytest.mark.skip(reason="gpu: needs a CUDA device (runs on a GPU machine: pytest tests/gpu)")
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # The pytest process lives as long as the ranks and imports as much (tests/helpers/heap.py).
    freeze_new_imports()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from tests.helpers.dist import pool_statistics

    stats = pool_statistics()
    if stats["calls"]:
        terminalreporter.write_line(
            f"distributed tests: {stats['calls']} bodies on {stats['rank_bodies']} ranks, "
            f"{stats['processes']} rank processes started"
        )
