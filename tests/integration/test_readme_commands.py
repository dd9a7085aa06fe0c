"""Every command README.md and recipes/README.md show runs, in a short form, so a stale claim fails here.

The commands are read from the documents themselves: each line of a ```bash block (and each `accelerate-zero ...`
in a table row). Each must match one of the short forms below, else the first test fails and names it:

* `validate`, `estimate`, `doctor` run as written, in this process (`accelerate_zero.cli.main.main`: the entry point
  the console script calls; a process each would pay torch's import for a few lines of output);
* recipe launches run with few steps (`--max_steps 2`, 4 eval prompts, a temporary output folder); the demo
  (`bash scripts/demo.sh`, the same command as the SFT launch) runs once, for real, and the other commands reuse its
  output (GRPO starts from it, `consolidate` merges its checkpoint); an SFT launch that spells out the demo's own
  values (`--model_name_or_path ... --output_dir out/my-sft`) is checked to parse to the demo's arguments but for
  the output folder, and its launch planned, not run again; the QLoRA recipe's launch is the one run of it in the
  suite (it checks the adapter saved), launched for real; the other recipe launches (GRPO, sequence parallelism,
  two simulated nodes, `accelerate_hello.py`) are planned by the launcher and run on the pooled ranks
  (tests/integration/planned_launch.py: the launcher's process handling is tested by the real launches);
* the GPU smoke test (`tests/gpu/smoke.py`) runs on 2 CPU ranks, its launch planned the same way;
* launches of a placeholder script (`train.py`), and launches on several machines (`--num_machines 2`: the other
  machine is not here), are checked as `accelerate-zero launch` checks them before starting anything (flags,
  config, batch rule), without starting processes;
* `NAME=value` words before a command are set in its environment (`ACCELERATE_ZERO_SIMULATED_NODES=2 ...`);
* the commands that need nothing the others make (`scripts/test.sh`, collecting with pytest, `build_assets.py`) and
  the demo with a mistyped flag start together before the demo runs, and their tests read their output;
* `pip install` lines are not run (they install packages; this environment was installed by scripts/install.sh).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.dist import scaled_seconds
from tests.helpers.processes import Started, started_together


REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "recipes/README.md")
DEMO = "accelerate-zero launch --config_file accelerate_configs/zero3_demo.yaml recipes/sft.py --config recipes/configs/sft_demo.yaml"
SHORT_SFT = ["--max_steps", "2", "--eval_samples", "4", "--logging_steps", "1"]
SHORT_GRPO = ["--max_steps", "1", "--prompts_per_rank", "2", "--num_generations", "2", "--eval_samples", "4"]
SHORT_GRPO += ["--probe_prompts", "2"]
RECIPE_FLAGS = {
    "sft.py": SHORT_SFT,
    "qlora.py": SHORT_SFT,
    "grpo.py": SHORT_GRPO,
    "accelerate_hello.py": ["--steps", "4"],
}
SELF_CONTAINED = ("test_sh", "pytest_collect", "build_assets")
"""Short forms that need nothing the other tests make: they run as processes started together with the demo."""
NOISE = ("Failed to load CPU gemm_4bit_forward", "FutureWarning", "Traceback")
TIMEOUT = 240


def _commands_of(text: str) -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            # `.venv/bin/accelerate-zero` runs the same entry point as `accelerate-zero` in an activated venv
            command = line.split("  #")[0].split(" # ")[0].strip().removeprefix(".venv/bin/")
            if command:
                commands.append(command)
    for row in (line for line in text.splitlines() if line.startswith("|")):
        commands += [c for c in re.findall(r"`(accelerate-zero [^`]+)`", row)]
    return commands


@functools.cache
def readme_commands() -> list[str]:
    """Every documented command, once, in document order."""
    seen: dict[str, None] = {}
    for name in DOCUMENTS:
        for command in _commands_of((REPO / name).read_text()):
            seen.setdefault(command, None)
    return list(seen)


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The `NAME=value` words before a command, and the command."""
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, value = words[0].split("=", 1)
        env[name], words = value, words[1:]
    return env, words


def kind_of(command: str) -> str:
    """The short form a documented command runs as (see the module docstring); "" when there is none."""
    _, words = split_env(shlex.split(command.replace("[", "").replace("]", "")))
    if words[:2] == ["pip", "install"]:
        return "not_run"
    if command in ("bash scripts/demo.sh", DEMO):
        return "demo"
    if words[:2] == ["bash", "scripts/test.sh"]:
        return "test_sh"
    if words[0].endswith("python") and words[1:3] == ["-m", "pytest"]:
        return "pytest_collect"
    if words[0] == "python" and words[1] == "recipes/assets/build_assets.py":
        return "build_assets"
    if words[:2] == ["accelerate-zero", "launch"]:
        script = next((w for w in words[2:] if w.endswith(".py")), "")
        if script == "tests/gpu/smoke.py":
            return "gpu_smoke"
        machines = words[words.index("--num_machines") + 1] if "--num_machines" in words else "1"
        return "recipe" if (REPO / script).is_file() and machines == "1" else "launch_checks"
    if words[:2] == ["accelerate-zero", "consolidate"]:
        return "consolidate"
    if words[:2] == ["accelerate-zero", "deepspeed"]:
        return "deepspeed_checks"
    if words[0] == "accelerate-zero" and words[1] in ("validate", "estimate", "doctor"):
        return "as_written"
    return ""


