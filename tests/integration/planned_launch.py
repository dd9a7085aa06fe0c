"""`accelerate-zero launch` runs without starting processes: the launcher plans the launch (`prepare_launch`, every
check it makes before it starts anything, and the environment it gives each rank), and the suite's pooled ranks
(tests/helpers/dist.py) run the script with that environment and command line, as the ranks it would start do.

A real launch costs a process per rank importing torch (and transformers, TRL, ... for a recipe): several seconds
of CPU each; the launcher's process handling itself is tested by the real launches tests/integration/test_launch.py
keeps, and the README's demo is launched for real (tests/integration/test_readme_commands.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

from tests.helpers.dist import plain_torchrun_environment, run_distributed


def plan(launch_flags: list[str], script: Path) -> tuple[dict[str, str], int]:
    """The variables `accelerate-zero launch <launch_flags> <script>` gives its ranks, and how many it starts."""
    from accelerate.commands.launch import launch_command_parser

    from accelerate_zero.integrations.accelerate import launcher

    prepared = launcher.prepare_launch(launch_command_parser().parse_args([*launch_flags, str(script)]))
    return prepared.env, prepared.num_processes


def planned_environment(launch_flags: list[str], script: Path) -> dict[str, str]:
    """The variables `accelerate-zero launch <launch_flags> <script>` gives its ranks (it must plan 2 processes)."""
    env, processes = plan(launch_flags, script)
    assert processes == 2, (launch_flags, processes)
    return env


def run_as_planned(script: Path, runs: list[tuple[dict[str, str], list[str]]], processes: int = 2) -> list[list[str]]:
    """Runs `script`'s `main()` on `processes` pooled ranks once per (environment, script arguments) in `runs`;
    returns what each rank printed (stdout and stderr) in each run, by rank. A `main()` that returns a non-zero
    exit status (as `sys.exit(main())` would exit with) fails the run."""
    return run_distributed(_run_script, processes, str(script), runs)


def _run_script(rank: int, world_size: int, script: str, runs: list[tuple[dict[str, str], list[str]]]) -> list[str]:
    from accelerate.state import AcceleratorState, GradientState

    plain_torchrun_environment()
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # As `python script.py`: the script's folder first on the path; the module registered while it runs
    # (dataclass argument parsers resolve their annotations through sys.modules).
    sys.path.insert(0, str(Path(script).parent))
    sys.modules[module.__name__] = module
    environ, argv, printed = dict(os.environ), list(sys.argv), []
    try:
        spec.loader.exec_module(module)
        for env, arguments in runs:
            os.environ.update(env)
            sys.argv = [script, *arguments]
            output = io.StringIO()
            try:
                with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                    status = module.main()
                assert status in (None, 0), f"{script} {arguments} returned exit status {status}:\n{output.getvalue()}"
            finally:
                printed.append(output.getvalue())
                os.environ.clear()
                os.environ.update(environ)
                sys.argv = argv
                AcceleratorState._reset_state()  # the next run's accelerator reads its own variables
                GradientState._reset_state()
    finally:
        sys.path.remove(str(Path(script).parent))
        del sys.modules[module.__name__]
    return printed
