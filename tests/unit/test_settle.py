"""tests/helpers/settle.py: a reading taken while another thread still holds a tensor for a moment (as gloo's worker
thread holds a finished collective's tensors after `wait()` returned) waits for the thread to let go; a tensor kept
for good is read as alive, without waiting for the longest time."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from tests.helpers import settle
from tests.helpers.settle import settled


def test_a_tensor_another_thread_drops_a_moment_later_is_read_as_gone() -> None:
    holder, first_read = [torch.ones(4)], threading.Event()
    ref = weakref.ref(holder[0])

    def let_go_after_the_first_reading() -> None:
        first_read.wait()
        time.sleep(0.01)
        holder.clear()

    def alive() -> bool:
        answer = ref() is not None
        first_read.set()
        return answer

    thread = threading.Thread(target=let_go_after_the_first_reading)
    thread.start()
    try:
        assert settled(alive) is False  # the first reading found it alive
    finally:
        first_read.set()
        thread.join()


def test_a_tensor_kept_for_good_is_read_as_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    # An answer that holds still is returned after QUIET_SECONDS, not at the deadline (made long, so that a loaded
    # machine's slow collections cannot pass for waiting on it).
    monkeypatch.setattr(settle, "LONGEST_SECONDS", 60.0)
    kept = torch.ones(4)
    ref = weakref.ref(kept)
    started = time.monotonic()
    assert settled(lambda: ref() is not None) is True
    assert time.monotonic() - started < 30.0
    del kept
