"""ZeroAccelerator: an `accelerate.Accelerator` whose models train with accelerate_zero's ZeRO engine (no deepspeed).

accelerate keeps seeing MULTI_CPU / MULTI_GPU, never DEEPSPEED (INTEGRATION_NOTES §3.5): its data loading, RNG,
gathering and logging are untouched. What touches a model's training state is overridden, doing with our engine
what accelerate 1.15 does for DeepSpeed (`_prepare_deepspeed`, `DeepSpeedEngineWrapper`):

* `prepare`: each model (with the optimizer passed with it) becomes one `ZeroEngine`, which works in place, so the
  model itself is returned; the optimizer comes back with no-op `step()`/`zero_grad()`; a torch scheduler comes back
  as accelerate's `AcceleratedScheduler`, which skips the step after an fp16 overflow. The rest is accelerate's.
* `backward`: `engine.backward(loss)` (divides by gradient_accumulation_steps, applies the fp16 loss scale), then
  `engine.step()`, which steps the optimizer on the boundary `accumulate()` marks (`sync_gradients`).
* Mixed precision is the engine's (16-bit weights, fp32 master shard, fp16 loss scaling): it goes into the config's
  fp16/bf16 blocks and accelerate gets "no", so it neither autocasts, nor wraps forward, nor makes a GradScaler.
* `save_state`/`load_state`: every rank writes its own shards (`engine.save_checkpoint`); accelerate the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, is_compiled_module
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # importable without deepspeed
from torch import nn

from accelerate_zero.config import ZeroConfig, ZeroConfigError, resolve_config
from accelerate_zero.config.schema import is_auto
from accelerate_zero.engine.engine import ZeroEngine, initialize
from accelerate_zero.engine.groups import has_accelerator, process_group_timeout
from accelerate_zero.engine.setup import forward_input_dtype
from accelerate_zero.integrations.accelerate.auto_fill import (
    hidden_size_values,
    micro_batch_size,
    optimizer_params,
    pair_optimizers,
    without_optimizer_blocks,
)
from accelerate_zero.integrations.accelerate.deepspeed_env import adopt_accelerate_deepspeed_launch
from accelerate_zero.integrations.accelerate.launch_config import build_deepspeed_config
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin
from accelerate_zero.integrations.accelerate.prepared import (
    CastForwardInputs,
    PreparedModel,
    ZeroOptimizerWrapper,
    ZeroSchedulerWrapper,
    is_zero_wrapper,
)


logger = logging.getLogger(__name__)

CHECKPOINT_TAG = "zero_model"
"""`save_state` writes the i-th trained model's engine checkpoint to `<output_dir>/zero_model[_i]/`."""

_REFUSED_KWARGS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin")


