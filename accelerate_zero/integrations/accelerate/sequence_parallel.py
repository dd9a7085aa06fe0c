"""Ulysses sequence parallelism through `ZeroAccelerator` (and so the Trainer): what accelerate does for DeepSpeed's
ALST when `ParallelismConfig(sp_backend="deepspeed", sp_size=p)` is given, done with accelerate_zero/sequence.

* Each model prepared with an optimizer gets Ulysses attention over its engine's sequence group (registered with
  transformers' `AttentionInterface`, `model.set_attn_implementation`), as accelerate's `UlyssesSPAttentionHF`
  registration does; DeepSpeed's `disable_in_eval` behaviour is ours too ([Note: Ulysses attention]).
* Data loaders passed to `prepare` together with a model to train become `SequenceShardedLoader`s ([Note: batches of
  a sequence-parallel group]), as accelerate wraps them in `UlyssesSPDataLoaderAdapter`; one prepared apart goes
  through `sequence_parallel_loader` (accelerate's `deepspeed_ulysses_dl_adapter` is the same).
* The loss of a micro-batch is `sequence_parallel_loss` (or the user's own weighted all-gather over
  `sequence_parallel_group`, as accelerate's docs show for DeepSpeed), normalised by the micro-batch's tokens or,
  given `num_items_in_batch` (`sequence_parallel_tokens`), by the whole step's ([Note: loss normalisation under
  sequence parallelism] in sequence/normalization.py).

accelerate's `sp_handler` (`DeepSpeedSequenceParallelConfig`) is read, not dropped: `sp_seq_length` with
`sp_seq_length_is_variable=False` fixes every batch's length, and `sp_attn_implementation` may only name SDPA,
the attention this engine runs over the whole sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import skip_first_batches as accelerate_skip_first_batches

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence import register_ulysses_attention, sequence_parallel_loss, tile_mlp
from accelerate_zero.sequence.loader import SequenceShardedLoader
from accelerate_zero.sequence.normalization import labelled_tokens, normalizer_for, summed


ULYSSES_PREFIX = "accelerate_zero_ulysses_"
"""How the attention names `register_ulysses_attention` registers begin."""


SUPPORTED_CORE_ATTENTION = (None, "sdpa")


def sequence_handler_settings(parallelism: Any) -> dict[str, Any]:
    """What accelerate's `sp_handler` asks of the loader: {"seq_length": fixed length or None}.

    Raises:
        ValueError: `sp_attn_implementation` names an attention other than SDPA.
    """
    handler = getattr(parallelism, "sp_handler", None) if parallelism is not None else None
    if handler is None or (getattr(parallelism, "sp_size", 1) or 1) <= 1:
        return {"seq_length": None}
    core = getattr(handler, "sp_attn_implementation", None)
    if core not in SUPPORTED_CORE_ATTENTION:
        raise ValueError(
            f"sp_handler.sp_attn_implementation={core!r}: accelerate_zero's Ulysses attention runs torch's SDPA over "
            "the whole sequence (its flash kernel on GPUs); set it to 'sdpa' or leave it unset"
        )
    variable = getattr(handler, "sp_seq_length_is_variable", True)
    return {"seq_length": None if variable in (None, True) else getattr(handler, "sp_seq_length", None)}


class SequenceParallelMixin:
    """ZeroAccelerator's sequence-parallel part; it reads `self._base_config`, `self.zero_engines`,
    `self._zero_models` and `self._sequence_settings`."""

    @property
    def sequence_parallel_size(self) -> int:
        """The ranks that share each sequence (`sequence_parallel_size`, or ParallelismConfig's `sp_size`)."""
        return self._base_config.sequence_parallel_size

    @property
    def cuts_sequences(self) -> bool:
        """Whether training batches take the sequence path: Ulysses (`sequence_parallel_size` > 1) or the config's
        `sequence_tiling`; then loaders prepared with the model are cut and the loss is `sequence_parallel_loss`."""
        return self.sequence_parallel_size > 1 or self._base_config.sequence_tiling.enabled

    def _trained_engine(self) -> Any:
        engines = [entry.engine for entry in self._zero_models if entry.optimizer is not None]
        if not engines:
            raise RuntimeError(
                "the sequence-parallel group is the engine's: prepare the model with its optimizer before iterating "
                "a sequence-parallel data loader or computing its loss"
            )
        return engines[0]

    def _sequence_group(self, engine: Any = None) -> tuple[DataParallelGroup, CommStats]:
        """The sequence-parallel group of `engine` (default: the training engine) and its counters."""
        engine = self._trained_engine() if engine is None else engine
        # tiling without Ulysses: each rank is its own group (a one-rank group makes no collective)
        group = engine.layout.sequence if engine.layout.sequence is not None else DataParallelGroup(None, 0, 1)
        return group, engine.comm_stats_counter

    def _evaluation_engine(self, model: torch.nn.Module) -> Any:
        """The engine whose sequence group scores `model`'s evaluation batches over cut sequences: the training
        engine; before training, the engine `model` was prepared with for inference (the Trainer's `evaluate()`
        and `predict()` prepare it so), whose layout has the same sequence group, its Ulysses attention attached to
        `model` on first use (training attaches its own again).

        Raises:
            RuntimeError: `model` is neither trained nor prepared.
        """
        if any(entry.optimizer is not None for entry in self._zero_models):
            return self._trained_engine()
        entry = next((entry for entry in self._zero_models if entry.model is model), None)
        if entry is None:
            raise RuntimeError(
                "evaluation over cut sequences needs the model prepared: pass it to accelerator.prepare() first"
            )
        name = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if not str(name).startswith(ULYSSES_PREFIX):
            self._attach_sequence_parallel(entry.model, entry.engine)
        return entry.engine

    @property
    def sequence_parallel_group(self) -> Any:
        """The torch process group of this rank's sequence-parallel group (for a loss of one's own, as accelerate's
        docs do with DeepSpeed's `groups._get_sequence_parallel_group()`)."""
        if self.sequence_parallel_size <= 1:
            raise RuntimeError("sequence_parallel_size is 1: no rank shares this rank's sequences")
        group = self._sequence_group()[0].group
        return group if group is not None else torch.distributed.group.WORLD

    def _attach_sequence_parallel(self, model: torch.nn.Module, engine: Any) -> None:
        """Ulysses attention over `engine`'s sequence group for `model` (sequence_parallel_size > 1), and the
        config's tiled MLPs (`sequence_tiling.mlp_tile_tokens`)."""
        if engine.config.sequence_tiling.mlp_tile_tokens is not None:
            tile_mlp(model, engine.config.sequence_tiling.mlp_tile_tokens)
        if engine.config.sequence_parallel_size <= 1:
            return
        if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
            raise ValueError(
                f"sequence_parallel_size={engine.config.sequence_parallel_size}: Ulysses attention goes through "
                f"transformers' attention interface; {type(model).__name__} is not a transformers model"
            )
        model.set_attn_implementation(register_ulysses_attention(engine.layout.sequence, engine.comm_stats_counter))

    def sequence_parallel_loader(self, loader: Any, only_while_training: bool = True) -> Any:
        """`loader` giving each rank its slice of the group's batches ([Note: batches of a sequence-parallel group]);
        `loader` itself without the sequence path (`cuts_sequences`) or wrapped already. With sequence_parallel_size
        1 each batch passes as one piece, its labels shifted and its mask checked.

        Args:
            only_while_training: batches pass whole while the model does not train (a loader that may feed an
                evaluation, as those `prepare` wraps may); False: always cut (a training loader read before the
                loop calls `model.train()`, as the Trainer's is)."""
        if not self.cuts_sequences or isinstance(loader, SequenceShardedLoader):
            return loader
        return SequenceShardedLoader(
            loader,
            self.sequence_parallel_size,
            self._sequence_group,
            is_training=(lambda: self._trained_engine().module.training) if only_while_training else None,
            seq_length=self._sequence_settings["seq_length"],
        )

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any = None) -> Any:
        """accelerate's name for `sequence_parallel_loader` (a loader prepared apart from its model)."""
        return self.sequence_parallel_loader(dl)

    def sequence_parallel_loss(
        self,
        model: torch.nn.Module,
        batch: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | float | None = None,
        **kwargs: Any,
    ) -> Any:
        """The loss of `batch` (a `SequenceShardedLoader` micro-batch), the same on every rank of the group ([Note:
        the loss over a sequence-parallel group]); `kwargs` (`tile_tokens`, `activations_on_host`) override the
        config's `sequence_tiling`.

        Args:
            num_items_in_batch: the labelled tokens of the whole optimizer step on every rank
                (`sequence_parallel_tokens` of the step's micro-batches): the step's gradient is then the sum of its
                token losses over that count, as transformers' Trainer normalises. None: this micro-batch's token
                mean, as `model(**batch).loss` is without sp ([Note: loss normalisation under sequence
                parallelism]).
        """
        group, stats = self._sequence_group()
        tiling = self._trained_engine().config.sequence_tiling
        kwargs = {
            "tile_tokens": tiling.logits_tile_tokens,
            "activations_on_host": tiling.activations_on_host,
            **kwargs,
        }
        return sequence_parallel_loss(
            model,
            batch,
            group,
            stats,
            return_outputs=return_outputs,
            num_items_in_batch=num_items_in_batch,
            data_parallel_size=self.sequence_data_parallel_size,
            **kwargs,
        )

    @property
    def sequence_data_parallel_size(self) -> int:
        """The number of sequence-parallel groups: world size / `sequence_parallel_size` (DeepSpeed ALST's rule)."""
        return max(1, self.num_processes // self.sequence_parallel_size)

    def sequence_parallel_normalizer(
        self, batch: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        """What the sum of every rank's token losses is divided by for `batch`: `num_items_in_batch` (the step's),
        or, None, this micro-batch's labelled tokens over the group times the number of groups ([Note: loss
        normalisation under sequence parallelism]). Every rank of the group must call it at the same time."""
        group, stats = self._sequence_group()
        return normalizer_for(
            batch["shift_labels"], num_items_in_batch, group, stats, self.sequence_data_parallel_size
        )

    def sequence_parallel_tokens(self, batches: list[dict[str, Any]], over_all_ranks: bool = True) -> torch.Tensor:
        """The normaliser of the step made of `batches` (this rank's micro-batches of one optimizer step) under
        the `accumulated_tokens` rule ([Note: loss normalisation under sequence parallelism]): their labelled tokens
        summed over every rank (`over_all_ranks`, transformers' `average_tokens_across_devices`), else the
        group's count times the number of groups (each group normalised by its own tokens, as each rank is without
        sp). Every rank must call it at the same time."""
        group, stats = self._sequence_group()
        local = labelled_tokens(batches)
        if over_all_ranks:
            world = self._trained_engine().layout.world
            return summed(local.to(self.device), world, stats)
        return summed(local.to(self.device), group, stats) * self.sequence_data_parallel_size

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's, and for a sequence-parallel loader: `num_batches` of its micro-batches skipped, whole
        batches of the loader under it without reading them."""
        if not isinstance(dataloader, SequenceShardedLoader):
            return super().skip_first_batches(dataloader, num_batches)  # type: ignore[misc]
        whole, rest = divmod(num_batches, dataloader.size)
        inner = accelerate_skip_first_batches(dataloader.loader, whole) if whole else dataloader.loader
        return SequenceShardedLoader(
            inner,
            dataloader.size,
            dataloader.group_source,
            dataloader.is_training,
            dataloader.pad_token_id,
            dataloader.seq_length,
            skip=rest,
        )
