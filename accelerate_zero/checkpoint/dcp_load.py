"""Loading a DCP checkpoint written by FSDP2 or torchtitan into an engine of any stage and world size.

[Note: DCP checkpoints in]
FSDP2 saves `{"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer), ...}` with
`dcp.save`; DCP flattens the nesting into keys `model.<parameter name>`, `optim.state.<parameter name>.<state>`
(`exp_avg`, `exp_avg_sq`, `step`) and `optim.param_groups.<i>.<hyperparameter>`; torchtitan puts the model's keys
at the top level and the optimizer under `optimizer.`, flattened (`flatten_optimizer_state_dict`: hyperparameters
keyed by parameter name, `optimizer.param_groups.<name>.<hyperparameter>`). The prefixes are found from the model's own parameter names.
The folder is checked whole before anything is read: every model parameter must be there with its shape, and no
other tensor may be under the model's prefix (a checkpoint of another model is refused naming the keys); every
data file must be present ([Note: reading DCP folders safely] in dcp_read.py). Each rank then reads, one trainable
batch at a time, the full tensors of the parameters its ranges touch and keeps its ranges: no collective. The
engine's step counter is the optimizer's `step` (torchtitan's `train_state.step` when present), and a scheduler
saved under `lr_scheduler.` restores the engine's scheduler.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accelerate_zero.checkpoint import dcp_read
from accelerate_zero.checkpoint.foreign_load import on_every_rank
from accelerate_zero.checkpoint.fragments import Fragment, range_fragments
from accelerate_zero.engine.checkpoint_state import CheckpointState, ShardRange, StepCounters


if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from accelerate_zero.checkpoint.engine_view import ZeroEngine


_MODEL_PREFIXES = ("model.", "")
_OPTIMIZER_PREFIXES = ("optim.", "optimizer.", "")
_OTHER_TOP_LEVEL = ("optim", "optimizer", "lr_scheduler", "train_state", "dataloader", "scheduler", "extra_state")


def _read_metadata(folder: Path, optimizer_folder: Path | None) -> tuple[Metadata, Metadata | None]:
    metadata = dcp_read.read_metadata(folder)
    dcp_read.check_data_files(folder, metadata)
    if optimizer_folder is None:
        return metadata, None
    opt_metadata = dcp_read.read_metadata(optimizer_folder)
    dcp_read.check_data_files(optimizer_folder, opt_metadata)
    return metadata, opt_metadata


def _fragments(shard_range: ShardRange, names: dict[int, str]) -> list[Fragment]:
    # a split layer's experts name their range of the whole layer ([Note: expert parallelism in the engine])
    return range_fragments(
        shard_range.plan, shard_range.params, names, shard_range.lo, shard_range.hi, shard_range.offsets
    )


def _model_prefix(shapes: dict[str, list[int]], params: dict[str, list[int]], folder: Path) -> str:
    best = max(_MODEL_PREFIXES, key=lambda prefix: sum(prefix + name in shapes for name in params))
    if not any(best + name in shapes for name in params):
        sample = ", ".join(sorted(shapes)[:8])
        raise ValueError(
            f"{folder} is a DCP checkpoint without any of the model's parameters (under 'model.' or at the top "
            f"level; it holds {sample}, ...): it was saved from another model"
        )
    return best


def _check_model_keys(
    shapes: dict[str, list[int]], params: dict[str, list[int]], buffers: set[str], prefix: str, folder: Path
) -> None:
    problems = []
    missing = sorted(name for name in params if prefix + name not in shapes)
    if missing:
        problems.append(f"missing {len(missing)} parameters of the model: {', '.join(missing[:10])}")
    wrong = [
        f"{name}: checkpoint {shapes[prefix + name]}, model {shape}"
        for name, shape in params.items()
        if prefix + name in shapes and shapes[prefix + name] != list(shape)
    ]
    if wrong:
        problems.append(f"{len(wrong)} shapes differ: {'; '.join(wrong[:10])}")
    known = set(params) | buffers
    extra = sorted(
        key[len(prefix) :]
        for key in shapes
        if key.startswith(prefix) and key[len(prefix) :] not in known and key.split(".")[0] not in _OTHER_TOP_LEVEL
    )
    if extra:
        problems.append(f"{len(extra)} tensors the model lacks: {', '.join(extra[:10])}")
    if problems:
        raise ValueError(
            f"{folder} (a DCP checkpoint, model keys under {prefix or 'the top level'!r}) was saved from another "
            f"model: {'; '.join(problems)}. Build the model the checkpoint was saved from"
        )


def _optimizer_prefix(shapes: dict[str, list[int]], trained: list[str]) -> str | None:
    for prefix in _OPTIMIZER_PREFIXES:
        if any(key.startswith(f"{prefix}state.{trained[0]}.") for key in shapes):
            return prefix
    return None


def _state_kinds(shapes: dict[str, list[int]], prefix: str, name: str) -> list[str]:
    head = f"{prefix}state.{name}."
    return sorted(key[len(head) :] for key in shapes if key.startswith(head) and "." not in key[len(head) :])


def load_dcp(
    engine: ZeroEngine,
    folder: Path,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    optimizer_folder: Path | None = None,
) -> dict:
    """Restores weights (and optimizer state, step counters, scheduler) from the DCP checkpoint `folder`
    ([Note: DCP checkpoints in]); every rank must call it. Returns an empty client state.

    Args:
        optimizer_folder: a second DCP folder holding the optimizer state (accelerate's FSDP `save_state` writes
            `pytorch_model_fsdp_0/` and `optimizer_0/`); None: `folder` holds it, if anything does.

    Raises:
        ValueError: on every rank ([Note: a foreign checkpoint fails on every rank] in foreign_load.py): the folder
            is of another model (naming the keys), misses or has a damaged data file (naming it), or has no
            optimizer state while `load_optimizer_states` is True.
    """
    metadata, opt_metadata = on_every_rank(engine, lambda: _read_metadata(folder, optimizer_folder))
    state = engine.checkpoint_state()
    shapes = dcp_read.tensor_shapes(metadata) | (dcp_read.tensor_shapes(opt_metadata) if opt_metadata else {})
    params = state.param_shapes()
    buffers = {name for name, _ in state.module.named_buffers()}
    aliases = {name for name, _ in state.module.named_parameters(remove_duplicate=False)} - set(params)
    prefix = _model_prefix(shapes, params, folder)
    _check_model_keys(shapes, params, buffers | aliases, prefix, folder)
    trained = [name for name, p in state.module.named_parameters() if p.requires_grad]
    opt_prefix = _optimizer_prefix(shapes, trained) if trained else None
    if load_optimizer_states and trained and opt_prefix is None:
        raise ValueError(
            f"{folder} holds no optimizer state for {trained[0]} (no key '<prefix>state.{trained[0]}.<state>'): "
            "pass load_optimizer_states=False to load the weights only"
        )
    opt_where = (optimizer_folder, opt_metadata) if optimizer_folder is not None else (folder, metadata)
    source = _Source((folder, metadata), opt_where, prefix, opt_prefix if load_optimizer_states else None)
    names = {id(p): n for n, p in state.module.named_parameters()}

    def restore() -> float:
        with torch.no_grad():
            steps = _load_trainable(state, source, names)
            _load_rest(state, source, names, buffers)
        return steps

    steps = on_every_rank(engine, restore)
    state.finish_load()
    if load_optimizer_states:
        on_every_rank(engine, lambda: _load_param_groups(state, *opt_where, opt_prefix, trained))
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        on_every_rank(engine, lambda: _load_scheduler(engine.lr_scheduler, folder, metadata))
    step = on_every_rank(engine, lambda: dcp_read.load_value(folder, metadata, "train_state.step"))
    global_steps = int(step) if isinstance(step, int) else int(steps)
    accumulation = engine.config.gradient_accumulation_steps
    accumulation = accumulation if isinstance(accumulation, int) else 1
    state.restore_counters(StepCounters(global_steps, global_steps * accumulation, 0))
    engine.zero_grad()
    return {}


class _Source:
    """Full tensors read by parameter name and kind ("param" or an optimizer state): the model's from one DCP folder,
    the optimizer state's from the same or another."""

    def __init__(
        self, model: tuple[Path, Metadata], optim: tuple[Path, Metadata], prefix: str, opt_prefix: str | None
    ) -> None:
        self.where = {"param": model, "optim": optim}
        self.prefix, self.opt_prefix = prefix, opt_prefix
        self.shapes = dcp_read.tensor_shapes(model[1]) | dcp_read.tensor_shapes(optim[1])
        self.dtypes = {
            key: value.properties.dtype
            for _, metadata in (model, optim)
            for key, value in metadata.state_dict_metadata.items()
            if key in self.shapes
        }

    def kinds(self, name: str) -> list[str]:
        return [] if self.opt_prefix is None else _state_kinds(self.shapes, self.opt_prefix, name)

    def key(self, name: str, kind: str) -> str:
        return self.prefix + name if kind == "param" else f"{self.opt_prefix}state.{name}.{kind}"

    def read(self, wanted: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        tensors = {
            (name, kind): torch.empty(self.shapes[self.key(name, kind)], dtype=self.dtypes[self.key(name, kind)])
            for name, kind in wanted
        }
        for part, (folder, metadata) in self.where.items():
            keys = {self.key(n, k): t for (n, k), t in tensors.items() if (k == "param") == (part == "param")}
            dcp_read.load_tensors(folder, keys, metadata)
        return tensors


def _load_trainable(state: CheckpointState, source: _Source, names: dict[int, str]) -> float:
    """Masters and optimizer state of every trainable range; returns the largest optimizer `step` read (0: none)."""
    optimizer, steps = state.optimizer, 0.0
    for batch in state.trainable_batches(write_back=True):
        fragments = {id(t.master): _fragments(t.range, names) for t in batch}
        wanted = {
            (f.name, kind) for frags in fragments.values() for f in frags for kind in ["param", *source.kinds(f.name)]
        }
        full = source.read(sorted(wanted))
        for trainable in batch:
            master, frags = trainable.master, fragments[id(trainable.master)]
            for frag in frags:
                master[frag.offset : frag.offset + frag.numel].copy_(
                    full[frag.name, "param"].reshape(-1)[frag.start : frag.end]
                )
            if frags and source.opt_prefix is not None:
                optimizer.state[master] = _slice_state(full, frags, master, source.kinds(frags[0].name))
                step = optimizer.state[master].get("step")
                steps = max(steps, float(step)) if step is not None else steps
        state.write_trainable(batch)
    return steps


def _slice_state(
    full: dict[tuple[str, str], torch.Tensor], frags: list[Fragment], master: torch.Tensor, kinds: list[str]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for kind in kinds:
        first = full[frags[0].name, kind]
        if first.ndim == 0:
            out[kind] = first.to(torch.float32).clone()
            continue
        values = torch.zeros_like(master)
        for frag in frags:
            values[frag.offset : frag.offset + frag.numel].copy_(
                full[frag.name, kind].reshape(-1)[frag.start : frag.end]
            )
        out[kind] = values
    return out


def _load_rest(state: CheckpointState, source: _Source, names: dict[int, str], buffers: set[str]) -> None:
    """Stage-3 frozen shards, the parameters no rank shards, and the buffers the folder holds."""
    for frozen in state.frozen_shards():
        frags = _fragments(frozen.range, names)
        full = source.read(sorted({(f.name, "param") for f in frags}))
        shard = state.read_frozen(frozen)
        for frag in frags:
            shard[frag.offset : frag.offset + frag.numel].copy_(
                full[frag.name, "param"].reshape(-1)[frag.start : frag.end]
            )
        state.write_frozen(frozen, shard)
    covered = state.sharded_parameters()
    whole = [(name, p) for name, p in state.module.named_parameters() if id(p) not in covered]
    full = source.read([(name, "param") for name, _ in whole])
    for name, param in whole:
        offset = state.part_of_whole(param) or 0  # a frozen split expert: its range of the whole layer
        param.data.copy_(full[name, "param"].reshape(-1)[offset : offset + param.numel()].reshape(param.shape))
    saved = [(name, b) for name, b in state.module.named_buffers() if source.prefix + name in source.shapes]
    values = source.read([(name, "param") for name, _ in saved])
    for name, buffer in saved:
        buffer.copy_(values[name, "param"].reshape(buffer.shape))


def _load_param_groups(
    state: CheckpointState, folder: Path, metadata: Metadata, prefix: str | None, trained: list[str]
) -> None:
    """The optimizer's hyperparameters: keyed by group index (`get_optimizer_state_dict`), or by parameter name
    (`flatten_optimizer_state_dict=True`, as torchtitan saves), where every parameter must then agree on a value
    when there is more than one group (the folder does not say which group a name was in)."""
    groups = state.optimizer.param_groups
    for index, group in enumerate(groups):
        for hyper in [k for k in group if k != "params"]:
            value = dcp_read.load_value(folder, metadata, f"{prefix}param_groups.{index}.{hyper}")
            if value is None:
                value = _by_name(folder, metadata, f"{prefix}param_groups.", trained, hyper, len(groups))
            if value is not None:
                group[hyper] = value


def _by_name(folder: Path, metadata: Metadata, head: str, trained: list[str], hyper: str, groups: int) -> Any:
    values = [dcp_read.load_value(folder, metadata, f"{head}{name}.{hyper}") for name in trained]
    found = [value for value in values if value is not None]
    if not found or groups == 1:
        return found[0] if found else None
    if any(value != found[0] for value in found):
        raise ValueError(
            f"{folder} keys the optimizer's '{hyper}' by parameter name with different values, and the optimizer "
            f"has {groups} groups: which name belongs to which group is not in the folder. Load it with "
            "load_optimizer_states=False, or into an optimizer with one parameter group"
        )
    return found[0]


def _load_scheduler(scheduler: Any, folder: Path, metadata: Metadata) -> None:
    current = scheduler.state_dict()
    loaded = {key: dcp_read.load_value(folder, metadata, f"lr_scheduler.{key}") for key in current}
    if any(value is not None for value in loaded.values()):
        scheduler.load_state_dict({key: current[key] if value is None else value for key, value in loaded.items()})
