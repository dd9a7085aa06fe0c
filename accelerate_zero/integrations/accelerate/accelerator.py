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
* accelerate's dynamo settings compile each engine's model, as accelerate compiles a DeepSpeed engine
  (compile_settings.py).

This class keeps accelerate's methods and its bookkeeping; the parts live beside it: accelerate_setup (what it asks
of accelerate's own setup), engine_config (each engine's config, "auto" filled), preparing (which objects form an
engine, and building it), prepared (what prepare returns and keeps), checkpointing (save_state/load_state).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import is_compiled_module
from accelerate.utils.deepspeed import DummyScheduler  # importable without deepspeed
from torch import nn

from accelerate_zero.config import ZeroConfig
from accelerate_zero.engine.engine import ZeroEngine
from accelerate_zero.integrations.accelerate import checkpointing
from accelerate_zero.integrations.accelerate.accelerate_setup import (
    check_distributed_state,
    refuse_other_backends,
    with_process_group_setup,
)
from accelerate_zero.integrations.accelerate.compile_settings import compile_prepared
from accelerate_zero.integrations.accelerate.engine_config import check_objects, config_with_precision, engine_config
from accelerate_zero.integrations.accelerate.parallelism import (
    parallelism_from_launch,
    with_zero_keys,
    zero_keys_from_parallelism,
)
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin
from accelerate_zero.integrations.accelerate.prepared import (
    PreparedModel,
    ZeroSchedulerWrapper,
    is_zero_wrapper,
    prepared_of_param,
    trained_by_backward,
)
from accelerate_zero.integrations.accelerate.preparing import build_prepared_model, models_to_train, plan_prepare
from accelerate_zero.integrations.accelerate.sequence_parallel import SequenceParallelMixin, sequence_handler_settings


logger = logging.getLogger(__name__)


