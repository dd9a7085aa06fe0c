"""Saves checkpoint A, then starts saving checkpoint B and waits inside that save to be killed; or, as a fresh job,
loads what `latest` names and reports what it got.

Usage (what tests/integration/test_killed_save.py runs, 2 processes each):
    torchrun --nproc_per_node 2 tests/integration/scripts/killed_save.py --out DIR/POINT --pause POINT
    torchrun --nproc_per_node 2 tests/integration/scripts/killed_save.py --out LOG_DIR --load DIR/POINT [...]

Every rank writes <--out>/pid_rank<R> (its process id) when it starts. A job with `--pause` saves under
DIR/POINT/ckpt; POINT is where B's save stops:
    rank_file  rank 1 has written half of its rank file (rank 0 waits for it at the save's barrier)
    publish    B's folder is in place; rank 0 is about to point `latest` at it
    resave     A and B are both saved under the tag "last": B has replaced A's folder, `latest` still names the
               hard-linked copy of A that the save made first
    async      B is saved with async_save=True: rank 1's writer thread has written half of its rank file (rank 0's
               writer waits for it) while both ranks' training threads train another step and then wait
The stopping rank writes DIR/POINT/paused (atomically) and sleeps: the test then SIGKILLs every process of the
job. Only the moment of death is arranged here, by wrapping a function the save calls; the death itself is a real
kill.

`--load` builds a fresh engine per killed job's folder, loads its ckpt/ (what `latest` names), checks it against the
weights A was saved with, trains one step and saves again, and writes <folder>/loaded_rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

import accelerate_zero
from accelerate_zero.checkpoint import engine_io, io


STEPS_A, STEPS_B, BATCH = 2, 4, 6
PAUSE_SECONDS = 120  # the test kills the job within seconds; a job it never killed still ends


def _engine(seed: int) -> tuple[Any, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # A persistence threshold of 10 elements shards every parameter: each rank's file holds a part of every one.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10}
    engine = accelerate_zero.initialize(model, optimizer, config={"zero_optimization": zero})
    return engine, model


def _train(engine: Any, steps: range) -> None:
    rank, world_size = engine.dp.rank, engine.dp.world_size
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, 7, generator=generator), torch.randn(BATCH, 3, generator=generator)) for _ in range(8)
    ]
    per_rank = BATCH // world_size
    for step in steps:
        x, y = (t[rank * per_rank : (rank + 1) * per_rank] for t in batches[step])
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def _params(model: torch.nn.Module) -> torch.Tensor:
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _pause(out: Path, rank: int) -> None:
    marker = out / f".paused_rank{rank}"
    marker.write_text(str(os.getpid()))
    marker.rename(out / "paused")
    time.sleep(PAUSE_SECONDS)
    os._exit(3)


def _stop_inside_the_save(point: str, out: Path, rank: int) -> None:
    """Wraps the function of the checkpoint code that `point` stops in (on the rank that stops there)."""
    if point in ("rank_file", "async") and rank == 1:

        def half_written(tensors: dict[str, torch.Tensor], path: str, *args: Any, **kwargs: Any) -> None:
            from safetensors.torch import save

            data = save(tensors)
            with open(path, "wb") as handle:
                handle.write(data[: len(data) // 2])
                handle.flush()
                os.fsync(handle.fileno())
            _pause(out, rank)

        engine_io.save_file = half_written
    elif point in ("publish", "resave") and rank == 0:
        real_write_latest, calls = io.write_latest, []

        def write_latest(save_dir: Path, tag: str) -> None:
            # A fresh tag points `latest` once; re-saving "last" twice: first at the copy of A, then at B.
            calls.append(tag)
            if len(calls) == (1 if point == "publish" else 2):
                _pause(out, rank)
            real_write_latest(save_dir, tag)

        io.write_latest = write_latest


def _tag(point: str) -> str | None:
    return "last" if point == "resave" else None  # None: global_step<N>


def save_then_stop(point: str, out: Path) -> None:
    engine, model = _engine(seed=0)
    rank, folder = engine.dp.rank, out / "ckpt"
    _train(engine, range(STEPS_A))
    engine.save_checkpoint(str(folder), tag=_tag(point), client_state={"checkpoint": "A"})
    params = _params(model)
    if rank == 0:
        torch.save(params, out / "a_params.pt")
    _train(engine, range(STEPS_A, STEPS_B))
    _stop_inside_the_save(point, out, rank)
    engine.save_checkpoint(str(folder), tag=_tag(point), client_state={"checkpoint": "B"}, async_save=point == "async")
    if point == "async":  # the save returned: training goes on while the writers run, until the job is killed
        _train(engine, range(STEPS_B, STEPS_B + 1))
        time.sleep(PAUSE_SECONDS)
        os._exit(3)
    raise RuntimeError(f"the save of B was not stopped at {point!r}: the test expects this job to be killed in it")


def load_after_kill(out: Path) -> dict[str, Any]:
    """Loads the checkpoint folder the job killed at `out.name` left."""
    point = out.name
    engine, model = _engine(seed=5)  # weights unlike A's: what matches A was loaded
    folder = out / "ckpt"
    try:
        loaded, client_state = engine.load_checkpoint(str(folder))
    except (OSError, ValueError) as error:  # the same on every rank: the job goes on to the other folders
        engine.destroy()
        return {"error": f"{type(error).__name__}: {error}"}
    result: dict[str, Any] = {
        "loaded": Path(loaded).name,
        "client_state": client_state,
        "global_steps": engine.global_steps,
        "equals_a": torch.equal(_params(model), torch.load(out / "a_params.pt", weights_only=True)),
    }
    if point in ("rank_file", "async"):  # B's folder was never published
        try:
            engine.load_checkpoint(str(folder), tag=f"global_step{STEPS_B}")
        except FileNotFoundError as error:
            result["load_b"] = f"FileNotFoundError: {error}"
        else:
            result["load_b"] = "loaded"
    _train(engine, range(STEPS_A, STEPS_A + 1))
    engine.save_checkpoint(str(folder), tag=_tag(point), client_state={"checkpoint": "C"})
    result["after_next_save"] = {"latest": (folder / "latest").read_text(), "entries": sorted(os.listdir(folder))}
    engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pause", choices=("rank_file", "publish", "resave", "async"))
    parser.add_argument("--load", nargs="+", type=Path, default=[])
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    (args.out / f"pid_rank{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    if args.pause:
        save_then_stop(args.pause, args.out)
    for killed in args.load:
        result = load_after_kill(killed)
        (killed / f"loaded_rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
