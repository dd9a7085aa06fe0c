"""`accelerate_zero.deepspeed`'s surface against DeepSpeed 0.19.8's own source, and its launcher against DeepSpeed's.

Ratchets: every public name of `deepspeed`, `deepspeed.zero`, `deepspeed.comm` and every public method of
`DeepSpeedEngine` (read from the installed DeepSpeed's source, without importing it) is implemented here or refused
by name (`DeepSpeedUnavailable`, whose message names it), never a bare AttributeError. The launcher's resource
selection is compared with DeepSpeed's runner functions themselves; the command lines and environments it gives
each process, the CLI's refusals and its config check (exit 2, nothing started) are pinned.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_zero.deepspeed as ours
from accelerate_zero.cli.main import main
from accelerate_zero.deepspeed import launcher
from accelerate_zero.deepspeed.engine import DeepSpeedEngine
from accelerate_zero.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from accelerate_zero.deepspeed.unavailable import engine_refusal


_SPEC = importlib.util.find_spec("deepspeed")
DEEPSPEED = Path(_SPEC.origin).parent if _SPEC is not None else None
needs_deepspeed = pytest.mark.skipif(DEEPSPEED is None, reason="DeepSpeed's source is the reference")


def _public_names(path: Path, class_name: str | None = None) -> list[str]:
    """Public module-level names DeepSpeed defines or re-exports from itself (or one class's public methods)."""
    tree = ast.parse(path.read_text())
    body = tree.body
    if class_name is not None:
        (cls,) = [n for n in body if isinstance(n, ast.ClassDef) and n.name == class_name]
        return sorted({n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")})
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("deepspeed")):
            names |= {alias.asname or alias.name for alias in node.names if alias.name != "*"}
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                names |= {e.id for e in elements if isinstance(e, ast.Name)}
    return sorted(name for name in names if not name.startswith("_"))


def _unanswered(module: Any, names: list[str]) -> list[str]:
    """Names neither implemented nor refused with a message naming them."""
    missing = []
    for name in names:
        try:
            getattr(module, name)
        except ours.DeepSpeedUnavailable as error:
            if name not in str(error):
                missing.append(f"{name} (message does not name it)")
        except AttributeError:
            missing.append(name)
    return missing


@needs_deepspeed
@pytest.mark.parametrize(
    "module, sources",
    [
        (ours, ["__init__.py"]),
        (ours.zero, ["runtime/zero/__init__.py"]),
        (ours.comm, ["comm/comm.py", "comm/utils.py"]),
    ],
    ids=["deepspeed", "deepspeed.zero", "deepspeed.comm"],
)
def test_every_public_deepspeed_name_is_implemented_or_refused_by_name(module: Any, sources: list[str]) -> None:
    names = sorted({name for source in sources for name in _public_names(DEEPSPEED / source)})
    assert len(names) > 8
    assert _unanswered(module, names) == []


@needs_deepspeed
def test_every_deepspeed_engine_method_is_implemented_or_refused_by_name() -> None:
    methods = _public_names(DEEPSPEED / "runtime" / "engine.py", "DeepSpeedEngine")
    assert len(methods) > 150
    missing = [m for m in methods if not hasattr(DeepSpeedEngine, m) and engine_refusal(m) is None]
    assert missing == []


def test_refusals_name_the_call_and_keep_hasattr_false() -> None:
    with pytest.raises(ours.DeepSpeedUnavailable, match="PipelineModule.*pipeline parallelism"):
        ours.PipelineModule  # noqa: B018
    with pytest.raises(NotImplementedError, match="init_inference"):
        ours.init_inference(None)
    assert not hasattr(ours, "PipelineModule")  # an AttributeError too: probes answer False
    with pytest.raises(AttributeError) as plain:
        ours.not_a_deepspeed_name  # noqa: B018
    assert not isinstance(plain.value, ours.DeepSpeedUnavailable)
    with pytest.raises(ImportError, match="PipelineModule"):
        import accelerate_zero.deepspeed.pipe  # noqa: F401
    with pytest.raises(ours.DeepSpeedUnavailable, match="ZeroParamStatus"):
        ours.zero.ZeroParamStatus  # noqa: B018
    with pytest.raises(ours.DeepSpeedUnavailable, match="log_summary"):
        ours.comm.log_summary()
    with pytest.raises(ours.DeepSpeedUnavailable, match="memory_stats"):
        ours.get_accelerator().memory_stats()
    assert ours.get_accelerator().device_name() in ("cpu", "cuda") and ours.dist is ours.comm


def test_add_config_arguments_and_the_adam_classes() -> None:
    import argparse

    parser = ours.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (
        True,
        "ds.json",
        False,
        None,
    )
    params = [torch.nn.Parameter(torch.ones(3))]
    fused = FusedAdam(params, lr=0.1, weight_decay=0.01, betas=(0.8, 0.9))
    assert type(fused) is torch.optim.AdamW and fused.defaults["betas"] == (0.8, 0.9)
    assert type(FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdam(params)) is torch.optim.AdamW
    with pytest.raises(ours.DeepSpeedUnavailable, match="bias_correction"):
        FusedAdam(params, bias_correction=False)
    with pytest.raises(ours.DeepSpeedUnavailable, match="AMSGrad"):
        FusedAdam(params, amsgrad=True)


SELECTIONS = [  # (pool, include, exclude, num_nodes, num_gpus)
    ({"localhost": 4}, "", "", -1, 2),
    ({"localhost": 4}, "localhost:0,2", "", -1, -1),
    ({"localhost": 4}, "", "localhost:1", -1, -1),
    ({"a": 2, "b": 4, "c": 1}, "", "", 2, -1),
    ({"a": 2, "b": 4, "c": 1}, "b@a:1", "", -1, -1),
    ({"a": 2, "b": 4, "c": 1}, "", "b@c", -1, -1),
    ({"a": 2, "b": 4, "c": 1}, "", "", 2, 3),
]


@needs_deepspeed
def test_resource_selection_matches_deepspeeds_runner() -> None:
    from deepspeed.launcher import runner

    for pool, include, exclude, nodes, gpus in SELECTIONS:
        theirs = runner.apply_num_nodes_and_gpus(runner.parse_inclusion_exclusion(pool, include, exclude), nodes, gpus)
        mine = launcher.select_resources(pool, include, exclude, nodes, gpus)
        assert list(mine.items()) == [(host, list(slots)) for host, slots in theirs.items()], (pool, include, exclude)
    for bad in [("localhost:7", ""), ("nohost", "")]:
        with pytest.raises(launcher.LaunchProblem):
            launcher.select_resources({"localhost": 2}, *bad)
    with pytest.raises(launcher.LaunchProblem, match="num_nodes/gpus"):
        launcher.select_resources({"localhost": 2}, "localhost:0", "", -1, 2)


def test_hostfile_and_the_processes_of_a_node(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nworker-0 slots=2\n\nworker-1 slots=3\n")
    assert launcher.read_hostfile(hostfile) == {"worker-0": 2, "worker-1": 3}
    assert launcher.read_hostfile(tmp_path / "absent") is None
    for text, problem in [("worker-0 slots=2\nworker-0 slots=1\n", "multiple entries"), ("worker-0 2\n", "bad entry")]:
        hostfile.write_text(text)
        with pytest.raises(launcher.LaunchProblem, match=problem):
            launcher.read_hostfile(hostfile)
    resources = {"worker-0": [0, 1], "worker-1": [0, 1, 2]}
    procs = launcher.rank_processes(
        resources, 1, "train.py", ["--deepspeed", "--x=1"], master_addr="n0", master_port=1234, base_env={"A": "b"}
    )
    assert [p.command[2:] for p in procs] == [
        ["train.py", f"--local_rank={i}", "--deepspeed", "--x=1"] for i in range(3)
    ]
    assert [(p.env["RANK"], p.env["LOCAL_RANK"]) for p in procs] == [("2", "0"), ("3", "1"), ("4", "2")]
    env = procs[0].env
    assert (env["WORLD_SIZE"], env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"], env["A"]) == (
        "5",
        "3",
        "1",
        "2",
        "b",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("n0", "1234")
    bare = launcher.rank_processes(
        resources, 0, "t.py", [], master_addr="x", master_port=1, no_local_rank=True, no_python=True
    )
    assert bare[0].command == ["t.py"]
    with pytest.raises(ours.DeepSpeedUnavailable, match="no_ssh"):
        launcher.refuse_remote_launch(resources, no_ssh=False, force_multi=False, launcher="pdsh")


def test_cli_refuses_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}))
    never = tmp_path / "never.py"  # would fail loudly if it were started
    assert main(["deepspeed", "--num_gpus", "2", str(never), "--deepspeed", "--deepspeed_config", str(bad)]) == 2
    assert "train_batch_size" in capsys.readouterr().err
    assert main(["deepspeed", "--autotuning", "tune", str(never)]) == 2
    assert "autotuning" in capsys.readouterr().err
    assert main(["deepspeed", "--num_nodes", "2", "--hostfile", str(tmp_path / "none"), str(never)]) == 2
    assert "Num nodes is >1" in capsys.readouterr().err
