"""Our checkpoint as a DeepSpeed ZeRO folder, for DeepSpeed's `zero_to_fp32.py` ([Note: DeepSpeed out]).

[Note: DeepSpeed out]
DeepSpeed's full checkpoint (each rank's partition in its flat-group layout, its optimizer classes' state dicts, the
engine's client state) is tied to its optimizer and its world size. What a user leaving a ZeRO run runs is
`zero_to_fp32.py` (`get_fp32_state_dict_from_zero_checkpoint`, `convert_zero_checkpoint_to_fp32_state_dict`,
`load_state_dict_from_zero_checkpoint`), and that needs only the fp32 weights laid out as ZeRO-2 writes them. So the
folder written here is one ZeRO-2 partition (partition_count 1):
- `latest` naming the tag `global_step<N>` (N: the checkpoint's optimizer steps);
- `<tag>/mp_rank_00_model_states.pt`: the buffers (`module`, `buffer_names`), every parameter's name and shape in
  one group (`param_shapes`), no frozen or shared entries (a frozen parameter is written like a trained one, so
  zero_to_fp32's `exclude_frozen_parameters` keeps it; a tied alias is not a separate entry, as in save_pretrained);
- `<tag>/zero_pp_rank_0_mp_rank_00_optim_states.pt`: the parameters' values (fp32 masters where trained) in one
  flat fp32 vector, padded to an even length (ZeRO-2 aligns groups to 2 x partitions).
No optimizer state is written: DeepSpeed's engine cannot resume from this folder, only read its weights.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch

from accelerate_zero.checkpoint.consolidate import consolidated_state_dict, engine_folder
from accelerate_zero.checkpoint.meta import read_meta


MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
ALIGNMENT = 2
"""ZeRO-2 pads each group to 2 x partitions elements; zero_to_fp32 checks the length against that."""


def write_deepspeed_folder(checkpoint: str | Path, output_dir: str | Path) -> Path:
    """Writes `output_dir` as a DeepSpeed ZeRO-2 checkpoint folder holding `checkpoint`'s weights.

    Returns:
        The tag folder written (`output_dir/global_step<N>`).

    Raises:
        FileNotFoundError: `checkpoint` is not an accelerate_zero checkpoint.
        ValueError: a rank file is missing or damaged (named).
    """
    from accelerate_zero import __version__

    meta = read_meta(engine_folder(checkpoint))
    state = consolidated_state_dict(checkpoint, torch.float32)
    names = [name for name in meta["param_shapes"] if name in state]
    parameters = set(names)
    buffers = {name: tensor for name, tensor in state.items() if name not in parameters}
    shapes = OrderedDict((name, state[name].shape) for name in names)
    flat = torch.cat([state[name].reshape(-1).float() for name in names]) if names else torch.zeros(0)
    padded = ALIGNMENT * math.ceil(flat.numel() / ALIGNMENT)
    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    version = f"accelerate_zero {__version__}"
    steps = int(meta.get("global_steps") or 0)
    tag = Path(output_dir) / f"global_step{steps}"
    tag.mkdir(parents=True, exist_ok=True)
    model_states = {
        "module": buffers,
        "buffer_names": list(buffers),
        "param_shapes": [shapes],
        "shared_params": {},
        "global_steps": steps,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_version": version,
    }
    optim_states = {
        "optimizer_state_dict": {"zero_stage": 2, "partition_count": 1, "single_partition_of_fp32_groups": [flat]},
        "ds_version": version,
    }
    torch.save(model_states, tag / MODEL_STATES)
    torch.save(optim_states, tag / OPTIM_STATES)
    (Path(output_dir) / "latest").write_text(tag.name)
    return tag
