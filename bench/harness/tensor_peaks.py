"""The peak of live torch CPU tensor bytes per phase, exact where RSS is not (allocator arenas, page granularity).

[Note: live tensor bytes from a counting allocator] harness/counting_allocator.cpp wraps torch's CPU allocator (set
with a higher priority than the default one): every storage made after `install()` adds its bytes to one counter
when it is allocated and takes them off when it is freed, on whatever thread, and the counter keeps its highest
value since the last `reset_peak()`. That counts the engine's, FSDP2's and autograd's tensors by one rule, and the
collectives' own buffers too (gloo's reduce-scatter clones its input and its all-gather stages its output on gloo's
threads; both allocate through torch). Our engine's large host temporaries are not made by the allocator: they are
anonymous mappings viewed by `torch.frombuffer` ([Note: host temporaries in huge pages] in engine/scratch.py), so
`count_engine_mappings()` counts each mapping from its creation until it is unmapped. Not counted: memory that is
not a torch storage (gloo's own scratch, Python objects, the C allocator's free lists), for every system alike.
torch's profiler (`profile_memory=True`) was tried first and lost frees: under FSDP2 its running sum grew by
megabytes every micro-step (a free is reported only where the profiler's state is set, which is not every thread
gloo frees on).

The extension is built once into bench/out/ (a C++ compiler and torch's headers; about two minutes on two busy
cores) by `build()`, which the driver calls before it starts the ranks; each rank then loads the built module.
Only torch and the standard library are imported at module level.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any


SOURCE = Path(__file__).with_name("counting_allocator.cpp")
BUILD = Path(__file__).resolve().parents[1] / "out" / "counting_allocator"


def build() -> Any:
    """The compiled extension (built on the first call, loaded from bench/out/ afterwards)."""
    from torch.utils.cpp_extension import load

    BUILD.mkdir(parents=True, exist_ok=True)
    return load("az_counting_allocator", [str(SOURCE)], build_directory=str(BUILD), extra_cflags=["-O2"])


class TensorPeaks:
    """Counts every CPU storage made from `start()` on; `phase()` returns the peak of live bytes since the last
    call (or `start()`) and starts the next phase at what is alive now; `live()` is what is alive now."""

    def __init__(self) -> None:
        self._module: Any = None

    def start(self, engine_mappings: bool = False) -> TensorPeaks:
        """`engine_mappings`: count accelerate_zero's host mappings too (`count_engine_mappings`)."""
        self._module = build()
        self._module.install()
        if engine_mappings:
            count_engine_mappings(self._module)
        self._module.reset_peak()
        return self

    def phase(self) -> int:
        peak = self._module.peak_bytes()
        self._module.reset_peak()
        return peak

    def live(self) -> int:
        return self._module.live_bytes()


def count_engine_mappings(module: Any) -> None:
    """Makes engine/scratch.py's anonymous mappings count as live tensor bytes while they are mapped.

    A run-time wrapper in the benchmark's rank only: scratch.py's `mmap` is replaced by the same module whose `mmap`
    also counts the mapping's bytes and takes them off when the mapping is freed (after the last tensor viewing it).
    """
    import mmap

    from accelerate_zero.engine import scratch

    def counted(*args: Any, **kwargs: Any) -> mmap.mmap:
        region = mmap.mmap(*args, **kwargs)
        module.account(len(region))
        weakref.finalize(region, module.account, -len(region))
        return region

    names = {name: getattr(mmap, name) for name in dir(mmap) if not name.startswith("_")}
    scratch.mmap = SimpleNamespace(**{**names, "mmap": counted})
