"""What stays outside torch.compile's graphs: the engine's collectives, stage 3's hooks, the recording forward.

[Note: compiling around ZeRO's hooks]
A model compiled whole (`torch.compile(model)`, `model.compile()`, before or after the engine is built) has dynamo
trace every sub-module's call, hooks included. Stage 3's hooks gather, release and prefetch units: Python state,
collectives and `param.data` re-pointing, none of which belongs in a graph (traced, a release became an in-place
`set_` on every parameter, and backward failed on the bumped version counters; a traced gather failed in the
all-gather). So, as FSDP2 does with its own hooks (`torch._dynamo.config.skip_fsdp_hooks`):
- the unit hooks are `outside_compile`: where dynamo meets one it ends the graph, runs the hook eagerly and
  resumes after it, so each unit's forward is a graph of its own, with no break inside, and the breaks fall on
  the unit boundaries (the hooks of the module a compiled call starts at run before dynamo, without a break);
- every collective of engine/collectives.py is `outside_compile` too: a collective a model's forward issues (a
  Ulysses all-to-all, expert parallelism's dispatch) breaks the graph there and runs eagerly;
- the entry hooks of the modules inside a unit ([Note: sub-module calls] in engine/stage3/schedule.py) are traced
  as nothing: inside a compiled unit they are always nested in a forward that holds their units (the case their
  eager fast path handles), and the hooks of the module a compiled call starts at run before dynamo, eagerly
  (not supported: a sub-module called alone *inside* compiled code, e.g. `torch.compile(model.lm_head)` of a
  torch.nn module, whose hooks dynamo inlines: its units are not gathered and tracing fails on the empty
  placeholders, a shape error);
- the first forward of each entry point, which records the execution order and watches for parameters used
  outside their unit through a TorchFunctionMode (engine/stage3/external.py), runs eagerly
  (`EagerWhileRecording`): dynamo would otherwise trace the mode's gathers, and a graph compiled under the mode is
  guarded on it and compiled again without it. Compilation starts at the second forward.
`engine.compile()` (engine/compiling.py) compiles per unit instead, the way torchtitan compiles each block beside
FSDP2: every hook then runs outside the compiled regions and a decoder layer is one graph with no break at all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch


F = TypeVar("F", bound=Callable[..., Any])


def outside_compile(fn: F) -> F:
    """`fn`, run eagerly even when code torch.compile traces calls it ([Note: compiling around ZeRO's hooks]).

    torch's lazy form of `torch.compiler.disable`: torch._dynamo is imported at the first call, not when a module
    decorates its functions (importing it costs seconds, and the engine does not need it unless something compiles).
    """
    return torch._disable_dynamo(fn)  # type: ignore[return-value]


def tracing() -> bool:
    """True while dynamo traces the calling code (the check itself becomes a constant of the graph)."""
    return torch.compiler.is_compiling()


class EagerWhileRecording:
    """Runs every compiled region eagerly between `enter()` and `exit()` ([Note: compiling around ZeRO's hooks]).

    Nothing to do when torch._dynamo was never imported: then nothing is compiled.
    """

    def __init__(self) -> None:
        self._stance: Any = None

    def enter(self) -> None:
        if self._stance is None and "torch._dynamo" in sys.modules and not tracing():
            # set_stance applies at once and remembers the stance it replaced; __exit__ puts that one back.
            self._stance = torch.compiler.set_stance("force_eager")

    def exit(self) -> None:
        if self._stance is not None:
            stance, self._stance = self._stance, None
            stance.__exit__(None, None, None)
