"""The NVMe stores on a one-rank group, in `tmp_path`: what is written comes back bit-identical (optimizer masters and
state, gradient slices, parameter shards), gradients accumulate or overwrite as told, read-ahead and flush keep
their promises, files have the size their contents need, and `close` leaves what the module docstrings say.

The swap files hold raw bytes without checksums (they live only as long as the job that wrote them); a file that
ends early is refused naming it, never read as whatever memory held before."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from accelerate_zero.engine.buckets import GradBucket, GradScaling, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.flat_buffer import build_group_shard, group_slices
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.shard_plan import plan_group
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.sharded_optimizer import ShardedOptimizer
from accelerate_zero.engine.stage3.flat_unit import build_flat
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.offload import nvme_params
from accelerate_zero.offload.host_memory import ChunkedHostMemory
from accelerate_zero.offload.nvme import NvmeSwapper
from accelerate_zero.offload.nvme_grads import NvmeGradSlot, NvmeGradStore
from accelerate_zero.offload.nvme_params import NvmeParamStore, choose_swapped, param_rank_folder, spill_shard


DP = DataParallelGroup(group=None, rank=0, world_size=1)
CPU = torch.device("cpu")


def _raw(path: Path, dtype: torch.dtype, numel: int, byte_offset: int = 0) -> torch.Tensor:
    """`numel` elements of `dtype` straight from the file's bytes (what a reader after a crash would see)."""
    data = path.read_bytes()[byte_offset : byte_offset + numel * torch.empty((), dtype=dtype).element_size()]
    return torch.frombuffer(bytearray(data), dtype=dtype)


# ----------------------------------------------------------------- optimizer (NvmeSwapper)
GROUP_SHAPES = [[(5,), (3, 3)], [(7,)]]  # two optimizer param groups; reduce_bucket_size 8: one bucket per param


def _stage2_slices() -> list[list[ShardSlice]]:
    """bf16 parameters with fp32 masters, one slice per bucket, each bucket holding a reduced random gradient."""
    torch.manual_seed(0)
    slices = []
    for shapes in GROUP_SHAPES:
        params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
        shard = build_group_shard(
            params,
            plan_group(shapes, 8, 1),
            rank=0,
            mode=ReduceMode.SCATTER_TO_SHARD,
            compute_dtype=torch.bfloat16,
            grad_dtype=torch.float32,
            comm_dtype=torch.float32,
            device=CPU,
            contiguous_gradients=False,
        )
        for bucket in shard.buckets:
            for slot in bucket.plan.slots:
                bucket.add_grad(slot, torch.randn(shapes[slot.param_index]))
            bucket.start_reduce(DP, CommStats(), GradScaling(1, False, 1.0, torch.float32), True, async_op=False)
            bucket.finish_reduce()
        slices.append(group_slices(shard))
    return slices


def _adam(params_by_group: list[list[torch.Tensor]]) -> torch.optim.Adam:
    groups = [{"params": params, "lr": lr} for params, lr in zip(params_by_group, (1e-2, 3e-2), strict=True)]
    return torch.optim.Adam(groups, foreach=False)


