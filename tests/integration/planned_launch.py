"""`accelerate-zero launch` runs without starting processes: the launcher plans the launch (`prepare_launch`, every
check it makes before it starts anything, and the environment it gives each rank), and the suite's pooled ranks
(tests/helpers/dist.py) run the script with that environment and command line, as the ranks it would start do.

A real launch costs 3 processes importing torch (the launcher and 2 ranks), several seconds of CPU each; the
launcher's process handling itself is tested by the real launches tests/integration/test_launch.py keeps.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from tests.helpers.dist import plain_torchrun_environment, run_distributed


def planned_environment(launch_flags: list[str], script: Path) -> dict[str, str]:
    """The variables `accelerate-zero launch <launch_flags> <script>` gives its ranks (it plans 2 processes)."""
    from accelerate.commands.launch import launch_command_parser

    from accelerate_zero.integrations.accelerate import launcher

    prepared = launcher.prepare_launch(launch_command_parser().parse_args([*launch_flags, str(script)]))
    assert prepared.num_processes == 2, (launch_flags, prepared.num_processes)
    return prepared.env


def run_as_planned(script: Path, runs: list[tuple[dict[str, str], list[str]]]) -> None:
    """Runs `script`'s `main()` on 2 pooled ranks once per (environment, script arguments) in `runs`."""
    run_distributed(_run_script, 2, str(script), runs)


def _run_script(rank: int, world_size: int, script: str, runs: list[tuple[dict[str, str], list[str]]]) -> None:
    from accelerate.state import AcceleratorState, GradientState

    plain_torchrun_environment()
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    environ, argv = dict(os.environ), list(sys.argv)
    for env, arguments in runs:
        os.environ.update(env)
        sys.argv = [script, *arguments]
        try:
            module.main()
        finally:
            os.environ.clear()
            os.environ.update(environ)
            sys.argv = argv
            AcceleratorState._reset_state()  # the next run's accelerator reads its own variables
            GradientState._reset_state()
