"""`accelerate launch ARGS` as accelerate 1.15's DeepSpeed launcher runs it on one machine, minus its first line.

Usage (what tests/integration/test_migration.py runs):
    python tests/integration/scripts/accelerate_deepspeed_launch.py --config_file zero3.yaml SCRIPT [SCRIPT_ARGS]

accelerate's `deepspeed_launcher` starts with `if not is_deepspeed_available(): raise ImportError`; the rest (the
fields `launch_command` records, the environment `prepare_deepspeed_cmd_env` exports, then `torch.distributed.run`) is replayed here with accelerate's
own functions, so the ranks see exactly what `accelerate launch` gives them where deepspeed is installed.
"""

from __future__ import annotations

import sys

import torch.distributed.run as distrib_run
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import patch_environment
from accelerate.utils.launch import _filter_args, prepare_deepspeed_cmd_env


def main() -> None:
    args = launch_command_parser().parse_args(sys.argv[1:])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if not args.use_deepspeed or args.cpu:
        raise SystemExit("the accelerate config does not select DeepSpeed (distributed_type: DEEPSPEED)")
    fields = list(defaults.deepspeed_config.keys()) if defaults else []  # as accelerate's launch_command
    args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mixed_precision_from_config)
    _, env = prepare_deepspeed_cmd_env(args)
    script = ["--training_script", args.training_script, "--training_script_args", args.training_script_args]
    run_args = _filter_args(args, distrib_run.get_args_parser(), script)
    with patch_environment(**env):
        distrib_run.run(run_args)


if __name__ == "__main__":
    main()
