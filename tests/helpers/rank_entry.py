"""The function a pooled rank process starts in (tests/helpers/dist.py starts it with the `spawn` method).

It lives apart from dist.py so that the rank imports torch (through rank_process.py) with the garbage collector off: an
import that creates a few million objects triggers a full collection each time the heap grows by a quarter, about
1 s of CPU per rank spent revisiting half-imported modules (see the note in tests/helpers/heap.py).
"""

from __future__ import annotations

import gc
from typing import Any


def start_rank(*args: Any) -> None:
    gc.disable()
    from tests.helpers.rank_process import rank_loop

    gc.enable()
    rank_loop(*args)