def test_every_documented_command_has_a_short_form() -> None:
    commands = readme_commands()
    assert DEMO in commands and "bash scripts/demo.sh" in commands
    assert DEMO in (REPO / "scripts" / "demo.sh").read_text(), "scripts/demo.sh must run the documented command"
    missing = [command for command in commands if not kind_of(command)]
    assert not missing, f"README commands without a short form in this test (add one): {missing}"


# ---- running ---------------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_ZERO_", "ACCELERATE_USE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["ACCELERATE_ZERO_PG_TIMEOUT"] = scaled_seconds(60)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Runs `argv` in the repository; returns stdout + stderr; fails the test on a non-zero exit."""
    argv = [*[sys.executable, "-m", "accelerate_zero.cli.main"], *argv[1:]] if argv[0] == "accelerate-zero" else argv
    done = subprocess.run(
        argv, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    return _output_of(done)


def _output_of(done: subprocess.CompletedProcess) -> str:
    """stdout + stderr of a finished process; fails the test on a non-zero exit."""
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{shlex.join(done.args)} exited {done.returncode}:\n{output[-4000:]}"
    return output


def run_in_process(argv: list[str]) -> str:
    """`accelerate-zero ...` run by its entry point in this process; returns what it printed, fails on non-zero."""
    import contextlib
    import io

    from accelerate_zero.cli.main import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = main(argv[1:])
    assert code == 0, f"{shlex.join(argv)} exited {code}:\n{printed.getvalue()[-4000:]}"
    return printed.getvalue()


def _launch_port(words: list[str]) -> list[str]:
    """Port 0 (a free one) unless the command names one: other launches may be running on this machine."""
    return words if "--main_process_port" in words else [*words[:2], "--main_process_port", "0", *words[2:]]


def _venv_runs_demo_sh() -> bool:
    """scripts/demo.sh installs into VENV when its import check fails: only run it where nothing would install."""
    needed = ("accelerate_zero", "pytest", "bitsandbytes", "trl")
    return (Path(sys.prefix) / "bin" / "accelerate-zero").is_file() and all(
        importlib.util.find_spec(name) is not None for name in needed
    )


def _self_contained_process(command: str, folder: Path) -> tuple[list[str], dict[str, str]] | None:
    """The process (command line, environment) of a SELF_CONTAINED command's short form; None when not run here."""
    _, words = split_env(shlex.split(command.replace("[", "").replace("]", "")))
    match kind_of(command):
        case "test_sh":
            if not _venv_runs_demo_sh():
                return None
            # test.sh always passes `tests`: collecting the unit tests checks the command without running the suite
            short = ["--collect-only", "-q", "--ignore=tests/integration", "--ignore=tests/distributed"]
            return ["bash", "scripts/test.sh", *short], {**_env(), "VENV": sys.prefix}
        case "pytest_collect":
            return [sys.executable, *words[1:], "--collect-only", "-q"], _env()
        case "build_assets":
            flags = ["--out", str(folder / "assets"), "--n_train", "50", "--n_eval", "10"]
            return [sys.executable, words[1], *[w for w in _drop(words[2:], "--out", "--n_train")], *flags], _env()
    raise AssertionError(f"{command!r} is not one of {SELF_CONTAINED}")


MISTYPED = "the demo with a mistyped flag"


@pytest.fixture(scope="module")
def early(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Started, Path]]]:
    """The SELF_CONTAINED commands and the mistyped-flag launch, started together before the demo runs
    (tests/helpers/processes.py): each spends most of its time importing on one core; by command, with its folder."""
    commands, own, folders = {}, {}, {}
    for command in [c for c in readme_commands() if kind_of(c) in SELF_CONTAINED]:
        folders[command] = tmp_path_factory.mktemp("self_contained")
        process = _self_contained_process(command, folders[command])
        if process is not None:
            commands[command], own[command] = process[0], {"env": process[1]}
    launch = _launch_port(shlex.split(DEMO))[1:]
    commands[MISTYPED] = [sys.executable, "-m", "accelerate_zero.cli.main", *launch, "--maxsteps", "5"]
    folders[MISTYPED] = REPO
    with started_together(commands, own, cwd=REPO, env=_env()) as started:
        yield {command: (started[command], folders[command]) for command in started}


