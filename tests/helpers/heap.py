"""Keeps Python's cyclic garbage collector off the libraries a long-lived test process has imported.

[Note: why the suite's processes freeze what their imports left]
A pooled rank and the pytest process live for the whole session and import torch, transformers, accelerate, TRL,
DeepSpeed and our package: a few million objects that never die. CPython's full (generation 2) collection visits
every one of them each time, and runs whenever the objects created since the last one reach a quarter of those that
survived it; measured on four test files (engine parity, layout compositions, model zoo, Trainer; 20 bodies on 18
ranks), the collector took 60 of the 311 CPU seconds of all processes, almost all of it in full collections of
imported objects (0.2-0.8 s each). `gc.freeze()` moves every object alive now to a generation the collector never
visits, so after a collection that frees the garbage of the body that just ran, freezing once per new batch of
imports leaves only a body's own objects to visit (the same files: 34 s of 262). The body's garbage is collected
before each freeze, and objects created later are collected as usual; but an object alive at a freeze that later
becomes garbage in a reference cycle is never collected (what earlier bodies left in module-level caches).
`gc.get_objects()` does not list frozen objects, so a test that looks for its own objects there finds them (they
are created after the freeze).
"""

from __future__ import annotations

import gc
import sys


_FROZEN_AT_MODULE_COUNT = [0]


def freeze_new_imports() -> None:
    """After a test: if modules were imported since the last call, frees garbage, then freezes everything alive."""
    if len(sys.modules) == _FROZEN_AT_MODULE_COUNT[0]:
        return
    gc.collect()
    gc.freeze()
    _FROZEN_AT_MODULE_COUNT[0] = len(sys.modules)
