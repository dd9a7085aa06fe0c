"""What an optimizer's step reads: each element alone, each tensor whole, or something the engine cannot give it.

[Note: which optimizers step flat shards]
ZeRO hands the optimizer this rank's slice of a flat buffer of parameters. That is right for an optimizer whose update
of an element depends only on that element's gradient and state (AdamW, SGD, ...): every element is stepped exactly
as in one process, whichever rank holds it. It is silently wrong for an optimizer that reads a tensor's shape or
looks across its elements: Adafactor keeps its second moment per row and per column and scales by the tensor's RMS,
Muon orthogonalises each matrix, bitsandbytes quantises the state in blocks of the flattened tensor. Such an
optimizer must see each parameter whole, in its own shape (engine/owned_step.py). The rule, decided once when the
optimizer is handed to the engine:
- ELEMENTWISE: torch.optim's classes listed in `ELEMENTWISE_CLASSES` (their foreach and fused forms are the same
  classes), and any class that declares `zero_elementwise = True` (see `ELEMENTWISE_ATTRIBUTE`): flat shards, as
  before. The class itself must be listed or declare it: a subclass may change the step, so it is not assumed.
- WHOLE_TENSORS: everything else, including every class the engine does not know (correct by default).
- Refused before the first step (`StepKindError`): a step that needs a closure (LBFGS re-evaluates the loss several
  times per step, and its state is one vector across all parameters) and SparseAdam (sparse gradients only).
`zero_allow_untested_optimizer` keeps DeepSpeed's meaning (accept a class DeepSpeed does not know) and never moves an
optimizer to flat shards.
"""

from __future__ import annotations

import enum
import inspect
from typing import Any

import torch


ELEMENTWISE_ATTRIBUTE = "zero_elementwise"
"""A class attribute an optimizer sets to True to declare that its step updates each element from that element's
gradient and state alone (then it steps flat shards, the fastest layout). Example::

    class Lion(torch.optim.Optimizer):
        zero_elementwise = True  # sign(beta1 * m + (1 - beta1) * g), element by element
"""

ELEMENTWISE_CLASSES: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adadelta")
)
"""torch.optim's classes whose step is element by element (every `foreach`/`fused`/`capturable` form included)."""

_REFUSED: dict[str, str] = {
    "LBFGS": "its step() re-evaluates the loss through a closure several times per step and keeps its history as one "
    "flat vector across all parameters, which a sharded engine cannot give it",
    "SparseAdam": "it only takes sparse gradients, and the engine reduces dense ones",
}


class StepKind(enum.Enum):
    ELEMENTWISE = "elementwise"
    """Each element from its own gradient and state: steps flat shards."""
    WHOLE_TENSORS = "whole_tensors"
    """Reads a tensor's shape or other elements: steps whole parameters on an owner rank."""


class StepKindError(ValueError):
    """An optimizer the engine cannot step correctly in any layout (named, with the reason and the fix)."""


def step_kind(optimizer: torch.optim.Optimizer) -> StepKind:
    """How `optimizer` (a single optimizer, not a chain) must be stepped ([Note: which optimizers step flat shards]).

    Raises:
        StepKindError: the optimizer needs a closure or sparse gradients.
    """
    cls = type(optimizer)
    refusal = refusal_of(cls)
    if refusal is not None:
        raise StepKindError(
            f"{describe(cls)} cannot train under accelerate_zero: {refusal}. Use an optimizer whose step() takes "
            "the gradients already computed (AdamW, SGD, Adafactor, Muon, ...)"
        )
    if cls in ELEMENTWISE_CLASSES or cls.__dict__.get(ELEMENTWISE_ATTRIBUTE) is True:
        return StepKind.ELEMENTWISE
    return StepKind.WHOLE_TENSORS


def refusal_of(cls: type) -> str | None:
    """Why the engine cannot step optimizers of class `cls` at all (None: it can)."""
    refusal = _REFUSED.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
    if refusal is None and _needs_closure(cls):
        refusal = "its step() requires a closure (it re-evaluates the loss), which the engine's step() cannot pass"
    return refusal


def describe(cls: type) -> str:
    """`module.Class`, as error messages name an optimizer class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _needs_closure(cls: type) -> bool:
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def is_elementwise(optimizer: Any) -> bool:
    """True for an optimizer (not a chain) that steps flat shards."""
    return step_kind(optimizer) is StepKind.ELEMENTWISE
