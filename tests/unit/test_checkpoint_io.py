"""Checkpoint folders under injected faults, in one process: kills at every rename of a save, stale partial folders,
tags that leave the folder, and `meta.json` files that are truncated, edited or hold junk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from accelerate_zero.checkpoint import io
from accelerate_zero.checkpoint.meta import read_meta, verify_files, write_meta


class Killed(Exception):
    """Stands in for the process dying at this point."""


def _meta(**overrides: object) -> dict:
    meta = {
        "format": "accelerate_zero/1",
        "stage": 2,
        "world_size": 2,
        "global_steps": 3,
        "micro_steps": 3,
        "skipped_steps": 0,
        "param_shapes": {"w": [7, 15]},
        "optimizer": "AdamW",
        "param_groups": [{"lr": 0.01}],
    }
    return {**meta, **overrides}


def _save(save_dir: Path, tag: str, payload: str) -> None:
    """A one-rank save through the real folder protocol; the checkpoint holds `payload`."""
    work = io.fresh_partial_dir(save_dir, tag)
    (work / "rank00000.safetensors").write_text(payload)
    write_meta(work, _meta(world_size=1), {})
    io.publish_dir(save_dir, tag, lambda: None, True)


def _latest_is_complete(save_dir: Path) -> str | None:
    """The payload of the checkpoint `latest` names (None before any save); fails if it is not complete."""
    if not (save_dir / "latest").exists():
        return None
    folder = io.resolve_tag(save_dir, None)
    read_meta(folder)
    return (folder / "rank00000.safetensors").read_text()


@pytest.mark.parametrize("first_tag", ["last", "global_step1"])
def test_latest_names_a_complete_checkpoint_at_every_instant_of_a_resave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_tag: str
) -> None:
    real_replace = os.replace
    calls = 0

    def count(src: object, dst: object) -> None:
        nonlocal calls
        calls += 1
        real_replace(src, dst)

    save_dir = tmp_path / "probe"
    _save(save_dir, first_tag, "old")
    monkeypatch.setattr(io.os, "replace", count)
    _save(save_dir, "last", "new")
    monkeypatch.setattr(io.os, "replace", real_replace)
    total = calls
    assert total >= 2
    for kill_at in range(total):
        save_dir = tmp_path / f"kill{kill_at}"
        _save(save_dir, first_tag, "old")
        seen = 0

        def dying(src: object, dst: object, kill_at: int = kill_at, save_dir: Path = save_dir) -> None:
            nonlocal seen
            assert _latest_is_complete(save_dir) in ("old", "new")  # before every rename
            if seen == kill_at:
                raise Killed
            seen += 1
            real_replace(src, dst)
            assert _latest_is_complete(save_dir) in ("old", "new")  # and after it

        monkeypatch.setattr(io.os, "replace", dying)
        with pytest.raises(Killed):
            _save(save_dir, "last", "new")
        monkeypatch.setattr(io.os, "replace", real_replace)
        assert _latest_is_complete(save_dir) in ("old", "new"), kill_at
        # The next successful save publishes and removes every leftover of the killed one.
        _save(save_dir, "last", "newer")
        assert _latest_is_complete(save_dir) == "newer"
        assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".")) == [], kill_at


def test_a_save_starts_from_an_empty_partial_folder(tmp_path: Path) -> None:
    stale = io.partial_dir(tmp_path, "last")
    stale.mkdir()
    for rank in range(4):  # a killed save of a 4-rank job
        (stale / f"rank{rank:05d}.safetensors").write_text("stale")
    (tmp_path / ".other.partial").mkdir()
    _save(tmp_path, "last", "fresh")
    assert sorted(p.name for p in (tmp_path / "last").iterdir()) == ["meta.json", "rank00000.safetensors"]
    assert not (tmp_path / ".other.partial").exists()


def test_loading_refuses_rank_files_the_save_did_not_write(tmp_path: Path) -> None:
    _save(tmp_path, "last", "x")
    folder = tmp_path / "last"
    (folder / "rank00003.safetensors").write_text("from a 4-rank job")
    with pytest.raises(ValueError, match=r"rank00003\.safetensors.*another job"):
        verify_files(folder, read_meta(folder))


def test_a_changed_or_missing_file_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "rank00000.safetensors").write_bytes(b"abcdef")
    from accelerate_zero.checkpoint.meta import file_digest

    write_meta(folder, _meta(world_size=1), {"rank00000.safetensors": file_digest(folder / "rank00000.safetensors")})
    assert verify_files(folder, read_meta(folder)) == [folder / "rank00000.safetensors"]
    (folder / "rank00000.safetensors").write_bytes(b"abcdeF")
    with pytest.raises(ValueError, match=r"rank00000\.safetensors does not match its checksum"):
        verify_files(folder, read_meta(folder))
    (folder / "rank00000.safetensors").unlink()
    with pytest.raises(ValueError, match=r"rank00000\.safetensors is missing"):
        verify_files(folder, read_meta(folder))


@pytest.mark.parametrize("latest", ["../elsewhere", "/tmp", "a/../../b", "..", ""])
def test_latest_cannot_leave_the_folder(tmp_path: Path, latest: str) -> None:
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (save_dir / "latest").write_text(latest)
    with pytest.raises(ValueError, match="not a folder name inside the checkpoint folder"):
        io.resolve_tag(save_dir, None)
    with pytest.raises(ValueError, match="not a folder name"):
        io.resolve_tag(save_dir, "../elsewhere")


def test_meta_json_truncated_edited_or_junk_is_refused_naming_the_file(tmp_path: Path) -> None:
    write_meta(tmp_path, _meta(), {})
    path = tmp_path / "meta.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{path}.*not valid JSON.*truncated"):
        read_meta(tmp_path)
    edited = json.loads(text)
    edited["param_shapes"]["w"] = [15, 7]
    path.write_text(json.dumps(edited))
    with pytest.raises(ValueError, match=rf"{path} does not match its own checksum"):
        read_meta(tmp_path)
    # Junk values are refused even where no checksum protects the file (a hand-written or older meta.json).
    junk = _meta(global_steps="five", stage=7, param_shapes={"w": [7, "x"]})
    path.write_text(json.dumps(junk))
    with pytest.raises(ValueError) as error:
        read_meta(tmp_path)
    message = str(error.value)
    assert str(path) in message
    assert "global_steps='five'" in message and "stage=7" in message and "param_shapes['w']" in message
    path.write_bytes(b"\xff\xfe junk")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_meta(tmp_path)
