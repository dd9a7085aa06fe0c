"""Engine checkpoints under injected faults: every case is a clear error naming the file or parameter, never wrong
values loaded in silence.

One 2-rank group saves the checkpoints (stage 2 with AdamW and with SGD, stage 0); the pytest process damages
copies of them (flipped data or header bytes, truncated files, rank files of another job); one 1-rank group then
loads every copy into a fresh engine, and into models of another size and optimizers of another class, and
returns what happened. `consolidate` is checked on the same copies in the pytest process.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed


GLOBAL_BATCH = 4


class Toy(nn.Module):
    """Uneven shapes; `hidden` changes every shape but the names, `extra` adds one layer."""

    def __init__(self, hidden: int = 15, extra: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(7, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 3)
        self.extra = nn.Linear(7, 3) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))
        return y + self.extra(x) if self.extra is not None else y


def _engine(stage: int, optimizer: str = "AdamW", hidden: int = 15, extra: bool = False, seed: int = 5) -> Any:
    import accelerate_zero

    torch.manual_seed(seed)
    model = Toy(hidden, extra)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if optimizer == "AdamW"
        else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    )
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 60}}
    return accelerate_zero.initialize(model, opt, config=config)


def _train(engine: Any, rank: int, world_size: int, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
        per = GLOBAL_BATCH // world_size
        part = slice(rank * per, (rank + 1) * per)
        engine.backward(nn.functional.mse_loss(engine(x[part]), y[part]))
        engine.step()


def _flat(engine: Any) -> torch.Tensor:
    return torch.cat([t.float().reshape(-1) for t in engine.full_state_dict().values()])


def _save_all(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out = {}
    for name, stage, optimizer, extra in (
        ("adamw", 2, "AdamW", True),
        ("sgd", 2, "SGD", True),
        ("stage0", 0, "AdamW", False),
    ):
        engine = _engine(stage, optimizer, extra=extra, seed=0)
        _train(engine, rank, world_size)
        engine.save_checkpoint(f"{root}/{name}")
        out[name] = _flat(engine) if rank == 0 else torch.zeros(0)
        engine.destroy()
    return out


def _outcome(action: Any) -> str:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            action()
        except Exception as error:  # the message is what the test checks
            return f"error {type(error).__name__}: {error}"
    notes = [str(w.message) for w in caught if "checkpoint" in str(w.message) or "lacks" in str(w.message)]
    return "ok" + "".join(f" | warning: {n}" for n in notes)


def _load_all(rank: int, world_size: int, root: str, cases: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in cases:
        engine = _engine(2, extra=True)
        results[case] = _outcome(lambda case=case, engine=engine: engine.load_checkpoint(f"{root}/{case}"))
        if case == "adamw":
            results["adamw values"] = _flat(engine)
    for label, kwargs in (("smaller", {"hidden": 12}), ("larger", {"hidden": 18})):
        engine = _engine(2, extra=True, **kwargs)
        results[label] = _outcome(lambda engine=engine: engine.load_checkpoint(f"{root}/adamw"))
    engine = _engine(2, extra=False)
    results["model lacks extra"] = _outcome(lambda: engine.load_checkpoint(f"{root}/adamw"))
    for label, saved, optimizer in (("sgd into adamw", "sgd", "AdamW"), ("adamw into sgd", "adamw", "SGD")):
        engine = _engine(2, optimizer, extra=True)
        results[label] = _outcome(lambda engine=engine, saved=saved: engine.load_checkpoint(f"{root}/{saved}"))
    engine = _engine(2, "AdamW", extra=True)
    results["sgd weights only"] = _outcome(lambda: engine.load_checkpoint(f"{root}/sgd", load_optimizer_states=False))
    results["sgd weights only values"] = _flat(engine)
    return results


# ------------------------------------------------------------------------------------------------ damage
def _folder(root: Path, case: str) -> Path:
    return root / case / "global_step2"


def _copy(root: Path, source: str, case: str) -> Path:
    shutil.copytree(root / source, root / case)
    return _folder(root, case)


def _header_length(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _flip_data(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    start = _header_length(path)
    for i in range(count):
        data[start + (i * 7) % (len(data) - start)] ^= 0x5A
    path.write_bytes(bytes(data))


def _rename_in_header(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    header = _header_length(path)
    assert len(old) == len(new) and old in data[:header]
    path.write_bytes(data[:header].replace(old, new, 1) + data[header:])


def _strip_checksums(folder: Path) -> None:
    """A folder as an older version wrote it (no checksums), to test the checks that do not rely on them."""
    meta = json.loads((folder / "meta.json").read_text())
    meta.pop("files", None), meta.pop("meta_sha256", None)
    (folder / "meta.json").write_text(json.dumps(meta))


def _damage(root: Path) -> None:
    _flip_data(_copy(root, "adamw", "flipped data") / "rank00001.safetensors", 1000)
    _rename_in_header(_copy(root, "adamw", "flipped header") / "rank00000.safetensors", b"exp_avg_sq", b"exp_avg_sr")
    folder = _copy(root, "adamw", "renamed fragment, no checksums")
    _rename_in_header(folder / "rank00000.safetensors", b"exp_avg_sq", b"exp_avg_sr")
    _strip_checksums(folder)
    shard = _copy(root, "adamw", "truncated shard") / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    folder = _copy(root, "adamw", "truncated shard, no checksums")
    shard = folder / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _strip_checksums(folder)
    meta = _copy(root, "adamw", "truncated meta") / "meta.json"
    meta.write_text(meta.read_text()[:100])
    folder = _copy(root, "adamw", "foreign rank files")
    for rank in (2, 3):  # a killed save of a 4-rank job under the same tag
        shutil.copy(folder / "rank00001.safetensors", folder / f"rank{rank:05d}.safetensors")
    folder = _copy(root, "adamw", "edited shapes")
    meta = json.loads((folder / "meta.json").read_text())
    meta["param_shapes"]["inp.weight"] = [7, 15]  # transposed
    (folder / "meta.json").write_text(json.dumps(meta))


DAMAGED = [
    "flipped data",
    "flipped header",
    "renamed fragment, no checksums",
    "truncated shard",
    "truncated shard, no checksums",
    "truncated meta",
    "foreign rank files",
    "edited shapes",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("faults")
    saved = run_distributed(_save_all, 2, str(root))[0]
    _damage(root)
    loaded = run_distributed(_load_all, 1, str(root), ["adamw", *DAMAGED])[0]
    return root, saved, loaded


def test_intact_checkpoint_loads_exactly(checkpoints: tuple) -> None:
    _, saved, loaded = checkpoints
    assert loaded["adamw"] == "ok"
    assert torch.equal(loaded["adamw values"], saved["adamw"])


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("flipped data", r"rank00001\.safetensors does not match its checksum"),
        ("flipped header", r"rank00000\.safetensors does not match its checksum"),
        ("renamed fragment, no checksums", r"no 'exp_avg_sq' optimizer state for \w+\.\w+\[\d+:\d+\]"),
        # A truncated file no longer parses: every rank opens every file's header before hashing what it reads.
        ("truncated shard", r"rank00001\.safetensors is not a readable safetensors file .*: it is truncated"),
        ("truncated shard, no checksums", r"rank00001\.safetensors is not a readable safetensors file"),
        ("truncated meta", r"meta\.json is not valid JSON .*truncated"),
        ("foreign rank files", r"rank00002\.safetensors, rank00003\.safetensors.*the job had 2 ranks"),
        ("edited shapes", r"meta\.json does not match its own checksum"),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_file(checkpoints: tuple, case: str, expected: str) -> None:
    _, _, loaded = checkpoints
    assert loaded[case].startswith("error ValueError"), loaded[case]
    assert re.search(expected, loaded[case]), loaded[case]


@pytest.mark.parametrize(("case", "model"), [("smaller", "[12, 7]"), ("larger", "[18, 7]")])
def test_other_hidden_size_is_refused_naming_parameter_and_both_shapes(
    checkpoints: tuple, case: str, model: str
) -> None:
    _, _, loaded = checkpoints
    assert loaded[case].startswith("error ValueError"), loaded[case]
    assert f"inp.weight: checkpoint [15, 7], model {model}" in loaded[case]


def test_checkpoint_parameters_the_model_lacks_are_named_in_a_warning(checkpoints: tuple) -> None:
    _, _, loaded = checkpoints
    assert loaded["model lacks extra"].startswith("ok | warning:"), loaded["model lacks extra"]
    assert "extra.bias, extra.weight" in loaded["model lacks extra"]


def test_optimizer_class_mismatch_is_refused_unless_states_are_skipped(checkpoints: tuple) -> None:
    _, saved, loaded = checkpoints
    assert "a SGD optimizer with 1 param groups; this engine's optimizer is a AdamW" in loaded["sgd into adamw"]
    assert "a AdamW optimizer with 1 param groups; this engine's optimizer is a SGD" in loaded["adamw into sgd"]
    assert "load_optimizer_states=False" in loaded["sgd into adamw"]
    assert loaded["sgd weights only"] == "ok"
    assert torch.equal(loaded["sgd weights only values"], saved["sgd"])


# ------------------------------------------------------------------------------------------------ consolidate
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("flipped data", r"rank00001\.safetensors does not match its checksum"),
        ("truncated shard", r"rank00001\.safetensors does not match its checksum"),
        ("truncated shard, no checksums", r"rank00001\.safetensors is not a readable safetensors file"),
        ("truncated meta", r"meta\.json is not valid JSON"),
        ("foreign rank files", r"rank00002\.safetensors"),
        ("edited shapes", r"meta\.json does not match its own checksum"),
    ],
)
def test_consolidate_refuses_damaged_checkpoints_with_exit_2(
    checkpoints: tuple, case: str, expected: str, capsys: pytest.CaptureFixture
) -> None:
    import argparse

    from accelerate_zero.cli.consolidate import run

    root, _, _ = checkpoints
    code = run(
        argparse.Namespace(
            checkpoint=str(root / case), output=str(root / f"out {case}"), dtype="fp32", format="safetensors"
        )
    )
    assert code == 2
    assert re.search(expected, capsys.readouterr().err)


def test_consolidate_checks_meta_shapes_against_the_files(checkpoints: tuple) -> None:
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict

    root, _, _ = checkpoints
    folder = _copy(root, "adamw", "edited shapes, no checksums")
    meta = json.loads((folder / "meta.json").read_text())
    meta["param_shapes"]["inp.weight"] = [8, 15]
    (folder / "meta.json").write_text(json.dumps(meta))
    _strip_checksums(folder)
    with pytest.warns(UserWarning, match="no checksums"), pytest.raises(ValueError, match=r"inp\.weight the shape"):
        consolidated_state_dict(root / "edited shapes, no checksums")


def test_consolidate_of_a_two_rank_stage0_checkpoint(checkpoints: tuple) -> None:
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict

    root, saved, _ = checkpoints
    state = consolidated_state_dict(root / "stage0")
    assert torch.equal(torch.cat([t.reshape(-1) for t in state.values()]), saved["stage0"])


# ------------------------------------------------------------------------------------------------ optimizers
def _adagrad(rank: int, world_size: int) -> torch.Tensor:
    import accelerate_zero

    torch.manual_seed(0)
    model = Toy()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.25)
    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0}
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    _train(engine, rank, world_size, steps=3)
    return _flat(engine) if rank == 0 else torch.zeros(0)


def test_adagrad_state_made_by_its_constructor_is_accepted() -> None:
    torch.manual_seed(0)
    model = Toy()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.25)
    _train_reference(model, optimizer, steps=3)
    expected = torch.cat([t.reshape(-1) for t in model.state_dict().values()])
    got = run_distributed(_adagrad, 2)[0]
    # Same arithmetic up to the order of the gradient average (two halves vs one batch): fp32 rounding.
    assert (got - expected).abs().max().item() < 1e-6


def _train_reference(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


# ------------------------------------------------------------------------------------------------ resources
def _nvme_engine(nvme_path: str) -> Any:
    import accelerate_zero

    torch.manual_seed(0)
    model = Toy()
    offload = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}
    zero = {"stage": 2, "offload_optimizer": offload, "sub_group_size": 50, "reduce_bucket_size": 60}
    return accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters()), config={"zero_optimization": zero})


def _nvme_space(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import errno
    import shutil as shutil_module

    from accelerate_zero.offload import nvme

    engine = _nvme_engine(f"{root}/nvme")
    need = int((nvme.rank_folder(f"{root}/nvme", rank) / ".bytes_needed").read_text())
    _train(engine, rank, world_size, steps=1)
    engine.save_checkpoint(f"{root}/ckpt")
    real_usage, real_save_file = shutil_module.disk_usage, nvme.save_file
    # The ranks live on for other tests (tests/helpers/dist.py): every patch is undone before returning.
    try:
        # A disk with room for one rank's files but not for both ranks'.
        nvme.shutil.disk_usage = lambda path: real_usage(path)._replace(free=need * 3 // 2)
        results = {"need": need, "too small": _outcome(lambda: _nvme_engine(f"{root}/nvme2"))}
        nvme.shutil.disk_usage = real_usage

        def full(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        nvme.save_file = full  # the disk fills after training started
        results["fills later"] = _outcome(lambda: _train(engine, rank, world_size, steps=1))
    finally:
        nvme.shutil.disk_usage, nvme.save_file = real_usage, real_save_file
    return results


def test_nvme_space_is_summed_over_the_ranks_sharing_a_disk(tmp_path: Path) -> None:
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict

    results = run_distributed(_nvme_space, 2, str(tmp_path))
    for rank, result in enumerate(results):
        message, need = result["too small"], result["need"]
        assert message.startswith("error OSError"), message
        assert f"nvme_path='{tmp_path}/nvme2' has {need * 3 // 2:,} bytes free" in message
        assert (
            f"the 2 ranks using it (0, 1) need {results[0]['need'] + results[1]['need']:,} bytes together" in message
        )
        filled = result["fills later"]
        assert filled.startswith("error OSError") and "No space left on device" in filled, filled
        assert re.search(rf"writing [\d,]+ bytes to {tmp_path}/nvme/accelerate_zero/rank0000{rank}/\S+ failed", filled)
    assert consolidated_state_dict(tmp_path / "ckpt")  # the checkpoint saved before the disk filled is intact


# ------------------------------------------------------------------------------------------------ accelerate
def _touch(path: str) -> str:
    Path(path).write_text("unpickled")
    return path


class _Runs:
    """Pickles to a call of `_touch`: loading it with weights_only=False would run code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return _touch, (self.marker,)