def _data_bytes(file: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the JSON header."""
    raw = file.read_bytes()
    (header,) = struct.unpack("<Q", raw[:8])
    return len(raw) - 8 - header


def _swapper(tmp_path: Path, slices: list[list[ShardSlice]], sub_group_numel: int = 16) -> NvmeSwapper:
    return NvmeSwapper(tmp_path / "rank0", slices, sub_group_numel, 2, lambda s: s.params)


def test_masters_start_from_the_parameters_and_live_only_in_files(tmp_path: Path) -> None:
    slices = _stage2_slices()
    start = [s.params.float() for group in slices for s in group]
    (tmp_path / "rank0").mkdir()
    swapper = _swapper(tmp_path, slices)
    assert all(s.master.numel() == 0 for group in slices for s in group), "between steps a master is a placeholder"
    files = sorted((tmp_path / "rank0").glob("*.safetensors"))
    assert len(files) == len(swapper.subgroups) > 1
    numel = sum(s.end - s.start for group in slices for s in group)
    assert sum(_data_bytes(f) for f in files) == 4 * numel and swapper.file_bytes() == sum(
        f.stat().st_size for f in files
    )
    resident = [s.master.clone() for batch in swapper.each_resident(_adam([[], []]), write_back=False) for s in batch]
    assert all(torch.equal(got, want) for got, want in zip(resident, start, strict=True))
    assert all(s.master.numel() == 0 for group in slices for s in group)
    swapper.close()
    assert not (tmp_path / "rank0").exists(), "close removes the optimizer folder"


def test_optimizer_state_written_back_is_read_back_bit_identical(tmp_path: Path) -> None:
    slices = _stage2_slices()
    (tmp_path / "rank0").mkdir()
    swapper = _swapper(tmp_path, slices)
    optimizer = _adam([[], []])
    written = {}
    for batch in swapper.each_resident(optimizer, write_back=True):
        for s in batch:
            s.master.add_(1.0)  # a checkpoint load changes masters and state
            written[id(s)] = (s.master.clone(), torch.randn(s.end - s.start), torch.tensor(7.0))
            optimizer.state[s.master] = {"exp_avg": written[id(s)][1].clone(), "step": written[id(s)][2].clone()}
    assert not optimizer.state, "state leaves memory with its sub-group"
    for batch in swapper.each_resident(optimizer, write_back=False):
        for s in batch:
            master, exp_avg, step = written[id(s)]
            state = optimizer.state[s.master]
            assert torch.equal(s.master, master) and torch.equal(state["exp_avg"], exp_avg)
            assert torch.equal(state["step"], step)
    swapper.close()


def test_steps_from_files_match_adam_in_memory_bit_for_bit(tmp_path: Path) -> None:
    slices = _stage2_slices()
    flat = [s for group in slices for s in group]
    reference = [[s.params.float() for s in group] for group in slices]
    grads = [s.bucket.reduced_slice(s.start, s.end).clone() for s in flat]
    ref_optimizer = _adam(reference)
    optimizer = _adam([[s.master for s in group] for group in slices])
    (tmp_path / "rank0").mkdir()
    swapper = _swapper(tmp_path, slices)
    sharded = ShardedOptimizer(
        optimizer,
        slices,
        DP,
        CommStats(),
        sharded=True,
        gradient_clipping=0.0,
        loss_scaler=None,
        check_overflow=False,
        publish=lambda: None,
        device=CPU,
    )
    ref_flat = [p for group in reference for p in group]
    for _ in range(2):  # the second step needs the first one's exp_avg and exp_avg_sq back from the files
        for param, grad in zip(ref_flat, grads, strict=True):
            param.grad = grad.clone()
        ref_optimizer.step()
        swapper.step(sharded, 1.0)
        for s, ref in zip(flat, ref_flat, strict=True):
            assert torch.equal(s.params, ref.to(torch.bfloat16)), "the step copied the masters into the parameters"
    assert swapper.peak_resident <= 2
    for batch in swapper.each_resident(optimizer, write_back=False):
        for s in batch:
            ref = ref_flat[flat.index(s)]
            state, ref_state = optimizer.state[s.master], ref_optimizer.state[ref]
            assert torch.equal(s.master, ref)
            assert all(torch.equal(state[key], ref_state[key]) for key in ("exp_avg", "exp_avg_sq", "step"))
    files = list((tmp_path / "rank0").glob("*.safetensors"))
    numel = sum(s.end - s.start for s in flat)
    # master, exp_avg and exp_avg_sq per element, plus one fp32 `step` per slice
    data_bytes, slice_count = sum(_data_bytes(f) for f in files), len(flat)
    assert data_bytes == 4 * 3 * numel + 4 * slice_count
    swapper.close()


# ----------------------------------------------------------------- gradients (NvmeGradStore)
class SlowCopies(HostCopies):
    """Host copies whose worker-side fetch takes `delay` seconds: writes stay pending long enough to observe."""

    def __init__(self, delay: float) -> None:
        super().__init__(CPU)
        self.delay = delay

    def to_host_in_worker(self, source: torch.Tensor) -> Callable[[], torch.Tensor]:
        fetch = super().to_host_in_worker(source)

        def slow() -> torch.Tensor:
            time.sleep(self.delay)
            return fetch()

        return slow


def _slots(
    path: Path, numels: tuple[int, ...] = (16, 8), buffer_count: int = 2, copies: HostCopies | None = None
) -> tuple[NvmeGradStore, list[NvmeGradSlot]]:
    """A store with one slot per bucket slice of `numels` elements, its file opened at `path`."""
    store = NvmeGradStore(buffer_count, copies or HostCopies(CPU))
    slots = [store.slot(numel) for numel in numels]
    store.open(path)
    return store, slots


def test_gradient_file_is_sized_for_every_slice_in_fp32(tmp_path: Path) -> None:
    store, slots = _slots(tmp_path / "gradients.bin", (16, 8, 24))
    assert store.file_bytes() == (tmp_path / "gradients.bin").stat().st_size == 4 * (16 + 8 + 24)
    slots[2].add(torch.randn(24, dtype=torch.bfloat16), 1.0, fresh=True)
    store.flush()
    assert store.file_bytes() == 4 * (16 + 8 + 24), "writes go into the slice's place, the file does not grow"
    store.close()


def test_gradients_accumulate_unless_fresh_and_read_back_bit_identical(tmp_path: Path) -> None:
    store, (first, second) = _slots(tmp_path / "gradients.bin")
    torch.manual_seed(0)
    a, b, c, other = torch.randn(16), torch.randn(16), torch.randn(16), torch.randn(8, dtype=torch.bfloat16)
    assert torch.equal(first.read(0, 16), torch.zeros(16)), "a slot nothing was written to reads zeros"
    first.add(a, 0.5, fresh=True)
    second.add(other, 1.0, fresh=True)  # a neighbour's slice must not overlap
    assert torch.equal(first.read(0, 16), a * 0.5)
    first.add(b, 0.5, fresh=False)
    summed = a * 0.5 + b * 0.5
    assert torch.equal(first.read(0, 16), summed)
    assert torch.equal(first.read(3, 11), summed[3:11])
    assert torch.allclose(first.square_norm(CPU), summed.double().square().sum(), rtol=1e-6, atol=0)
    first.add(c, 1.0, fresh=True)  # the next step: overwrite, do not add
    assert torch.equal(first.read(0, 16), c)
    got = second.read(0, 8)
    assert got.dtype == torch.float32 and torch.equal(got, other.float())
    first.clear()  # a cleared slot is zero without touching the file: the next add overwrites
    assert torch.equal(first.read(0, 16), torch.zeros(16)) and first.square_norm(CPU).item() == 0.0
    first.add(a, 1.0, fresh=False)
    assert torch.equal(first.read(0, 16), a)
    store.close()


def test_flush_lands_pending_gradient_writes_within_buffer_count(tmp_path: Path) -> None:
    path = tmp_path / "gradients.bin"
    store, slots = _slots(path, (16, 8, 8), copies=SlowCopies(0.1))
    values = [torch.randn(slot.numel) for slot in slots]
    for slot, value in zip(slots, values, strict=True):
        slot.add(value, 1.0, fresh=True)
    assert store.resident_tensors(), "a write still pending holds its slice in memory"
    assert not torch.equal(_raw(path, torch.float32, 8, 4 * 24), values[2]), "the last write cannot have landed yet"
    store.flush()
    assert store.resident_tensors() == []
    assert torch.equal(_raw(path, torch.float32, 32), torch.cat(values))
    assert store.peak_resident <= 2
    store.close()


def test_close_lands_pending_writes_and_keeps_the_file(tmp_path: Path) -> None:
    # The gradient file lives in the optimizer's folder and is removed with it (NvmeSwapper.close), not here.
    path = tmp_path / "gradients.bin"
    store, (slot,) = _slots(path, (16,), buffer_count=1, copies=SlowCopies(0.1))
    value = torch.randn(16)
    slot.add(value, 1.0, fresh=True)
    store.close()
    assert torch.equal(_raw(path, torch.float32, 16), value)


# ----------------------------------------------------------------- parameters (NvmeParamStore)
def _units(dtype: torch.dtype = torch.bfloat16) -> list[ParamUnit]:
    """Three stage-3 units of Linear(4, 4) (24 elements once padded); unit 1 has a frozen bias (a second flat)."""
    torch.manual_seed(0)
    units = []
    for index in range(3):
        layer = nn.Linear(4, 4)
        frozen = []
        if index == 1:
            layer.bias.requires_grad_(False)
            frozen = [layer.bias]
        trainable = [p for p in layer.parameters() if p.requires_grad]
        train_flat = build_flat(trainable, 0, 1, dtype, CPU)
        frozen_flat = build_flat(frozen, 0, 1, dtype, CPU) if frozen else None
        bucket = GradBucket(
            train_flat.plan, ReduceMode.SCATTER_TO_SHARD, 0, dtype, torch.float32, CPU, None, train_flat.params
        )
        units.append(ParamUnit(index, f"layers.{index}", layer, train_flat, frozen_flat, bucket))
    return units


def _store(tmp_path: Path, units: list[ParamUnit], max_in_cpu: int = 0, buffer_count: int = 3) -> NvmeParamStore:
    store = NvmeParamStore(str(tmp_path), 0, buffer_count=buffer_count, buffer_size=10**6, pin_memory=False)
    store.take(choose_swapped(units, max_in_cpu))
    return store


def test_shards_beyond_max_in_cpu_move_to_files_of_their_size(tmp_path: Path) -> None:
    units = _units()
    stale = param_rank_folder(str(tmp_path), 0)
    stale.mkdir(parents=True)
    (stale / "unit00009_trainable.bin").write_bytes(b"from an earlier job")
    first = units[0].trainable
    assert first is not None
    store = _store(tmp_path, units, max_in_cpu=first.plan.shard_numel)  # unit 0's shard stays in memory
    flats = [flat for unit in units for flat in unit.flats]
    swapped = [store.swapped(flat) for flat in flats]
    assert swapped == [False, True, True, True]
    kept, acquired = first.shard, store.acquire(first)
    assert acquired is kept, "a shard kept in memory is returned as it is"
    swapped_bytes = sum(f.plan.shard_numel * 2 for f in flats[1:])  # bf16
    files = list(stale.iterdir())
    assert len(files) == 3 and store.file_bytes() == swapped_bytes == sum(f.stat().st_size for f in files)
    store.close()
    assert not stale.exists(), "close removes the parameter folder"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_acquired_and_read_shards_are_bit_identical(tmp_path: Path, dtype: torch.dtype) -> None:
    units = _units(dtype)
    flats = [flat for unit in units for flat in unit.flats]
    original = [flat.shard.clone() for flat in flats]
    store = _store(tmp_path, units)
    for flat, want in zip(flats, original, strict=True):
        got = store.acquire(flat)
        assert got.dtype == dtype and torch.equal(got, want)
        store.release(flat)
        got = store.read(flat)
        assert torch.equal(got, want)
    store.close()


def test_read_ahead_then_acquire_returns_each_units_shard(tmp_path: Path) -> None:
    units = _units()
    original = {id(flat): flat.shard.clone() for unit in units for flat in unit.flats}
    store = _store(tmp_path, units, buffer_count=3)
    store.read_ahead(
        [flat for unit in units for flat in unit.flats]
    )  # 4 swapped flats; buffer_count - 1 = 2 may be read ahead
    assert store.peak_resident == 2
    for unit in units:
        for flat in unit.flats:
            got, want = store.acquire(flat), original[id(flat)]
            assert torch.equal(got, want)
            store.release(flat)
    store.close()


def test_written_slices_reach_the_file_by_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    units = _units()
    flat, bucket = units[2].trainable, units[2].bucket
    assert flat is not None and bucket is not None
    original, numel = flat.shard.clone(), flat.plan.shard_numel
    store = _store(tmp_path, units)
    files = {path: _raw(path, torch.bfloat16, numel) for path in param_rank_folder(str(tmp_path), 0).iterdir()}
    (path,) = [
        p for p, values in files.items() if values.numel() == original.numel() and torch.equal(values, original)
    ]
    landed = threading.Event()
    write_at = nvme_params.write_at

    def slow_write_at(*args: object) -> None:
        time.sleep(0.1)
        write_at(*args)  # type: ignore[arg-type]
        landed.set()

    monkeypatch.setattr(nvme_params, "write_at", slow_write_at)
    master = torch.randn(10)
    shard_slice = ShardSlice(bucket=bucket, start=4, end=14, master=master, params=torch.empty(0))
    assert store.holds(shard_slice)
    store.write_slice(shard_slice)
    store.overwrite(flat, torch.full((2,), 3.0), offset=18)
    assert not landed.is_set()
    store.flush()
    expected = original.clone()
    expected[4:14] = master.to(torch.bfloat16)
    expected[18:20] = 3.0
    in_file, read, acquired = _raw(path, torch.bfloat16, numel), store.read_slice(shard_slice), store.acquire(flat)
    assert torch.equal(in_file, expected)
    assert torch.equal(read, expected[4:14]) and torch.equal(acquired, expected)
    store.close()


def test_a_shard_larger_than_buffer_size_is_refused_naming_the_unit(tmp_path: Path) -> None:
    units = _units()
    with pytest.raises(ValueError, match=r"unit 'layers.0' \(24 elements on rank 0\).*at least 24"):
        NvmeParamStore(str(tmp_path), 0, buffer_count=2, buffer_size=23, pin_memory=False).take(
            choose_swapped(units, 0)
        )


def test_a_truncated_gradient_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "gradients.bin"
    store, (first, second) = _slots(path)
    first.add(torch.randn(16), 1.0, fresh=True)
    second.add(torch.randn(8), 1.0, fresh=True)
    store.flush()
    with open(path, "r+b") as file:
        file.truncate(4 * 20)  # the second slice (elements 16..24) loses its last 4 elements
    assert first.read(0, 16).shape == (16,)
    with pytest.raises(OSError, match=rf"{path}.* holds 16 of the 32 bytes expected at byte 64"):
        second.read(0, 8)
    store.close()


def test_a_truncated_parameter_file_is_refused_naming_it(tmp_path: Path) -> None:
    units = _units()
    store = _store(tmp_path, units)
    flat = units[2].trainable
    assert flat is not None
    path = store.shards[id(flat)].path
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(OSError, match=rf"{path}.* holds 10 of the 48 bytes"):
        store.acquire(flat)
    store.close()


def test_the_repr_of_a_sharded_flat_names_its_size_without_touching_freed_storage(tmp_path: Path) -> None:
    (unit, *_) = _units()
    flat = unit.trainable
    assert flat is not None and flat.full.untyped_storage().nbytes() == 0, "the unit is sharded"
    assert repr(flat) == "FlatUnitBuffer(2 params, 24 elements per rank)"


def test_a_shard_cut_from_a_shared_host_chunk_is_never_spilled(tmp_path: Path) -> None:
    (unit, *_) = _units()
    flat = unit.trainable
    assert flat is not None
    memory = ChunkedHostMemory(chunk_bytes=4096)
    neighbour = memory.zeros(8, torch.float32).fill_(5.0)
    flat.shard = memory.empty(flat.shard.numel(), flat.shard.dtype).copy_(flat.shard)
    # Freeing this buffer's storage would free the chunk under `neighbour` (a crash on a GPU's pinned chunks).
    with pytest.raises(AssertionError, match="shares storage"):
        spill_shard(flat, tmp_path / "shard.bin")
    assert torch.equal(neighbour, torch.full((8,), 5.0))
    own = torch.randn(flat.plan.shard_numel).to(flat.shard.dtype)
    flat.shard = own.clone()
    spill_shard(flat, tmp_path / "shard.bin")
    assert flat.shard.numel() == 0 and torch.equal(_raw(tmp_path / "shard.bin", own.dtype, own.numel()), own)
