"""Engine checkpoint folders in tests: every value one holds (whatever world size saved it), and the damage the
corruption tests do to a rank file, with the error loading must then raise."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def saved_values(folder: str | Path) -> dict[str, torch.Tensor]:
    """`<name>/<kind>` -> the fp32 master, an optimizer state tensor, a frozen parameter (`param`), or a scalar
    (AdamW's `step`), read from every rank file of the checkpoint folder after checking its checksums. Two folders
    saved from the same state at different world sizes give equal dicts."""
    from accelerate_zero.checkpoint.io import FragmentReader
    from accelerate_zero.checkpoint.meta import read_meta, verify_files

    folder = Path(folder)
    meta = read_meta(folder)
    reader = FragmentReader(verify_files(folder, meta))
    out = {}
    for name in meta["param_shapes"]:
        extent = reader.extent(name)
        for kind in sorted(reader.kinds_of(name)):
            scalar = reader.read_scalar(name, kind, 0, extent)
            if scalar is not None and scalar.ndim == 0:
                out[f"{name}/{kind}"] = scalar
            else:
                out[f"{name}/{kind}"] = reader.read_range(name, kind, 0, extent)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], kind: str) -> float:
    """The largest |a - b| over the values of `kind` (both must hold the same parameters' values of it)."""
    keys = sorted(k for k in a if k.endswith(f"/{kind}"))
    assert keys and keys == sorted(k for k in b if k.endswith(f"/{kind}")), kind
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys)


def _header_end(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def flip_one_byte(path: Path) -> None:
    """One bit of one byte in the middle of a safetensors file's tensor data: it still parses, only a value changes."""
    data = bytearray(path.read_bytes())
    data[(_header_end(path) + len(data)) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def leave_third_rank_file(path: Path) -> None:
    """What a killed save of a 3-rank job leaves under the same tag: a third rank file next to `path`."""
    shutil.copy(path, path.with_name("rank00002.safetensors"))


DAMAGE = {
    "flipped byte": ("rank00001.safetensors", flip_one_byte),
    "truncated": ("rank00000.safetensors", truncate),
    "3-rank leftover": ("rank00001.safetensors", leave_third_rank_file),
}
"""case -> (the rank file of a 2-rank checkpoint it damages, how)."""
EXPECTED = {
    "flipped byte": r"{folder}/rank00001\.safetensors does not match its checksum in meta\.json",
    # every rank opens every file's header (the index of what is where) before hashing what it reads
    "truncated": r"{folder}/rank00000\.safetensors is not a readable safetensors file .*: it is truncated",
    "3-rank leftover": (
        r"{folder} holds rank files the save did not write \(rank00002\.safetensors; the job had 2 ranks\)"
    ),
}
"""case -> a regular expression the loading error must match, `{folder}` being the (escaped) checkpoint folder."""