class _Registered:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _custom_objects(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2}
    accelerator = ZeroAccelerator(ZeroPlugin(config=config))
    model = Toy()
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    plain = _Registered({"count": 3, "values": torch.arange(4.0), "name": "ema"})
    unsafe = _Registered({"payload": _Runs(f"{root}/marker")})
    accelerator.register_for_checkpointing(plain, unsafe)
    accelerator.save_state(f"{root}/state")
    plain.state, unsafe.state = {}, {}
    outcome = _outcome(lambda: accelerator.load_state(f"{root}/state"))
    return {"outcome": outcome, "plain": plain.state, "registered": len(accelerator._custom_objects)}


def test_load_state_never_unpickles_registered_objects(tmp_path: Path) -> None:
    result = run_distributed(_custom_objects, 1, str(tmp_path))[0]
    assert result["outcome"].startswith("error ValueError"), result["outcome"]
    assert "custom_checkpoint_1.pkl (the state of _Registered" in result["outcome"]
    assert "never unpickles arbitrary objects" in result["outcome"]
    assert not (tmp_path / "marker").exists()  # no code from the file ran
    assert result["plain"]["count"] == 3 and result["plain"]["name"] == "ema"  # plain values load pickle-free
    assert torch.equal(result["plain"]["values"], torch.arange(4.0))
    assert result["registered"] == 2


