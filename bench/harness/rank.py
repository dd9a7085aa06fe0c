"""One rank of a group started by harness/launch.py: joins the process group, runs the function, writes its result.

Never run by hand: `launch.on_ranks` builds the command line. The result goes to `<out>.rank<RANK>.json`, a
failure's traceback to `<out>.rank<RANK>.error`. After
writing it the rank leaves without interpreter teardown: tearing down a DDP module there can deadlock inside torch
(seen once in ~30 runs: the main thread, holding the GIL, frees DDP's reducer and joins gloo's threads while one
of them waits for the GIL to release a finished collective's tensor), which would hang the run after its readings.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType


BENCH_DIR = Path(__file__).resolve().parents[1]


def _load(module: str, file: str) -> ModuleType:
    """The function's module: by name, or (a question run as a script) by its file under its file name."""
    if module:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as missing:  # its package is not on this rank's path (a test's): by its file
            if missing.name is None or not module.startswith(missing.name):
                raise
    stem = module or Path(file).stem
    spec = importlib.util.spec_from_file_location(stem, file)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[stem] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for option in ("--module", "--file", "--function", "--kwargs", "--out", "--backend"):
        parser.add_argument(option, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    # bench/ (not bench/harness/, this script's folder) on the path: `harness` is imported as a package; the
    # repository root last, so a function defined in a test module (which imports `tests.helpers`) loads without
    # PYTHONPATH, as CI runs the suite, while a PYTHONPATH given (another commit's code: trainer_bench --code) wins.
    kept = [p for p in sys.path if Path(p or ".").resolve() not in (Path(__file__).parent, BENCH_DIR.parent)]
    sys.path[:] = [str(BENCH_DIR), *kept, str(BENCH_DIR.parent)]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if args.backend != "none":
        dist.init_process_group(args.backend)
    rank = int(os.environ["RANK"])
    try:
        function = getattr(_load(args.module, args.file), args.function)
        result = function(**json.loads(args.kwargs))
    except BaseException:
        # The launcher shows this file: torchrun's own summary ends its log and hides the cause.
        Path(f"{args.out}.rank{rank}.error").write_text(traceback.format_exc())
        raise
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
