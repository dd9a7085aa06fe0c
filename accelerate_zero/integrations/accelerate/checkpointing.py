"""How `ZeroAccelerator` saves: `save_state`/`load_state` split the work (every rank's engine writes and reads its
own shards from a pre-hook, accelerate's own save_state/load_state do the rest with the ZeRO objects hidden from them,
[Note: save_state/load_state]; registered objects are loaded without unpickling arbitrary objects), and when the
16-bit weights of a stage-3 model may be gathered for `get_state_dict`."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import convert_file_size_to_int, load

from accelerate_zero.checkpoint import accelerate_fsdp, async_save, dcp_read
from accelerate_zero.checkpoint.accelerate_fsdp import fsdp_folders
from accelerate_zero.checkpoint.accelerate_fsdp_save import FULL, SHARDED, save_fsdp
from accelerate_zero.checkpoint.deepspeed_universal import find_deepspeed_folder
from accelerate_zero.checkpoint.hf_export import save_pretrained_parallel
from accelerate_zero.checkpoint.model_export import export_files, not_a_checkpoint
from accelerate_zero.config.checkpoint_writer import decoupled
from accelerate_zero.engine.engine import ZeroEngine
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin
from accelerate_zero.integrations.accelerate.prepared import (
    PreparedModel,
    ZeroOptimizerWrapper,
    ZeroSchedulerWrapper,
)


CHECKPOINT_TAG = "zero_model"
"""`save_state` writes the i-th trained model's engine checkpoint to `<output_dir>/zero_model[_i]/`."""


def checkpointed(prepared: list[PreparedModel]) -> list[tuple[str, PreparedModel]]:
    """The models prepared with an optimizer, each with the tag its engine checkpoint is saved under."""
    trained = [entry for entry in prepared if entry.optimizer is not None]
    return [(CHECKPOINT_TAG if i == 0 else f"{CHECKPOINT_TAG}_{i}", entry) for i, entry in enumerate(trained)]


def save_state(
    accelerator: Accelerator,
    prepared: list[PreparedModel],
    save: Callable[[str | None, bool], str],
    output_dir: str | None,
    safe_serialization: bool,
    engine_kwargs: dict[str, Any],
) -> str:
    """`ZeroAccelerator.save_state`: `save` (accelerate's own) with every trained engine saving its shards first,
    asynchronously when `engine_kwargs` say so or, without `async_save` there, the config's
    `checkpoint.writer.decoupled` does.

    Returns:
        The folder written.
    """

    fsdp_type = _fsdp_state_dict_type(accelerator, engine_kwargs)
    engine_kwargs = engine_save_kwargs(accelerator.zero_plugin, engine_kwargs) if fsdp_type is None else {}

    def save_engines(models: list, weights: list, folder: str) -> None:
        for index, (tag, entry) in enumerate(checkpointed(prepared)):
            if fsdp_type is not None:  # [Note: accelerate's FSDP folders out] in checkpoint/accelerate_fsdp_save.py
                save_fsdp(entry.engine, folder, index, fsdp_type)
            else:
                entry.engine.save_checkpoint(folder, tag=tag, **engine_kwargs)

    # With `async_save=True` the engines' writers run on after this returns. accelerate's `total_limit` removes the
    # oldest folders before it saves, which may be the one still written: its writer is waited for first.
    for _, entry in checkpointed(prepared)[:1]:
        async_save.finish(entry.engine.layout.world)
    with accelerate_state_only(accelerator, prepared, "_save_model_state_pre_hook", save_engines):
        return save(output_dir, safe_serialization)


FSDP_FORMATS = {"fsdp": SHARDED, "fsdp_full": FULL}
"""`save_state(checkpoint_format=...)` values that write accelerate's FSDP layout, and its state_dict_type."""