class ZeroAccelerator(SequenceParallelMixin, Accelerator):
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
        # accelerate's dp_replicate_size x dp_shard_size is the engine's replicate x shard (parallelism.py)
        parallelism = accelerate_kwargs.pop("parallelism_config", None) or parallelism_from_launch()
        self._layout_keys = zero_keys_from_parallelism(parallelism, int(os.environ.get("WORLD_SIZE", "1")))
        self._sequence_settings = sequence_handler_settings(parallelism)
        refuse_other_backends(accelerate_kwargs)
        mixed_precision = accelerate_kwargs.pop("mixed_precision", None)
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        self._zero_mixed_precision = str(mixed_precision).lower()
        self.set_zero_plugin(zero_plugin if zero_plugin is not None else ZeroPlugin())
        super().__init__(mixed_precision="no", **with_process_group_setup(accelerate_kwargs))
        check_distributed_state(self)
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
        config = config_with_precision(zero_plugin, self._zero_mixed_precision)
        self._base_config = with_zero_keys(config, self._layout_keys, "ParallelismConfig")

    # ------------------------------------------------------------------ state
    @property
    def zero_engines(self) -> list[ZeroEngine]:
        return [entry.engine for entry in self._zero_models]

    @property
    def zero_config(self) -> ZeroConfig:
        return self._zero_models[0].engine.config if self._zero_models else self._base_config

    def prepared_model_of(self, model: Any) -> PreparedModel | None:
        """The preparation record of `model`: its engine, its optimizer wrapper (None when it was prepared for
        inference) and what `release_model` restores.

        Args:
            model: the model object `prepare` returned (the one passed in: prepare works in place).

        Returns:
            The record, or None when this accelerator did not prepare `model` (or released it since).
        """
        return next((entry for entry in self._zero_models if entry.model is model), None)

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
            trains = any(is_zero_wrapper(result[i]) for i in owned)
            for index, obj in zip(rest, prepared, strict=True):
                # as accelerate with DeepSpeed's Ulysses: loaders prepared with a model to train are cut along sequences
                is_loader = isinstance(args[index], torch.utils.data.DataLoader)
                result[index] = self.sequence_parallel_loader(obj) if trains and is_loader else obj
        return tuple(result) if len(result) > 1 else result[0]

    def _prepare_zero_objects(self, args: tuple, result: list) -> set[int]:
        """Builds the engines of the models in `args`; writes the returned objects into `result`."""
        for model in models_to_train(args, self._zero_models):
            self.release_model(model)
        plan = plan_prepare(args, self._zero_models)
        for index, obj in plan.earlier.items():
            result[index] = obj
        for objects in plan.engines:
            optimizer = args[objects.optimizer] if objects.optimizer is not None else None
            scheduler = args[objects.scheduler] if objects.scheduler is not None else None
            check_objects(self._base_config, args, optimizer, scheduler)
            entry = self._build_engine(args[objects.model], optimizer, scheduler, args)
            result[objects.model] = entry.model
            if objects.optimizer is not None:
                result[objects.optimizer] = entry.optimizer
            if objects.scheduler is not None:
                result[objects.scheduler] = self._wrap_engine_scheduler(entry)
        return plan.owned

    def _build_engine(
        self, model: nn.Module, optimizer: Any, scheduler: DummyScheduler | None, args: tuple
    ) -> PreparedModel:
        config = engine_config(self, self._base_config, model, optimizer, scheduler, args)
        if (
            config.gradient_accumulation_steps != self.gradient_accumulation_steps
            and not self.caller_owns_accumulation
        ):
            logger.warning(
                "Gradient accumulation steps mismatch: GradientAccumulationPlugin has %s, the ZeRO config has %s. "
                "Using the ZeRO config's value.",
                self.gradient_accumulation_steps,
                config.gradient_accumulation_steps,
            )
            self.gradient_accumulation_steps = config.gradient_accumulation_steps
        entry = build_prepared_model(model, optimizer, scheduler, config, self.device)
        compile_prepared(entry.engine, model, self.state.dynamo_plugin)  # accelerate's prepare_model compiles too
        if entry.optimizer is not None:
            self._attach_sequence_parallel(entry.model, entry.engine)
            self._optimizers.append(entry.optimizer)
            entry.optimizer._is_accelerate_prepared = True
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
        entry = trained_by_backward(self._zero_models, kwargs.pop("model", None))
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
        entry = prepared_of_param(self._zero_models, params[0]) if params else None
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
        checkpointing.check_16bit_weights_gathered(entry.engine, self.zero_plugin)
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
        """accelerate's `save_model`: at stage 3 every rank writes its share of the weight files
        (`checkpointing.save_model_in_parallel`); otherwise the main process writes the 16-bit weights and the other
        ranks take part in the gather. Every rank must call it."""
        if safe_serialization and checkpointing.save_model_in_parallel(self, model, save_directory, max_shard_size):
            return
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
            **save_model_func_kwargs: passed to `ZeroEngine.save_checkpoint` (e.g. `client_state`, or
                `async_save=True`: the engines' shards are written by background threads while training goes on;
                the next `save_state` or `load_state` waits for them).

        Returns:
            The folder written (with `async_save`, the engine shards are published under it once written).
        """

        return checkpointing.save_state(
            self, self._zero_models, super().save_state, output_dir, safe_serialization, save_model_func_kwargs
        )

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """Restores what `save_state` wrote: models, optimizers, fp16 loss scale, schedulers, RNG, dataloaders.

        The engine checkpoints are universal (any world size or stage can load them); only safetensors, JSON and
        `torch.load(weights_only=True)` files are read for them. A DCP checkpoint folder written by FSDP2 or
        torchtitan loads into the one trained model's engine (weights, optimizer state, steps; no accelerate state).

        Args:
            input_dir: the folder `save_state` wrote (None: the latest with `automatic_checkpoint_naming`).
            load_kwargs: as accelerate's.
            **load_model_func_kwargs: `load_optimizer_states` / `load_lr_scheduler_states` for the engines
                (default True); the rest goes to accelerate.
        """
        checkpointing.load_state(
            self, self._zero_models, super().load_state, input_dir, load_kwargs, load_model_func_kwargs
        )

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