def _finished(started: Started) -> str:
    """stdout + stderr of a process started early; fails the test on a non-zero exit, as `run` does."""
    return _output_of(started.finished(timeout=TIMEOUT))


@pytest.fixture(scope="module")
def demo(early: dict[str, tuple[Started, Path]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo once, short: `bash scripts/demo.sh` (the documented SFT command) saving a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("demo") / "sft"
    flags = [*SHORT_SFT, "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "2"]
    if _venv_runs_demo_sh():
        env = {**_env(), "VENV": sys.prefix}
        output = run(["bash", "scripts/demo.sh", *flags], env)
    else:  # demo.sh would install packages here: run the command it runs
        output = run(_launch_port(shlex.split(DEMO)) + flags)
    return {"out": out, "output": output}


def test_demo_shards_and_prints_what_each_rank_holds(demo: dict[str, Any]) -> None:
    output = demo["output"]
    assert "parameters held by each rank at ZeRO stage 3 (the model has 825,600):" in output
    assert output.count("412,800  (50.0%; 1/W = 50.0%)") == 2, output[-3000:]
    assert "mem_zero_rank0_MiB" in output and "_MB'" not in output
    assert "held-out exact match (4 prompts, greedy):" in output
    assert not [noise for noise in NOISE if noise in output], output[-3000:]
    assert (demo["out"] / "model.safetensors").is_file() and (demo["out"] / "checkpoint-2").is_dir()


@pytest.mark.parametrize("command", [c for c in readme_commands() if kind_of(c) not in ("demo", "not_run")])
def test_documented_command(
    command: str, demo: dict[str, Any], early: dict[str, tuple[Started, Path]], tmp_path: Path
) -> None:
    env, words = split_env(shlex.split(command.replace("[", "").replace("]", "")))
    match kind_of(command):
        case "as_written":
            run_in_process([w if w != "ds_config.json" else "accelerate_configs/ds_config.json" for w in words])
        case "recipe" if _is_the_demo_spelled_out(words):
            _check_same_as_demo(words, tmp_path)
        case "recipe":
            _run_recipe(words, demo, tmp_path, env)
        case "launch_checks":
            _check_launch(words, tmp_path)
        case "deepspeed_checks":
            _check_deepspeed_launch(words, tmp_path)
        case "gpu_smoke":  # on this machine's CPU, with 2 processes whatever N the document shows
            count = words.index("--num_processes") + 1
            launch = _launch_port([*words[:count], "2", *words[count + 1 :]])
            output = _run_planned(launch, ["--workdir", str(tmp_path)], env)
            assert "GPU smoke test: 2 ranks" in output and " FAIL " not in output, output[-3000:]
        case "consolidate":
            run(["accelerate-zero", "consolidate", str(demo["out"] / "checkpoint-2"), str(tmp_path / "merged")])
            assert (tmp_path / "merged" / "config.json").is_file()
        case "test_sh" | "pytest_collect" | "build_assets":
            if command not in early:
                pytest.skip("scripts/test.sh would install packages into this environment")
            started, folder = early[command]
            output = _finished(started)
            if kind_of(command) == "test_sh":
                assert "tests/unit/test_shard_plan.py" in output
            if kind_of(command) == "build_assets":
                assert (folder / "assets" / "tiny-llama" / "config.json").is_file(), output


def _drop(words: list[str], *flags: str) -> list[str]:
    """`words` without the named flags and their values (the short form sets them)."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            kept.append(word)
    return kept


def _run_recipe(words: list[str], demo: dict[str, Any], tmp_path: Path, env: dict[str, str]) -> None:
    script = Path(next(w for w in words if w.endswith(".py"))).name
    if script == "qlora.py" and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("the qlora recipe needs the qlora extra (bitsandbytes)")
    flags = [*RECIPE_FLAGS[script]]
    if script != "accelerate_hello.py":
        flags += ["--output_dir", str(tmp_path / "out")]
    if script == "grpo.py":  # it starts from the SFT demo's output, as documented
        flags += ["--model_name_or_path", str(demo["out"])]
    if script == "qlora.py":
        output = run(_launch_port(words) + flags, {**_env(), **env})
    else:
        output = _run_planned(_launch_port(words), flags, env)
    assert not [noise for noise in NOISE if noise in output], output[-3000:]
    if script == "qlora.py":
        assert "held-out exact match" in output, output[-3000:]
        assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    if script == "accelerate_hello.py":
        assert "ZeRO stage 2 on 2 processes (DistributedType.MULTI_CPU)" in output, output[-3000:]
        assert "step   4  loss" in output and "done" in output, output[-3000:]


def _run_planned(words: list[str], script_flags: list[str], env: dict[str, str]) -> str:
    """`words` (an `accelerate-zero launch` of a script) planned by the launcher and run on the pooled ranks with
    `script_flags` after the command's own script arguments and `env` set; returns what every rank printed."""
    from tests.integration.planned_launch import plan, run_as_planned

    position = words.index(next(w for w in words if w.endswith(".py")))
    saved, folder = dict(os.environ), os.getcwd()
    os.environ.update(env)  # NAME=value words the launcher reads (simulated nodes)
    os.chdir(REPO)  # the documented paths are the repository's
    try:
        planned, processes = plan(words[2:position], REPO / words[position])
        arguments = [*words[position + 1 :], *script_flags]
        printed = run_as_planned(REPO / words[position], [({**env, **planned}, arguments)], processes)
    finally:
        os.chdir(folder)
        os.environ.clear()
        os.environ.update(saved)
    return "\n".join(run for rank in printed for run in rank)


def _recipe_arguments(words: list[str]) -> tuple[Any, ...]:
    """What recipes/sft.py makes of a documented launch's script flags (its own parser, in this process)."""
    import importlib

    script = words.index(next(w for w in words if w.endswith("sft.py")))
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        sft = importlib.import_module("sft")
        return sft.parse_config((sft.SFTScriptArguments, sft.TrainingArguments), words[script + 1 :])
    finally:
        sys.path.remove(str(REPO / "recipes"))


def _is_the_demo_spelled_out(words: list[str]) -> bool:
    demo = shlex.split(DEMO)
    return words[: len(demo)] == demo and len(words) > len(demo) and "--output_dir" in words


def _check_same_as_demo(words: list[str], tmp_path: Path) -> None:
    """The demo with its defaults written out: the same recipe arguments but for the output folder (the demo ran
    them), and a launch the launcher plans as the demo's."""
    from dataclasses import asdict

    def comparable(arguments: tuple[Any, ...]) -> list[dict[str, Any]]:
        out = [asdict(a) if not hasattr(a, "to_dict") else a.to_dict() for a in arguments]
        for values in out:
            for name in ("output_dir", "logging_dir"):
                values.pop(name, None)
            for name, value in values.items():  # the YAML's paths are resolved; the command's relative to the repo
                if isinstance(value, str) and value and (REPO / value).exists():
                    values[name] = str((REPO / value).resolve())
        return out

    assert comparable(_recipe_arguments(words)) == comparable(_recipe_arguments(shlex.split(DEMO)))
    _check_launch(words[: words.index(next(w for w in words if w.endswith(".py"))) + 1], tmp_path)


def _check_launch(words: list[str], tmp_path: Path) -> None:
    """What `accelerate-zero launch` checks before it starts anything, for a launch of a placeholder script."""
    from accelerate.commands.launch import launch_command_parser

    from accelerate_zero.integrations.accelerate import launcher

    multi_gpu = tmp_path / "multi_gpu.yaml"
    cluster = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2}
    multi_gpu.write_text(yaml.safe_dump(cluster))  # as `accelerate config` writes one
    stand_ins = {"multi_gpu.yaml": str(multi_gpu), "ds_config.json": "accelerate_configs/ds_config.json"}
    args = launch_command_parser().parse_args([stand_ins.get(w, w) for w in words[2:]])
    prepared = launcher.prepare_launch(args)
    assert prepared.num_processes >= 1 and prepared.env["ACCELERATE_ZERO_CONFIG"]


def _check_deepspeed_launch(words: list[str], tmp_path: Path) -> None:
    """What `accelerate-zero deepspeed` checks and plans before it starts anything (the script a placeholder, the
    config a DeepSpeed script's: concrete values, as DeepSpeed itself fills no "auto"): one process per --num_gpus,
    each given DeepSpeed's --local_rank."""
    import argparse
    import json

    from accelerate_zero.cli import deepspeed as command
    from accelerate_zero.deepspeed import launcher

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}))
    args = parser.parse_args([w if w != "ds.json" else str(config) for w in words[1:]])
    processes = command._plan(args, launcher)
    assert len(processes) == args.num_gpus, processes
    assert [p.command[3] for p in processes] == [f"--local_rank={i}" for i in range(args.num_gpus)]


def test_mistyped_recipe_flag_is_one_usage_and_one_line(early: dict[str, tuple[Started, Path]]) -> None:
    done = early[MISTYPED][0].finished(timeout=TIMEOUT)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert output.count("error: unrecognized arguments: --maxsteps 5") == 1  # rank 0 only
    assert output.count("usage:") == 1
    # whichever rank's exit the launcher sees first
    assert re.search(r"the script exited with code 2 \(command-line error\) on rank \d", output), output
    assert "Root Cause" not in output and len(output.splitlines()) < 15, output