# ------------------------------------------------------------------------------------------------ distributed faults
def _skipped_micro_step(rank: int, world_size: int) -> dict[str, Any]:
    import time

    import accelerate_zero

    results = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = Toy()
        config = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2}
        engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters()), config=config)
        x, y = torch.randn(2, 7), torch.randn(2, 3)

        def loop(engine: Any = engine, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            for micro in range(4):
                engine.set_gradient_accumulation_boundary(micro % 2 == 1)  # as accelerate and the Trainer do
                if rank == 1 and micro == 0:
                    continue  # this rank caught an exception in its forward and went on
                engine.backward(nn.functional.mse_loss(engine(x), y))
                engine.step()

        start = time.perf_counter()
        results[f"stage {stage}"] = _outcome(loop)
        results[f"stage {stage} seconds"] = time.perf_counter() - start
        engine.destroy()
    return results


def test_a_rank_out_of_step_fails_at_once_naming_the_counters() -> None:
    by_rank = run_distributed(_skipped_micro_step, 2)
    for rank, results in enumerate(by_rank):
        for stage in (0, 1, 2, 3):
            message = results[f"stage {stage}"]
            assert message.startswith("error RuntimeError: ranks are out of step"), (rank, stage, message)
            if stage < 2:  # caught at the optimizer step: rank 1 reached the boundary one micro-step early
                assert "at the optimizer step: micro-step counters by rank [1, 0]" in message
            else:  # stages 2 and 3 reduce every backward: caught at the first one (rank 1 is on the boundary)
                assert "at backward: positions" in message and "by rank [0, 1]" in message
            # At the first boundary: far sooner than the process-group timeout (60 s in tests, 30 min by default).
            assert results[f"stage {stage} seconds"] < 30