class ZeroAccelerator(Accelerator):
    """An `accelerate.Accelerator` that trains every prepared model with accelerate_zero's ZeRO engine (stages 0-3).

    Use it as `Accelerator`; run the script with `accelerate-zero launch` (or `torchrun`, or `python` for one
    process). Differences from accelerate's DeepSpeed integration: several models can be prepared (one engine
    each; a model passed without an optimizer is prepared for inference), and `mixed_precision` never autocasts:
    the engine keeps the model in 16-bit and an fp32 master copy of this rank's shard.

    Args:
        zero_plugin (`ZeroPlugin`, defaults to `None`):
            The ZeRO settings. `None` means `ZeroPlugin()`: the settings `accelerate-zero launch` put in the
            environment, else accelerate's DeepSpeed defaults (stage 2, batch sizes "auto").
        **accelerate_kwargs:
            `Accelerator` arguments. `mixed_precision` ("no", "fp16", "bf16"; `None` reads
            `ACCELERATE_MIXED_PRECISION`) goes into the ZeRO config's fp16/bf16 blocks, accelerate itself gets "no".
            `gradient_accumulation_steps` fills a "auto" in the config (a number in the config wins, with a warning,
            as in accelerate). DeepSpeed, FSDP, Megatron-LM and tensor-parallel plugins are refused.

    Attributes:
        zero_plugin: the plugin the config came from.
        zero_engines: the engines, one per prepared model, in prepare order.
        zero_config: the resolved config of the first prepared model's engine (before any `prepare`: the
            config with "auto" values still in it).

    Raises:
        ZeroConfigError: the ZeRO config or `mixed_precision` is invalid (every problem listed).
        ValueError: a DeepSpeed/FSDP/Megatron plugin was passed or is requested by the environment.
        RuntimeError: the script runs on several ranks but accelerate was already initialised for one process.
    """

    def __init__(self, zero_plugin: ZeroPlugin | None = None, **accelerate_kwargs: Any) -> None:
        _refuse_other_backends(accelerate_kwargs)
        mixed_precision = accelerate_kwargs.pop("mixed_precision", None)
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        self._zero_mixed_precision = str(mixed_precision).lower()
        self.set_zero_plugin(zero_plugin if zero_plugin is not None else ZeroPlugin())
        super().__init__(mixed_precision="no", **_with_process_group_setup(accelerate_kwargs))
        self._check_distributed_state()
        self._zero_models: list[PreparedModel] = []
        self._held_engines: set[int] = set()  # ids of engines inside `no_sync`
        self._warned_max_norm = False
        self.caller_owns_accumulation = False
        """True when the training loop divides the loss by the accumulation steps itself and marks the boundary
        through `gradient_state` (the transformers Trainer): `backward` then does not divide again, and the config's
        gradient_accumulation_steps leaves accelerate's own setting alone."""

    def set_zero_plugin(self, zero_plugin: ZeroPlugin) -> None:
        """Uses `zero_plugin`'s config for the models prepared from now on (the engines built already keep theirs).

        Raises:
            ZeroConfigError: the config with this accelerator's mixed precision is invalid.
        """
        self.zero_plugin = zero_plugin
        self._base_config = _config_with_precision(zero_plugin, self._zero_mixed_precision)

    # ------------------------------------------------------------------ state
    @property
    def zero_engines(self) -> list[ZeroEngine]:
        return [entry.engine for entry in self._zero_models]

    @property
    def zero_config(self) -> ZeroConfig:
        return self._zero_models[0].engine.config if self._zero_models else self._base_config

    def _check_distributed_state(self) -> None:
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
            raise ValueError(
                f"accelerate is set up for {self.distributed_type} (ACCELERATE_USE_* in the environment): "
                "ZeroAccelerator trains with accelerate_zero's engine; launch with `accelerate-zero launch` instead"
            )
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if self.num_processes == 1 and world_size > 1:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but accelerate runs this process alone ({self.distributed_type}): "
                "accelerate was initialised (PartialState/Accelerator) before ZeroAccelerator without cpu=True, so "
                "every rank would train by itself. Create the ZeroAccelerator first, or launch with "
                "`accelerate-zero launch`"
            )

    def prepared_model_of(self, model: Any) -> PreparedModel | None:
        """The preparation record of `model`: its engine, its optimizer wrapper (None when it was prepared for
        inference) and what `release_model` restores.

        Args:
            model: the model object `prepare` returned (the one passed in: prepare works in place).

        Returns:
            The record, or None when this accelerator did not prepare `model` (or released it since).
        """
        return next((entry for entry in self._zero_models if entry.model is model), None)

    def _entry_of_param(self, param: torch.Tensor) -> PreparedModel | None:
        return next((e for e in self._zero_models if any(p is param for p in e.model.parameters())), None)

    # --------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepares each model (with the optimizer over its parameters) as one ZeRO engine, the rest as accelerate does.

        The model object itself is returned, its optimizer as a `ZeroOptimizerWrapper`. A model passed without an
        optimizer is prepared for inference ([Note: models prepared for inference]). "auto" config values are filled
        as accelerate does for DeepSpeed: batch sizes from the dataloaders (of this or an earlier call), the
        accumulation steps, gradient_clipping 1.0, hidden-size bucket sizes, optimizer/scheduler params.

        Args:
            *args: models, optimizers (torch or `accelerate.utils.DummyOptim`), dataloaders, schedulers (torch or
                `DummyScheduler`), other objects; returned in the same order.
            device_placement: as accelerate's, for the objects that are not models or optimizers (the engine
                always places its model).

        Raises:
            ValueError: an optimizer is passed without its model, a config value is "auto" and cannot be filled
                (accelerate's messages), or the config and the objects disagree (optimizer/scheduler in both).
        """
        placements = list(device_placement) if device_placement is not None else [None] * len(args)
        if len(placements) != len(args):
            raise ValueError(
                f"`device_placement` should be a list with {len(args)} elements (the number of objects passed)."
            )
        result = list(args)
        owned = self._prepare_zero_objects(args, result)
        for index in owned:
            if placements[index] is False:
                raise ValueError(
                    "You can't customize device placements of models and optimizers with ZeRO: the engine places them"
                )
        rest = [index for index in range(len(args)) if index not in owned]
        if rest:
            prepared = super().prepare(*(args[i] for i in rest), device_placement=[placements[i] for i in rest])
            prepared = prepared if len(rest) > 1 else (prepared,)
            for index, obj in zip(rest, prepared, strict=True):
                result[index] = obj
        return tuple(result) if len(result) > 1 else result[0]

    def _prepare_zero_objects(self, args: tuple, result: list) -> set[int]:
        """Builds the engines of the models in `args`; writes the returned objects into `result`."""
        self._release_models_to_train(args)
        owned = {i for i, obj in enumerate(args) if self.prepared_model_of(obj) is not None or is_zero_wrapper(obj)}
        for i, obj in enumerate(args):
            wrapper = next(
                (e.optimizer for e in self._zero_models if e.optimizer and e.optimizer.optimizer is obj), None
            )
            if wrapper is not None:  # the raw optimizer of a model prepared earlier: its wrapper again
                result[i] = wrapper
                owned.add(i)
        models = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module) and i not in owned]
        optimizers = [
            i for i, obj in enumerate(args) if isinstance(obj, (torch.optim.Optimizer, DummyOptim)) and i not in owned
        ]
        dummy_schedulers = [i for i, obj in enumerate(args) if isinstance(obj, DummyScheduler)]
        pairs = pair_optimizers(args, models, optimizers, self._zero_models)
        for model_index in models:
            opt_index = pairs.get(model_index)
            optimizer = args[opt_index] if opt_index is not None else None
            sched_index = next((i for i in dummy_schedulers if args[i].optimizer is optimizer), None)
            scheduler = args[sched_index] if sched_index is not None else None
            self._check_objects(args, optimizer, scheduler)
            entry = self._build_engine(args[model_index], optimizer, scheduler, args)
            result[model_index] = entry.model
            owned.add(model_index)
            if opt_index is not None:
                result[opt_index] = entry.optimizer
                owned.add(opt_index)
            if sched_index is not None:
                result[sched_index] = self._wrap_engine_scheduler(entry)
                owned.add(sched_index)
        for index in dummy_schedulers:
            if index not in owned:
                raise ValueError("a DummyScheduler was passed without the model and optimizer it belongs to")
        return owned

    def _release_models_to_train(self, args: tuple) -> None:
        """A model prepared for inference earlier, passed now with an optimizer over its parameters: release it
        (full weights and `requires_grad` back), so it is prepared for training."""
        optimizers = [o for o in args if isinstance(o, (torch.optim.Optimizer, DummyOptim)) and not is_zero_wrapper(o)]
        held = {id(p) for optimizer in optimizers for p in optimizer_params(optimizer)}
        for obj in args:
            entry = self.prepared_model_of(obj) if isinstance(obj, nn.Module) else None
            if entry is not None and entry.optimizer is None and any(id(p) in held for p in obj.parameters()):
                self.release_model(obj)

    def _check_objects(self, args: tuple, optimizer: Any, scheduler: DummyScheduler | None) -> None:
        """accelerate's DeepSpeed checks between the config and the optimizer/scheduler objects (same messages)."""
        config = self._base_config
        if optimizer is not None and config.optimizer is not None and not isinstance(optimizer, DummyOptim):
            raise ValueError(
                "You cannot specify an optimizer in the config file and in the code at the same time. Please remove "
                "the optimizer from the config file or create `accelerate.utils.DummyOptim` in the code."
            )
        if isinstance(optimizer, DummyOptim) and config.optimizer is None:
            raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer in the config file.")
        if isinstance(optimizer, DummyOptim) and any(isinstance(group, dict) for group in optimizer.params):
            raise ValueError(
                "DummyOptim with param groups: the engine builds the config's optimizer over all trainable "
                "parameters; pass a torch optimizer with your groups instead and remove the config's optimizer block"
            )
        torch_schedulers = [obj for obj in args if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)]
        if config.scheduler is not None and any(s.optimizer is optimizer for s in torch_schedulers):
            raise ValueError(
                "You cannot specify a scheduler in the config file and in the code at the same time. Please remove "
                "the scheduler from the config file or create `accelerate.utils.DummyScheduler` in the code."
            )
        if scheduler is not None and config.scheduler is None and scheduler.lr_scheduler_callable is None:
            raise ValueError(
                "Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` parameter when "
                "using `accelerate.utils.DummyScheduler`."
            )
        if isinstance(optimizer, DummyOptim) and any(s.optimizer is optimizer for s in torch_schedulers):
            raise ValueError(
                "You can only specify `accelerate.utils.DummyScheduler` in the code when using "
                "`accelerate.utils.DummyOptim`."
            )

    def _build_engine(
        self, model: nn.Module, optimizer: Any, scheduler: DummyScheduler | None, args: tuple
    ) -> PreparedModel:
        config = self._engine_config(model, optimizer, scheduler, args)
        if optimizer is None:
            # [Note: models prepared for inference] The model is frozen and gets an engine whose optimizer has no
            # parameters: at stage 3 the engine shards the frozen weights (gathered unit by unit in forward); below
            # it, it only moves them to the device in the compute dtype and broadcasts rank 0's values. No gradient,
            # master weight or optimizer state is allocated.
            requires_grad = [p.requires_grad for p in model.parameters()]
            model.requires_grad_(False)
            engine = initialize(model, torch.optim.SGD([{"params": []}], lr=0.0), config, device=self.device)
            wrapper = None
        else:
            requires_grad = [p.requires_grad for p in model.parameters()]
            torch_optimizer = None if isinstance(optimizer, DummyOptim) else optimizer
            callable_scheduler = scheduler.lr_scheduler_callable if scheduler is not None else None
            engine = initialize(model, torch_optimizer, config, callable_scheduler, device=self.device)
            wrapper = ZeroOptimizerWrapper(engine.optimizer, engine)
            self._optimizers.append(wrapper)
            wrapper._is_accelerate_prepared = True
        hooks = []
        input_dtype = forward_input_dtype(engine.config)
        if input_dtype is not None:
            # The model is returned unwrapped: a pre-hook casts its inputs as `engine(...)` would.
            hooks.append(model.register_forward_pre_hook(CastForwardInputs(input_dtype), with_kwargs=True))
        entry = PreparedModel(model, engine, wrapper, hooks, requires_grad)
        self._zero_models.append(entry)
        self._models.append(model)
        model._is_accelerate_prepared = True
        return entry

    def _wrap_engine_scheduler(self, entry: PreparedModel) -> ZeroSchedulerWrapper:
        if entry.engine.lr_scheduler is None:
            raise ValueError("the DummyScheduler's model got no scheduler from its engine")
        wrapper = ZeroSchedulerWrapper(entry.engine.lr_scheduler, entry.optimizer)
        self._schedulers.append(wrapper)
        wrapper._is_accelerate_prepared = True
        return wrapper

    def _engine_config(
        self, model: nn.Module, optimizer: Any, scheduler: DummyScheduler | None, args: tuple
    ) -> ZeroConfig:
        """The config with every "auto" filled as accelerate's `_prepare_deepspeed` does (steps 1-6, INTEGRATION_NOTES
        §3.3), resolved for this world size."""
        config = self._base_config if optimizer is not None else without_optimizer_blocks(self._base_config)
        values: dict[str, Any] = {
            "gradient_clipping": 1.0,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        micro = config.train_micro_batch_size_per_gpu
        if is_auto(micro):
            # A model prepared for inference needs no batch size (accelerate's `set_deepspeed_weakref` uses 1).
            micro = micro_batch_size(self, args, required=optimizer is not None) or 1
            values["train_micro_batch_size_per_gpu"] = micro
        ga = config.gradient_accumulation_steps
        ga = self.gradient_accumulation_steps if is_auto(ga) else ga
        if isinstance(micro, int) and isinstance(ga, int):
            values["train_batch_size"] = micro * ga * self.num_processes
        values.update(hidden_size_values(model, config))
        values.update(self._optimizer_values(optimizer, scheduler))
        filled = config.fill_auto(values)
        below_3 = filled.zero_optimization.stage != 3  # resolve_config gives stage3_* "auto" values their defaults
        left = [key for key in filled.auto_keys() if not (below_3 and key.startswith("zero_optimization.stage3_"))]
        if left:
            raise ZeroConfigError(
                [
                    f"`{key}` not found in kwargs. Please specify `{key}` without `auto` (set to correct value) in the "
                    "DeepSpeed config (ZeroPlugin(config=...) or the launcher's deepspeed_config_file)."
                    for key in left
                ]
            )
        if isinstance(optimizer, torch.optim.Optimizer):
            filled.zero_allow_untested_optimizer = True  # accelerate sets it for any client optimizer
        resolved = resolve_config(filled, world_size=self.num_processes)
        if (
            resolved.gradient_accumulation_steps != self.gradient_accumulation_steps
            and not self.caller_owns_accumulation
        ):
            logger.warning(
                "Gradient accumulation steps mismatch: GradientAccumulationPlugin has %s, the ZeRO config has %s. "
                "Using the ZeRO config's value.",
                self.gradient_accumulation_steps,
                resolved.gradient_accumulation_steps,
            )
            self.gradient_accumulation_steps = resolved.gradient_accumulation_steps
        return resolved

    def _optimizer_values(self, optimizer: Any, scheduler: DummyScheduler | None) -> dict[str, Any]:
        """ "auto" values of the config's optimizer/scheduler blocks, from the objects passed (fill_auto skips a
        block the config does not have)."""
        values: dict[str, Any] = {}
        if isinstance(optimizer, DummyOptim):
            values["optimizer.params.lr"] = optimizer.lr
            values["optimizer.params.weight_decay"] = optimizer.weight_decay
            lr = optimizer.lr
        else:
            lr = optimizer.defaults.get("lr") if isinstance(optimizer, torch.optim.Optimizer) else None
        if lr is not None:
            values.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": lr})
        if scheduler is not None and scheduler.lr_scheduler_callable is None:
            values["scheduler.params.warmup_num_steps"] = max(1, scheduler.warmup_num_steps)
            if scheduler.total_num_steps is not None:
                total = scheduler.total_num_steps
                values["scheduler.params.total_num_steps"] = (
                    total if self.split_batches else math.ceil(total / self.num_processes)
                )
        return values

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Prepares `model` without an optimizer: for inference (frozen; sharded at stage 3). See `prepare`."""
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Returns an optimizer already prepared with its model; any other is an error (see `prepare`)."""
        if is_zero_wrapper(optimizer):
            return optimizer
        raise ValueError(
            "With ZeroAccelerator a model and its optimizer must be passed together to `prepare()`: the engine "
            "re-points the optimizer at this rank's shard while it builds"
        )

    # -------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Back-propagates `loss` through the engine, and steps it on the accumulation boundary.

        The engine divides `loss` by gradient_accumulation_steps (unless `scale_wrt_gas=False`, which the
        transformers Trainer passes when it divided already) and multiplies it by the fp16 loss scale. The boundary
        is `accelerator.sync_gradients` (set by `accumulate()`) outside `no_sync`.

        Args:
            loss: the loss of this micro-batch.
            **kwargs: `retain_graph`, `scale_wrt_gas`, and `model` (which prepared model this loss trains; needed
                only when several models were prepared with optimizers).

        Raises:
            RuntimeError: several models train and `model=` does not say which.
            TypeError: another keyword argument was passed.
        """
        entry = self._training_entry(kwargs.pop("model", None))
        if entry is None:
            super().backward(loss, **kwargs)
            return
        retain_graph = kwargs.pop("retain_graph", False)
        scale_wrt_gas = kwargs.pop("scale_wrt_gas", not self.caller_owns_accumulation)
        if kwargs:
            raise TypeError(f"ZeroAccelerator.backward() got unexpected keyword arguments {sorted(kwargs)}")
        engine, optimizer = entry.engine, entry.optimizer
        boundary = self.sync_gradients and id(engine) not in self._held_engines
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        skipped_before = engine.skipped_steps
        engine.step()
        optimizer._step_was_skipped = boundary and engine.skipped_steps > skipped_before

    def _training_entry(self, model: nn.Module | None) -> PreparedModel | None:
        training = [entry for entry in self._zero_models if entry.optimizer is not None]
        if model is not None:
            entry = self.prepared_model_of(model)
            if entry is None or entry.optimizer is None:
                raise ValueError("backward(model=...) must be a model prepared together with its optimizer")
            return entry
        if len(training) > 1:
            raise RuntimeError(
                f"{len(training)} models were prepared with optimizers and one backward drives one engine: pass "
                "the model this loss trains, accelerator.backward(loss, model=model)"
            )
        return training[0] if training else None

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Backward passes inside accumulate without stepping the optimizer (at every stage; stage 2 still reduces
        each micro-step into its gradient shard)."""
        entry = self.prepared_model_of(model)
        if entry is None:
            with super().no_sync(model):
                yield
            return
        key = id(entry.engine)
        held = key in self._held_engines
        self._held_engines.add(key)
        try:
            yield
        finally:
            if not held:
                self._held_engines.discard(key)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor | None:
        """The global L2 gradient norm of the last optimizer step (before clipping), as DeepSpeed's integration does.

        The engine clips inside the step with the config's `gradient_clipping` (accelerate fills an "auto" with
        1.0); a different `max_norm` is not applied (a warning says so, once). `max_norm=inf` just reads the norm.

        Returns:
            A float32 scalar tensor, or None before the first optimizer step.

        Raises:
            ValueError: `norm_type` is not 2.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        entry = self._entry_of_param(params[0]) if params else None
        if entry is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        if norm_type != 2:
            raise ValueError(f"norm_type={norm_type}: the ZeRO engine computes the L2 norm (norm_type=2) only")
        clipping = entry.engine.config.gradient_clipping
        if math.isfinite(max_norm) and max_norm != clipping and not self._warned_max_norm:
            self._warned_max_norm = True
            warnings.warn(
                f"clip_grad_norm_(max_norm={max_norm}) does not clip: the ZeRO engine clips inside the optimizer "
                f"step with gradient_clipping={clipping} from the config (0 means no clipping). Set gradient_clipping "
                f"to {max_norm} in the config (or ZeroPlugin(gradient_clipping={max_norm})) to clip at {max_norm}.",
                stacklevel=2,
            )
        norm = entry.engine.get_global_grad_norm()
        return None if norm is None else torch.tensor(norm, dtype=torch.float32)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Not available: the engine clips the global norm (`gradient_clipping`), as with DeepSpeed and FSDP."""
        raise RuntimeError(
            "ZeRO (like DeepSpeed and FSDP) does not support `clip_grad_value_`. Use `clip_grad_norm_` instead: the "
            "engine clips the global gradient norm with the config's gradient_clipping."
        )

    # ---------------------------------------------------------------- saving
    def get_state_dict(
        self, model: nn.Module, unwrap: bool = True, *, only: Collection[str] | None = None
    ) -> dict[str, torch.Tensor] | None:
        """The full state dict of `model` in its compute dtype (16-bit under mixed precision) on the main process.

        Every rank must call it (at stage 3 the parameters are gathered unit by unit). The other ranks get the same
        keys with meta tensors of the same shapes and dtypes ([Note: state dict on the other ranks]). `only` keeps
        just these keys (see `ZeroEngine.full_state_dict`); accelerate's own path ignores it.

        Raises:
            ValueError: at stage 3 when `stage3_gather_16bit_weights_on_model_save` is false (accelerate's
                DeepSpeed message).
        """
        entry = self.prepared_model_of(model)
        if entry is None:
            return super().get_state_dict(model, unwrap)
        config = entry.engine.config
        gather = config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        if entry.engine.stage == 3 and not (gather or self.zero_plugin.zero3_save_16bit_model):
            raise ValueError(
                "Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` in the ZeRO "
                "config is False. To save the model weights in 16bit, set "
                "`zero_optimization.stage3_gather_16bit_weights_on_model_save` to True in the DeepSpeed config file "
                "or set `zero3_save_16bit_model` to True when using `accelerate config` (or "
                "`ZeroPlugin(zero3_save_16bit_model=True)`). To save the full checkpoint, run "
                "`accelerator.save_state(save_dir)`: every rank writes its shards."
            )
        state_dict = entry.engine.full_state_dict(only=only)
        if self.is_main_process:
            return state_dict
        # [Note: state dict on the other ranks] accelerate's documented stage-3 save,
        # `unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save,
        # state_dict=accelerator.get_state_dict(model))`, runs on every rank. Under DeepSpeed the other ranks get None
        # and `save_pretrained` falls back to `model.state_dict()`, which there holds empty partitions; here that call
        # refuses placeholders (they would become empty weight files), so a None made those ranks raise while the main
        # process went on to its next collective (a hang until the timeout). They get meta tensors instead: the keys,
        # shapes and dtypes `save_pretrained` works through (tied weights, shard plan) without holding the weights,
        # and it writes nothing with them (`is_main_process=False`). Gathering every weight to every rank would cost a
        # full 16-bit copy per rank for nothing.
        return entry.engine.meta_state_dict(only)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """accelerate's `save_model` (the main process writes the 16-bit weights); the other ranks take part in the
        gather and write nothing. Every rank must call it."""
        if self.prepared_model_of(model) is None or self.is_main_process:
            super().save_model(model, save_directory, max_shard_size, safe_serialization)
        else:
            self.get_state_dict(model)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str:
        """Saves the training state: every rank writes its shards of each trained model, accelerate the rest.

        The i-th model prepared with an optimizer goes to `<output_dir>/zero_model[_i]/` (`ZeroEngine.save_checkpoint`);
        accelerate writes RNG states, torch schedulers, dataloaders, its step and registered objects as usual. Models
        prepared for inference are not saved. Pre-hooks get every prepared model and `weights=[]` (as under DeepSpeed).

        Args:
            output_dir: the folder (accelerate's `automatic_checkpoint_naming` works as usual).
            safe_serialization: as accelerate's.
            **save_model_func_kwargs: passed to `ZeroEngine.save_checkpoint` (e.g. `client_state`).

        Returns:
            The folder written.
        """

        def save_engines(models: list, weights: list, folder: str) -> None:
            for tag, entry in self._checkpointed():
                entry.engine.save_checkpoint(folder, tag=tag, **save_model_func_kwargs)

        with self._accelerate_state_only("_save_model_state_pre_hook", save_engines):
            return super().save_state(output_dir, safe_serialization)

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """Restores what `save_state` wrote: models, optimizers, fp16 loss scale, schedulers, RNG, dataloaders.

        The engine checkpoints are universal (any world size or stage can load them); only safetensors, JSON and
        `torch.load(weights_only=True)` files are read for them.

        Args:
            input_dir: the folder `save_state` wrote (None: the latest with `automatic_checkpoint_naming`).
            load_kwargs: as accelerate's.
            **load_model_func_kwargs: `load_optimizer_states` / `load_lr_scheduler_states` for the engines
                (default True); the rest goes to accelerate.
        """
        engine_kwargs = {
            key: load_model_func_kwargs.pop(key)
            for key in ("load_optimizer_states", "load_lr_scheduler_states")
            if key in load_model_func_kwargs
        }

        custom_objects = self._custom_objects

        def load_engines(models: list, folder: str) -> None:
            for tag, entry in self._checkpointed():
                entry.engine.load_checkpoint(folder, tag=tag, **engine_kwargs)
                entry.optimizer._step_was_skipped = False
            _load_custom_objects_safely(custom_objects, folder)

        # accelerate unpickles registered objects with weights_only=False: they are loaded above instead, and
        # accelerate sees a stand-in with their count (it checks it against the files) and nothing to load.
        self._custom_objects = _LoadedByZero(len(custom_objects))
        try:
            with self._accelerate_state_only("_load_model_state_pre_hook", load_engines):
                super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            self._custom_objects = custom_objects

    def _checkpointed(self) -> list[tuple[str, PreparedModel]]:
        trained = [entry for entry in self._zero_models if entry.optimizer is not None]
        return [(CHECKPOINT_TAG if i == 0 else f"{CHECKPOINT_TAG}_{i}", entry) for i, entry in enumerate(trained)]

    @contextlib.contextmanager
    def _accelerate_state_only(self, hooks_attr: str, engine_hook: Callable[..., None]) -> Iterator[None]:
        """[Note: save_state/load_state] accelerate's own save_state/load_state run unchanged (folder naming,
        RNG, schedulers, dataloaders, custom objects) with the ZeRO models, optimizers and engine-owned schedulers
        hidden from them: their generic path writes model/optimizer files on the main process only, which would
        lose the other ranks' shards. The engines are saved/loaded by a pre-hook, which accelerate calls with the
        resolved folder, before its own files."""
        saved = self._models, self._optimizers, self._schedulers, getattr(self, hooks_attr)
        all_models = list(self._models)
        zero_models = {id(entry.model) for entry in self._zero_models}
        hooks: OrderedDict = OrderedDict(zero=engine_hook)
        for key, hook in saved[3].items():
            hooks[key] = _with_models(hook, all_models)
        self._models = [m for m in self._models if id(m) not in zero_models]
        self._optimizers = [o for o in self._optimizers if not isinstance(o, ZeroOptimizerWrapper)]
        self._schedulers = [s for s in self._schedulers if not isinstance(s, ZeroSchedulerWrapper)]
        setattr(self, hooks_attr, hooks)
        try:
            yield
        finally:
            self._models, self._optimizers, self._schedulers = saved[:3]
            setattr(self, hooks_attr, saved[3])

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """The model without the wrappers a user may have added: DDP/DataParallel, and torch.compile's unless
        `keep_torch_compile`. `prepare` returns models unwrapped, and accelerate adds no fp32 autocast wrapper here
        (it gets mixed_precision "no"), so `keep_fp32_wrapper` has nothing to act on.

        accelerate's own unwrap imports deepspeed whenever it is installed, to recognise a DeepSpeedEngine; none
        exists here, and the training path must not import deepspeed ([Note: adopting accelerate's DeepSpeed
        launch] in deepspeed_env.py).
        """
        while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        if not keep_torch_compile and is_compiled_module(model):
            model = model._orig_mod
        return model

    def release_model(self, model: nn.Module) -> None:
        """Undoes `prepare` of `model` (e.g. to train a model prepared for inference): its engine is destroyed, its
        full parameters (the compute dtype's values; fp32 masters and optimizer state are dropped) and
        `requires_grad` flags are restored.

        Raises:
            ValueError: `model` was not prepared by this accelerator.
        """
        entry = self.prepared_model_of(model)
        if entry is None:
            raise ValueError("release_model() takes a model this accelerator prepared")
        entry.release()
        self._zero_models.remove(entry)
        self._models = [m for m in self._models if m is not model]
        if entry.optimizer is not None:
            self._optimizers = [o for o in self._optimizers if o is not entry.optimizer]
        model._is_accelerate_prepared = False

    def free_memory(self, *objects: Any) -> Any:
        """Destroys the training engines and gives their models back whole (`release_model`), then releases
        accelerate's references. Models prepared for inference stay prepared (sharded at stage 3).

        [Note: side models survive free_memory] The transformers Trainer calls `free_memory()` when `train()`
        starts. TRL prepares its frozen reference and reward models for inference before that (`prepare_model(...,
        evaluation_mode=True)`); under DeepSpeed their engines live outside accelerate's bookkeeping and stay
        sharded. Releasing them here made every rank hold each whole reference model from the first step. A model
        prepared for inference that is then passed to `prepare` with an optimizer is released there first, and the
        Trainer releases its own model before it trains it.
        """
        kept = [entry for entry in self._zero_models if entry.optimizer is None]
        for entry in self._zero_models:
            if entry.optimizer is not None:
                entry.release()
        self._zero_models, self._held_engines = kept, set()
        result = super().free_memory(*objects)
        self._models.extend(entry.model for entry in kept)
        return result


# ------------------------------------------------------------------------------------------------------- helpers


def _refuse_other_backends(kwargs: dict[str, Any]) -> None:
    given = [name for name in _REFUSED_KWARGS if kwargs.get(name) is not None]
    if kwargs.get("parallelism_config") is not None:
        given.append("parallelism_config")
    if given:
        raise ValueError(f"ZeroAccelerator trains with accelerate_zero's ZeRO engine: remove {given}")
    adopt_accelerate_deepspeed_launch()  # `accelerate launch` with a DeepSpeed config: train with our engine


def _config_with_precision(plugin: ZeroPlugin, mixed_precision: str) -> ZeroConfig:
    """The plugin's config with accelerate's `mixed_precision` applied as `DeepSpeedPlugin.set_mixed_precision` does:
    on the config as written, where an absent fp16/bf16 block differs from a disabled one."""
    settings = dataclasses.replace(plugin._settings(), mixed_precision=mixed_precision)
    return build_deepspeed_config(settings).zero_config


def _with_process_group_setup(kwargs: dict[str, Any]) -> dict[str, Any]:
    """[Note: process group under plain torchrun] On a machine without an accelerator, accelerate only goes
    distributed (MULTI_CPU, gloo) when told the run is on CPU (`cpu=True` or ACCELERATE_USE_CPU, which
    `accelerate-zero launch` sets); under plain `torchrun` it reports DistributedType.NO and every rank trains alone.
    Passing `cpu=True` there is the narrowest fix: accelerate itself then forms the gloo group from
    RANK/WORLD_SIZE/MASTER_*, and reports the real world size and rank. In every launch mode the group gets the
    engine's timeout (ACCELERATE_ZERO_PG_TIMEOUT) unless the caller passed its own InitProcessGroupKwargs."""
    kwargs = dict(kwargs)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not has_accelerator() and PartialState._shared_state == {} and not dist.is_initialized():
        kwargs["cpu"] = True
    handlers = list(kwargs.get("kwargs_handlers") or [])
    if not any(isinstance(handler, InitProcessGroupKwargs) for handler in handlers):
        handlers.append(InitProcessGroupKwargs(timeout=process_group_timeout()))
    kwargs["kwargs_handlers"] = handlers
    return kwargs


def _with_models(hook: Callable[..., None], models: list) -> Callable[..., None]:
    def call(_hidden: list, *args: Any) -> None:
        hook(models, *args)

    return call


class _LoadedByZero(list):
    """Stands in for the objects registered for checkpointing while accelerate's `load_state` runs: it has their
    count and no items, so accelerate unpickles none of their files."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self._count = count

    def __len__(self) -> int:
        return self._count


def _load_custom_objects_safely(objects: list, folder: str) -> None:
    """Loads `custom_checkpoint_<i>.pkl` into each registered object with `weights_only=True`: tensors, numbers,
    strings and containers (and numpy arrays, as accelerate allows) only; never arbitrary pickled objects.

    Raises:
        ValueError: a file holds anything else (naming the file and the fix).
    """
    import pickle

    from accelerate.utils import load

    for index, obj in enumerate(objects):
        path = os.path.join(folder, f"custom_checkpoint_{index}.pkl")
        if not os.path.isfile(path):
            continue  # accelerate reports a count mismatch itself, after the pre-hook
        try:
            state = load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise ValueError(
                f"{path} (the state of {type(obj).__name__}, registered with register_for_checkpointing) holds "
                f"objects that are not tensors, numbers, strings or containers ({str(error).splitlines()[0]}): "
                "accelerate_zero never unpickles arbitrary objects. Make its state_dict() return plain values, or "
                "load the file yourself with torch.load(weights_only=False) if you trust it."
            ) from None
        obj.load_state_dict(state)
