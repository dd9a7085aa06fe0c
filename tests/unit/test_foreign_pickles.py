"""The restricted reading of other frameworks' pickles ([Note: reading foreign pickles] in
accelerate_zero/checkpoint/safe_pickle.py): DeepSpeed's classes become inert stand-ins without importing deepspeed,
and their loss-scaler state becomes ours; anything else is refused by name and never runs."""

from __future__ import annotations

import os
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch

from accelerate_zero.checkpoint.foreign import loss_scaler_state
from accelerate_zero.checkpoint.safe_pickle import foreign_name, load_foreign


class _NamedPickler(pickle._Pickler):
    """Writes a class by the name it stands for (`pickled_as`) without importing that module: DeepSpeed's own
    classes are named as DeepSpeed writes them, and deepspeed is never imported."""

    def save_global(self, obj: object, name: str | None = None) -> None:
        named = getattr(obj, "pickled_as", None)
        if named is None:
            super().save_global(obj, name)
            return
        module, _, qualname = named.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def _saved_as(tmp_path: Path, full_name: str, attributes: dict) -> Path:
    """A torch file holding an object of a class pickled as `full_name` with `attributes`."""
    cls = type(full_name.rsplit(".", 1)[1], (), {"pickled_as": full_name})
    obj = cls()
    obj.__dict__.update(attributes)
    path = tmp_path / f"{cls.__name__}.pt"
    module = types.SimpleNamespace(Pickler=_NamedPickler, __name__="pickle")
    torch.save({"optimizer_state_dict": {"loss_scaler": obj, "x": torch.ones(3)}}, path, pickle_module=module)
    return path


def test_deepspeed_dynamic_loss_scaler_is_read_as_our_state(tmp_path: Path) -> None:
    attributes = {"cur_scale": 1024.0, "cur_iter": 7, "last_overflow_iter": 3, "cur_hysteresis": 2, "dynamic": True}
    path = _saved_as(tmp_path, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", attributes)
    before = set(sys.modules)
    saved = load_foreign(path)["optimizer_state_dict"]
    assert not [m for m in set(sys.modules) - before if m.startswith("deepspeed")]  # nothing of it imported
    assert foreign_name(saved["loss_scaler"]) == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    state = loss_scaler_state(saved["loss_scaler"])
    assert state == {"scale": 1024.0, "iteration": 7, "last_overflow_iteration": 3, "hysteresis_left": 2}
    assert torch.equal(saved["x"], torch.ones(3))


def test_a_class_outside_the_allow_list_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class SystemCall:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    torch.save({"x": SystemCall()}, tmp_path / "evil.pt")
    path = _saved_as(tmp_path, "deepspeed.runtime.engine.DeepSpeedEngine", {})  # a DeepSpeed class not allowed
    with pytest.raises(ValueError, match=r"evil\.pt holds an object .*system.*nothing it names ran"):
        load_foreign(tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"DeepSpeedEngine\.pt holds an object .*DeepSpeedEngine"):
        load_foreign(path)
    assert not marker.exists()
