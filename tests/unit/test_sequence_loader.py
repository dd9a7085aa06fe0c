"""The sequence-parallel loader's batch rules (accelerate_zero/sequence/loader.py), in one process: what it makes of a
batch, what it refuses by name, and how it skips and marks the end of accelerate's loader. The exchange between
ranks and the training it feeds are in tests/distributed/test_sequence_parallel_loops.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence.loader import SequenceShardedLoader, cut_for_group, whole_rows


def _batch(lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n], mask[row, :n] = torch.arange(1, n + 1) + 10 * row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_rows_are_shifted_on_the_whole_row_padded_to_the_group_and_lose_the_mask() -> None:
    rows = whole_rows(_batch([5, 3], 5), p=4, pad_token_id=7)
    assert sorted(rows) == ["input_ids", "position_ids", "shift_labels", "ulysses_token_mask"]
    assert rows["ulysses_token_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5], "real tokens, for counting"
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7, 7, 7], [11, 12, 13, 0, 0, 7, 7, 7]]
    assert rows["shift_labels"].tolist() == [[2, 3, 4, 5, -100, -100, -100, -100], [12, 13] + [-100] * 6]
    assert rows["position_ids"].tolist() == [list(range(8))] * 2
    given = whole_rows({"input_ids": torch.ones(1, 3, dtype=torch.long), "shift_labels": torch.tensor([[4, 5, 6]])}, 3)
    assert given["shift_labels"].tolist() == [[4, 5, 6]], "shift_labels given by a collator are kept"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.update(attention_mask=b["attention_mask"].flip(1)), r"padding before or between tokens"),
        (lambda b: b["labels"].__setitem__((1, 4), 3), r"labels on padded positions .* are not -100"),
        (lambda b: b.update(position_ids=torch.tensor([[0, 1, 3, 4, 5]] * 2)), r"do not count 0, 1, 2, \.\.\. within"),
        (lambda b: b.pop("labels"), r"trains on 'labels' \(or 'shift_labels'\)"),
        (lambda b: b.update(source="wiki"), r"'source' is str"),
        (lambda b: b.update(pixel_values=torch.ones(2)), r"'pixel_values' is a tensor of shape \(2,\)"),
        (lambda b: b.update(token_type_ids=torch.ones(2, 4)), r"'token_type_ids' has shape \(2, 4\)"),
    ],
)
def test_batches_ulysses_cannot_train_on_are_refused_by_name(change, message: str) -> None:
    batch = _batch([5, 3], 5)
    change(batch)
    with pytest.raises(ValueError, match=message):
        whole_rows(batch, p=2)


def test_packed_rows_keep_their_positions_and_give_their_sequences() -> None:
    """A padding-free batch: two rows of several sequences; positions restart at 0, the padding joins the last
    sequence, the collator's boundary keys are dropped (they would be wrong once cut)."""
    from accelerate_zero.sequence.loader import sequences_of

    ids = torch.arange(1, 11).reshape(2, 5)
    batch = {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]),
        "cu_seq_lens_q": torch.tensor([0, 3, 5]),
        "max_length_q": 3,
    }
    rows = whole_rows(batch, p=4)
    assert sorted(rows) == ["input_ids", "position_ids", "shift_labels", "ulysses_token_mask"]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert sequences_of(rows["position_ids"]) == [[(0, 3), (3, 8)], [(0, 8)]]
    assert sequences_of(torch.arange(6).expand(2, 6)) is None, "one sequence per row: the fast path"


def test_a_fixed_length_is_enforced() -> None:
    whole_rows(_batch([5], 5), p=2, seq_length=5)
    with pytest.raises(ValueError, match=r"6 tokens per row, but sp_seq_length=5 .*sp_seq_length_is_variable=True"):
        whole_rows(_batch([5], 6), p=2, seq_length=5)