def _fsdp_state_dict_type(accelerator: Accelerator, engine_kwargs: dict[str, Any]) -> str | None:
    """SHARDED_STATE_DICT / FULL_STATE_DICT when `checkpoint_format` asks for accelerate's FSDP layout, else None.

    Raises:
        ValueError: other engine arguments with it, or an engine-owned scheduler (a config `scheduler` block): an
            FSDP run restores the schedulers accelerate prepared (scheduler.bin), which that one is not.
    """
    kind = FSDP_FORMATS.get(engine_kwargs.get("checkpoint_format", ""))
    if kind is None:
        return None
    others = sorted(set(engine_kwargs) - {"checkpoint_format"})
    if others:
        raise ValueError(f"checkpoint_format={engine_kwargs['checkpoint_format']!r} takes no {others}: remove them")
    if any(isinstance(s, ZeroSchedulerWrapper) for s in accelerator._schedulers):
        raise ValueError(
            f"checkpoint_format={engine_kwargs['checkpoint_format']!r}: the scheduler comes from the ZeRO config's "
            "`scheduler` block, which an FSDP run does not have (it restores the schedulers accelerate prepared, "
            "from scheduler.bin). Build a torch scheduler and pass it to prepare() instead, or save the default format"
        )
    return kind


def engine_save_kwargs(plugin: ZeroPlugin, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`engine_kwargs` with `async_save=True` added when they do not set it and the plugin's config has
    `checkpoint.writer.decoupled: true` ([Note: DeepSpeed's checkpoint writer] in config/checkpoint_writer.py)."""
    if "async_save" not in engine_kwargs and decoupled(plugin.deepspeed_config()):
        return {**engine_kwargs, "async_save": True}
    return engine_kwargs


def load_state(
    accelerator: Accelerator,
    prepared: list[PreparedModel],
    load: Callable[..., None],
    input_dir: str | None,
    load_kwargs: dict | None,
    load_model_func_kwargs: dict[str, Any],
) -> None:
    """`ZeroAccelerator.load_state`: `load` (accelerate's own) with every trained engine loading its shards and the
    registered objects loaded safely first. `load_optimizer_states` / `load_lr_scheduler_states` in
    `load_model_func_kwargs` go to the engines, the rest to `load`."""
    keys = ("load_optimizer_states", "load_lr_scheduler_states")
    engine_kwargs = {key: value for key, value in load_model_func_kwargs.items() if key in keys}
    accelerate_kwargs = {key: value for key, value in load_model_func_kwargs.items() if key not in keys}
    if input_dir is not None:
        _refuse_model_export(Path(input_dir), prepared)
    if input_dir is not None and dcp_read.is_dcp_folder(Path(input_dir)):
        _load_dcp(prepared, input_dir, engine_kwargs)
        return
    with custom_objects_hidden(accelerator) as custom_objects:

        def load_engines(models: list, folder: str) -> None:
            trained = checkpointed(prepared)
            for index, (tag, entry) in enumerate(trained):
                tag = saved_tag(Path(folder), index, tag, len(trained))
                entry.engine.load_checkpoint(folder, tag=tag, **engine_kwargs)
                entry.optimizer._step_was_skipped = False
            load_custom_objects_safely(custom_objects, folder)

        with accelerate_state_only(accelerator, prepared, "_load_model_state_pre_hook", load_engines):
            load(input_dir, load_kwargs, **accelerate_kwargs)


DEEPSPEED_TAG = "pytorch_model"
"""accelerate's DeepSpeed `save_state` writes the i-th model's engine checkpoint as tag `pytorch_model[_i]`."""


def saved_tag(folder: Path, index: int, ours: str, trained: int) -> str | None:
    """The tag under which `folder` holds the `index`-th trained model's state: ours (`zero_model[_i]`), accelerate's
    FSDP (`pytorch_model_fsdp_<i>` with `optimizer_<i>`, [Note: accelerate's FSDP folders] in
    checkpoint/accelerate_fsdp.py) or DeepSpeed (`pytorch_model[_i]`) save_state folders; None (the folder's
    `latest`) for a bare DeepSpeed `save_checkpoint` folder of the one trained model."""
    if (folder / ours).exists():
        return ours
    fsdp = accelerate_fsdp.model_dir(index)
    if fsdp_folders(folder, fsdp) is not None or accelerate_fsdp.full_state_files(folder, fsdp) is not None:
        return fsdp
    deepspeed = DEEPSPEED_TAG if index == 0 else f"{DEEPSPEED_TAG}_{index}"
    if find_deepspeed_folder(folder, deepspeed) is not None:
        return deepspeed
    if trained == 1 and find_deepspeed_folder(folder, None) is not None:
        return None
    return ours


def _refuse_model_export(folder: Path, prepared: list[PreparedModel]) -> None:
    """A `save_pretrained` folder given to `load_state` is named as what it is (no model state of any layout in it)."""
    exported, trained = export_files(folder), checkpointed(prepared)
    if not exported or not trained or dcp_read.is_dcp_folder(folder):
        return
    tag = trained[0][0]
    if not (folder / tag).exists() and saved_tag(folder, 0, tag, len(trained)) == tag:
        raise ValueError(not_a_checkpoint(folder, exported))


def _load_dcp(prepared: list[PreparedModel], folder: str, engine_kwargs: dict[str, Any]) -> None:
    """A DCP checkpoint written by FSDP2 or torchtitan ([Note: DCP checkpoints in] in checkpoint/dcp_load.py): the
    one trained model's engine loads it (weights, optimizer state, steps, an engine-owned scheduler); the folder
    holds no accelerate state (RNG, dataloaders), so none is restored.

    Raises:
        ValueError: not exactly one model is prepared with an optimizer.
    """
    trained = checkpointed(prepared)
    if len(trained) != 1:
        raise ValueError(
            f"{folder} is a DCP checkpoint (one model's state) but {len(trained)} models are prepared with an "
            "optimizer: load it with engine.load_checkpoint(folder) on the engine it belongs to"
        )
    entry = trained[0][1]
    entry.engine.load_checkpoint(folder, **engine_kwargs)
    entry.optimizer._step_was_skipped = False


def check_16bit_weights_gathered(engine: ZeroEngine, plugin: ZeroPlugin) -> None:
    """Refuses to gather a stage-3 model's 16-bit weights unless the config or the plugin allows it (as accelerate
    does for DeepSpeed).

    Raises:
        ValueError: at stage 3 when `stage3_gather_16bit_weights_on_model_save` is false (accelerate's DeepSpeed
            message).
    """
    gather = engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
    if engine.stage == 3 and not (gather or plugin.zero3_save_16bit_model):
        raise ValueError(
            "Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` in the ZeRO "
            "config is False. To save the model weights in 16bit, set "
            "`zero_optimization.stage3_gather_16bit_weights_on_model_save` to True in the DeepSpeed config file "
            "or set `zero3_save_16bit_model` to True when using `accelerate config` (or "
            "`ZeroPlugin(zero3_save_16bit_model=True)`). To save the full checkpoint, run "
            "`accelerator.save_state(save_dir)`: every rank writes its shards."
        )


@contextlib.contextmanager
def accelerate_state_only(
    accelerator: Accelerator, prepared: list[PreparedModel], hooks_attr: str, engine_hook: Callable[..., None]
) -> Iterator[None]:
    """[Note: save_state/load_state] accelerate's own save_state/load_state run unchanged (folder naming,
    RNG, schedulers, dataloaders, custom objects) with the ZeRO models, optimizers and engine-owned schedulers
    hidden from them: their generic path writes model/optimizer files on the main process only, which would
    lose the other ranks' shards. The engines are saved/loaded by a pre-hook, which accelerate calls with the
    resolved folder, before its own files.

    Args:
        accelerator: whose `_models`, `_optimizers`, `_schedulers` and pre-hooks are swapped while the block runs.
        prepared: the models its engines train.
        hooks_attr: `_save_model_state_pre_hook` or `_load_model_state_pre_hook`.
        engine_hook: the pre-hook saving or loading the engines; the user's pre-hooks run after it, with every
            prepared model.
    """
    saved = accelerator._models, accelerator._optimizers, accelerator._schedulers, getattr(accelerator, hooks_attr)
    all_models = list(accelerator._models)
    zero_models = {id(entry.model) for entry in prepared}
    hooks: OrderedDict = OrderedDict(zero=engine_hook)
    for key, hook in saved[3].items():
        hooks[key] = _with_models(hook, all_models)
    accelerator._models = [m for m in accelerator._models if id(m) not in zero_models]
    accelerator._optimizers = [o for o in accelerator._optimizers if not isinstance(o, ZeroOptimizerWrapper)]
    accelerator._schedulers = [s for s in accelerator._schedulers if not isinstance(s, ZeroSchedulerWrapper)]
    setattr(accelerator, hooks_attr, hooks)
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers, accelerator._schedulers = saved[:3]
        setattr(accelerator, hooks_attr, saved[3])


@contextlib.contextmanager
def custom_objects_hidden(accelerator: Accelerator) -> Iterator[list]:
    """Yields the objects registered for checkpointing while accelerate sees a stand-in with their count and no
    items: accelerate unpickles them with weights_only=False, so they are loaded by `load_custom_objects_safely`
    instead (accelerate still checks their count against the files)."""
    custom_objects = accelerator._custom_objects
    accelerator._custom_objects = _LoadedByZero(len(custom_objects))
    try:
        yield custom_objects
    finally:
        accelerator._custom_objects = custom_objects


def load_custom_objects_safely(objects: list, folder: str) -> None:
    """Loads `custom_checkpoint_<i>.pkl` into each registered object with `weights_only=True`: tensors, numbers,
    strings and containers (and numpy arrays, as accelerate allows) only; never arbitrary pickled objects.

    Raises:
        ValueError: a file holds anything else (naming the file and the fix).
    """
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


def exports_in_parallel(model: Any, engine: Any, adapter_keys: set[str] | None, plugin: Any) -> bool:
    """Whether `save_model` writes the weights with every rank writing its files ([Note: parallel Hugging Face
    export] in checkpoint/hf_export.py) rather than gathering them onto rank 0: at stage 3 (below it every rank
    holds the 16-bit weights already), not for a PEFT model (its adapter is one small file), and only when
    `save_pretrained` would write the names the model uses: transformers 5 reverts a model's weight conversions when it
    saves (fused experts split back, renamed keys), which may join tensors of several files, so a model with any is
    saved through rank 0. Not either without `stage3_gather_16bit_weights_on_model_save` (the engine state is
    saved instead, as with DeepSpeed)."""
    if engine.stage != 3 or adapter_keys is not None or getattr(engine, "experts", None) is not None:
        return False  # split experts: full_state_dict gathers them whole (rank 0's path)
    try:
        check_16bit_weights_gathered(engine, plugin)
    except ValueError:
        return False
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # another transformers: keep the path save_pretrained takes
        return False
    meta = engine.meta_state_dict()
    return revert_weight_conversion(model, meta) is meta


def save_model_in_parallel(
    accelerator: Any, model: Any, save_directory: str | os.PathLike[str], max_shard_size: int | str
) -> bool:
    """`ZeroAccelerator.save_model` at stage 3: every rank writes its share of the weight files ([Note: parallel
    Hugging Face export] in checkpoint/hf_export.py) when `exports_in_parallel` allows it (not for a PEFT model,
    whose adapter is one small file); returns False (nothing written) otherwise. Every rank must call it."""
    prepared = accelerator.prepared_model_of(model)
    adapter = getattr(model, "peft_config", None)
    if prepared is None or adapter is not None:
        return False
    if not exports_in_parallel(model, prepared.engine, None, accelerator.zero_plugin):
        return False
    folder = Path(save_directory)
    if accelerator.is_main_process:  # a previous save's files would mix with this one's (as accelerate cleans)
        folder.mkdir(parents=True, exist_ok=True)
        for old in [*folder.glob("model*.safetensors"), *folder.glob("model.safetensors.index.json")]:
            old.unlink()
    accelerator.wait_for_everyone()
    save_pretrained_parallel(prepared.engine, folder, convert_file_size_to_int(max_shard_size))
    return True
