"""Partitioned construction: a model built inside the context is partitioned as it is built (DeepSpeed's `zero.Init`).

[Note: partitioning while a model is built]
DeepSpeed wraps every `nn.Module.__init__` for the duration of `zero.Init`; we do not patch torch. Instead the
context installs, for its duration only, torch's public global registration hooks and one TorchFunctionMode:
- `register_module_parameter_registration_hook` records the parameters registered while it is active;
- `register_module_module_registration_hook` fires when a built module is assigned to its parent
  (`self.mlp = MLP(...)`, `ModuleList([...])`): the child's constructor has returned, so its recorded parameters
  are partitioned then ([Note: parameters partitioned at construction] in init_shards.py). What is never attached
  (the root) is partitioned when the context exits;
- the mode keeps code that runs later in the construction exact: a parent that re-initialises a child's weight
  (`nn.init.zeros_(self.out.weight)`), transformers' `post_init()` over the whole model, or a read of a weight.
  A torch function that touches a partitioned parameter gets its full values back in the parameter first, on the
  device and in the dtype it was built with (so a CPU build re-initialised on a GPU machine draws from the CPU's
  random generator, as an eager build does): allocated uninitialised when the function overwrites all of it (every `torch.nn.init` function; `zero_`,
  `fill_`, `normal_`, `uniform_`, `copy_` on it), gathered otherwise; shape queries are answered from the recorded
  shape. It is partitioned again (this rank's slice taken, no communication) when another partitioned parameter is
  touched, a module is attached, or the context exits, so one parameter at a time is whole.
Every rank runs the same construction code with the same random state, so the values equal an eager build's.

Limits: writes outside the context through a placeholder are lost, as with DeepSpeed (write inside
`GatheredParameters(params, modifier_rank=0)`); a tensor kept from `param.data` while its parameter was whole
stops reaching the parameter once it is partitioned again; parameters created on the meta device (transformers'
`from_pretrained` builds on meta) are left as they are: use `accelerate_zero.from_pretrained` for partitioned
loading.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from accelerate_zero.engine import collectives
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.stage3 import init_shards


logger = logging.getLogger(__name__)

_TENSOR = torch._C.TensorBase
_SHAPE_DESCRIPTORS = (_TENSOR.shape, _TENSOR.ndim)
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "nelement", "__len__"})
_OVERWRITING_METHODS = frozenset({"zero_", "fill_", "normal_", "uniform_", "copy_", "random_", "bernoulli_"})
_PLACEHOLDER_DESCRIPTORS = frozenset(
    {"dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_cuda", "is_meta", "name"}
)
_PLACEHOLDER_METHODS = frozenset({"requires_grad_", "is_floating_point", "is_complex", "element_size", "get_device"})


class PartitionedConstruction:
    """Partitions every module built inside it as it is built ([Note: partitioning while a model is built]).

    Args:
        dp: the ranks the parameters are partitioned over.
        dtype: floating-point parameters are kept in it; None keeps their own.
        device: where the model computes (placeholders live there; full values are gathered there).
        shard_device: where each rank's slices live (the compute device, or the host).
        pin_memory: host slices are page-locked (with an accelerator).

    Nested contexts: only the outermost one acts, as in DeepSpeed.
    """

    _active: ClassVar[PartitionedConstruction | None] = None

    def __init__(
        self,
        dp: DataParallelGroup,
        *,
        dtype: torch.dtype | None,
        device: torch.device,
        shard_device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        self.dp, self.dtype, self.device, self.shard_device = dp, dtype, device, shard_device
        self.pin_memory = pin_memory
        self.stats = collectives.CommStats()
        self._recorded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameters registered inside, in order
        self._whole: WeakIdKeyDictionary = WeakIdKeyDictionary()  # partitioned ones whose values are back for now
        self._handles: list[Any] = []
        self._mode: _PartitionedAccess | None = None
        self._outermost = False

    def __enter__(self) -> PartitionedConstruction:
        if PartitionedConstruction._active is not None:
            return self
        PartitionedConstruction._active, self._outermost = self, True
        self._handles = [
            register_module_parameter_registration_hook(self._on_parameter),
            register_module_module_registration_hook(self._on_module),
        ]
        self._mode = _PartitionedAccess(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._outermost:
            return
        try:
            with self._busy():
                self.release_whole()
                if exc[0] is None:
                    self._partition(list(self._recorded.keys()))
        finally:
            self._mode.__exit__(*exc)
            for handle in self._handles:
                handle.remove()
            self._handles, self._mode, self._outermost = [], None, False
            PartitionedConstruction._active = None

    def partition_module(self, module: nn.Module) -> None:
        """Partitions an already built module (DeepSpeed's `zero.Init(module=model)`)."""
        self._partition(list(module.parameters()), recorded_only=False)

    # ----------------------------------------------------------------- hooks
    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or self._mode is None or self._mode._off:
            return
        with self._busy():
            if param.device.type != "meta":
                self._recorded[param] = None

    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None or self._mode is None or self._mode._off:
            return
        with self._busy():
            self.release_whole()
            self._partition(list(child.parameters()))

    # ------------------------------------------------------------- internals
    def _partition(self, params: list[nn.Parameter], recorded_only: bool = True) -> None:
        for param in params:
            if init_shards.init_shard_of(param) is not None or param.device.type == "meta":
                continue
            if recorded_only and param not in self._recorded:
                continue  # built before the context: left whole, as it was
            init_shards.partition(
                param,
                self.dp,
                self.stats,
                dtype=self.dtype,
                device=self.device,
                shard_device=self.shard_device,
                pin_memory=self.pin_memory,
            )

    def make_whole(self, params: list[nn.Parameter], overwritten: nn.Parameter | None) -> None:
        """Gives `params` their full values back (uninitialised for `overwritten`, which the caller writes whole);
        the parameters made whole earlier are partitioned again first."""
        wanted = {id(p) for p in params}
        self.release_whole(keep=wanted)
        for param in params:
            if not init_shards.is_placeholder(param):
                continue
            device, dtype = init_shards.init_shard_of(param).built_on
            if param is overwritten:
                values = torch.empty(init_shards.init_shard_of(param).shape, dtype=dtype, device=device)
            else:
                values = init_shards.gather(param).to(device=device, dtype=dtype)
            init_shards.restore(param, values)
            self._whole[param] = None

    def release_whole(self, keep: set[int] = frozenset()) -> None:
        """Partitions again the parameters this context made whole (not those a `GatheredParameters` holds)."""
        for param in [p for p in self._whole.keys() if id(p) not in keep]:
            del self._whole[param]
            record = init_shards.init_shard_of(param)
            if record is not None and record.whole:
                init_shards.keep_slice_of(param, param.data)

    @classmethod
    @contextlib.contextmanager
    def paused(cls) -> Iterator[None]:
        """Inside an active context: its whole parameters partitioned again and its interception off, for code that
        moves partitioned parameters' values itself (`GatheredParameters`). Elsewhere: nothing."""
        active = cls._active
        if active is None or active._mode is None:
            yield
            return
        with active._busy():
            active.release_whole()
            yield

    def _busy(self) -> Any:
        return self._mode.disabled() if self._mode is not None else _NullContext()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _PartitionedAccess(TorchFunctionMode):
    """Gives a partitioned parameter its values back when a torch function touches it (see the note above)."""

    def __init__(self, owner: PartitionedConstruction) -> None:
        super().__init__()
        self.owner = owner
        self._off = 0

    def disabled(self) -> _Disabled:
        return _Disabled(self)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._off:
            return func(*args, **kwargs)
        touched = [t for t in _tensors_in(args, kwargs) if init_shards.is_placeholder(t)]
        if not touched:
            return func(*args, **kwargs)
        first = args[0] if args else None
        kind = _access_kind(func)
        if kind == "placeholder":
            return func(*args, **kwargs)
        if kind == "shape" and len(touched) == 1 and first is touched[0]:
            record = init_shards.init_shard_of(first)
            return func(torch.empty(record.shape, dtype=record.dtype, device="meta"), *args[1:], **kwargs)
        overwritten = first if kind == "overwrite" and any(first is t for t in touched) else None
        with self.disabled():
            self.owner.make_whole(_unique(touched), overwritten)
        return func(*args, **kwargs)


class _Disabled:
    def __init__(self, mode: _PartitionedAccess) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        self.mode._off += 1

    def __exit__(self, *exc: Any) -> None:
        self.mode._off -= 1


def _access_kind(func: Any) -> str:
    """ "placeholder": the placeholder answers (dtype, device, ...); "shape": a shape query; "overwrite": writes
    every element of its first argument; "read": anything else."""
    descriptor = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) in ("__get__", "__set__") and type(descriptor).__name__ == "getset_descriptor":
        if func.__name__ == "__set__" and descriptor is _TENSOR.data:
            return "overwrite"  # `param.data = values`
        if any(descriptor is d for d in _SHAPE_DESCRIPTORS):
            return "shape"
        return "placeholder" if descriptor.__name__ in _PLACEHOLDER_DESCRIPTORS else "read"
    name = getattr(func, "__name__", "")
    if getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_"):
        return "overwrite"
    owner = getattr(func, "__objclass__", None)
    if owner is _TENSOR or func is torch.Tensor.__len__:
        if name in _SHAPE_METHODS:
            return "shape"
        if name in _OVERWRITING_METHODS:
            return "overwrite"
        if name in _PLACEHOLDER_METHODS:
            return "placeholder"
    return "read"


def _tensors_in(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