class _AccelerateLikeLoader:
    """Marks its last batch as accelerate's `DataLoaderShard` does (`end_of_dataloader`)."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches, self.end_of_dataloader = batches, False

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for index, batch in enumerate(self.batches):
            self.end_of_dataloader = index == len(self.batches) - 1
            yield batch


def test_one_rank_group_gives_each_batch_whole_and_marks_only_the_last_piece_as_the_end() -> None:
    group = DataParallelGroup(None, 0, 1)
    pieces = cut_for_group(_batch([4, 2], 4), group, CommStats())
    assert len(pieces) == 1 and pieces[0]["input_ids"].shape == (2, 4)
    inner = _AccelerateLikeLoader([_batch([3], 3), _batch([2], 2)])
    training = [True]
    loader = SequenceShardedLoader(inner, 1, lambda: (group, CommStats()), is_training=lambda: training[0])
    ends = []
    for piece in loader:
        ends.append(inner.end_of_dataloader)
        assert "shift_labels" in piece
    assert ends == [False, True] and len(loader) == 2
    training[0] = False
    assert [sorted(b) for b in loader] == [["attention_mask", "input_ids", "labels"]] * 2, "not training: whole"


def test_skipping_drops_micro_batches_from_the_first_pass_only() -> None:
    group = DataParallelGroup(None, 0, 1)
    inner = _AccelerateLikeLoader([_batch([n], n) for n in (2, 3, 4)])
    loader = SequenceShardedLoader(inner, 1, lambda: (group, CommStats()), skip=2)
    assert len(loader) == 1
    assert [piece["input_ids"].shape[1] for piece in loader] == [4]
    assert [piece["input_ids"].shape[1] for piece in loader] == [2, 3, 4]


def test_grpo_config_keeps_sequence_parallelism_that_trl_refuses(tmp_path: Path) -> None:
    """TRL's GRPOConfig refuses sp_size > 1; ours keeps it for the trainer ([Note: GRPO under sequence parallelism])."""
    from accelerate import ParallelismConfig
    from trl import GRPOConfig

    from accelerate_zero.integrations.trl import ZeroGRPOConfig

    def parallelism() -> ParallelismConfig:
        return ParallelismConfig(sp_backend="deepspeed", sp_size=2)

    with pytest.raises(ValueError, match="sp_size"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], parallelism_config=parallelism())
    args = ZeroGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], parallelism_config=parallelism())
    assert args.parallelism_config.sp_size == 2


def test_sequence_parallel_evaluation_is_refused_where_it_cannot_act() -> None:
    """Nothing accepted and ignored: without sp nothing is cut. The Trainer and ZeroSFTTrainer cut each evaluation
    batch in `prediction_step` (tests/distributed/test_sequence_parallel_loops.py); ZeroGRPOTrainer/ZeroDPOTrainer cut
    inside their scoring instead (tests/distributed/test_sequence_parallel_rl.py)."""
    from accelerate_zero.integrations.transformers.trainer import ZeroTrainerMixin
    from accelerate_zero.integrations.trl.sequence_parallel import SequenceParallelTRLMixin

    def trainer(base: type, sp: int, asked: bool = True) -> Any:
        fields = {
            "args": type("Args", (), {"sequence_parallel_evaluation": asked})(),
            "accelerator": type("Accelerator", (), {"sequence_parallel_size": sp})(),
        }
        return type(base.__name__ + "Like", (base,), fields)()

    rl = type("RL", (SequenceParallelTRLMixin, ZeroTrainerMixin), {})
    for base in (ZeroTrainerMixin, rl):
        with pytest.raises(ValueError, match="without sequence parallelism: nothing is cut"):
            trainer(base, 1)._check_sequence_parallel_evaluation()
        trainer(base, 2)._check_sequence_parallel_evaluation()
        trainer(base, 1, asked=False)._check_sequence_parallel_evaluation()
    assert trainer(ZeroTrainerMixin, 2)._cuts_evaluation_batches()
    assert not trainer(ZeroTrainerMixin, 2, asked=False)._cuts_evaluation_batches()
    assert not trainer(rl, 2)._cuts_evaluation_batches(), "TRL's scoring cuts; its batches pass whole"
