"""`accelerate-zero estimate`: which ZeRO stage (and offload) fits, from the engine's own memory accounting.

Usage:
    accelerate-zero estimate --params 7e9 --num_gpus 8 --gpu_memory 80GB
    accelerate-zero estimate --config_json path/to/config.json --num_gpus 4 --gpu_memory 80GB --gradient_checkpointing
    accelerate-zero estimate --model ./my-llama --num_gpus 8 --num_nodes 2 --mixed_precision bf16 --json
    accelerate-zero estimate --config_json ./qwen3-moe --num_gpus 8 --expert_parallel 4 --gpu_memory 80GB

Prints, for every stage 0-3 and offload mode DeepSpeed has, the bytes one GPU holds per kind (the kinds of
`ZeroEngine.memory_breakdown()`), a rough activation figure, the CPU RAM and NVMe each node needs, whether it fits
`--gpu_memory`, and a recommendation: the cheapest that fits, stage 2 before stage 3 and offload only when nothing
fits without it. The accounting is `accelerate_zero.debug.estimate` (its module notes say what each stage and
offload mode holds). Parameters are counted without being allocated (a meta-device model or file headers).

JSON output (`--json`), schema_version 1:
    {
      "schema_version": 1,
      "model": {
        "source": "params" | "config" | "safetensors",
        "name": str,                      # model class, folder, or "<N> parameters"
        "num_parameters": int,            # trainable parameters (tied weights once)
        "stage3_units": int,              # gather units with parameters (root unit included)
        "persistent_parameters": int,     # stage 3: parameters kept whole (stage3_param_persistence_threshold)
        "exact_layout": bool,             # false for --params: one tensor, the stage 3 gathered peak approximated
        "architecture": {"hidden_size": int, "num_layers": int, "num_heads": int, "vocab_size": int} | null
      },
      "setup": {
        "num_gpus": int, "num_nodes": int, "world_size": int,
        "mixed_precision": "no" | "fp16" | "bf16", "optimizer": str,
        "micro_batch": int, "seq_len": int, "gradient_checkpointing": bool, "eager_attention": bool,
        "cpu_checkpointing": bool,        # the layers' saved activations in host memory (host_per_rank)
        "sequence_parallel": int, "tile_tokens": int | null,   # activations per rank with Ulysses / tiling
        "gpu_memory": int | null,         # bytes per GPU as given
        "headroom": float,                # fraction of gpu_memory kept free
        "usable_gpu_memory": int | null,  # gpu_memory * (1 - headroom): what "fits" compares with
        "cpu_memory": int | null,         # bytes of CPU RAM per node, when given
        "nvme_space": int | null          # bytes of NVMe per node, when given
      },
      "activations": int | null,          # bytes per GPU; null when the architecture is unknown
                                          # (--params, or a folder with safetensors files only)
      "estimates": [                      # one per applicable (stage, offload), stage-major
        {
          "stage": int, "offload": "none" | "cpu" | "cpu+param" | "nvme",
          "device": {                     # bytes per GPU
            "parameters": int, "gradients": int, "master_weights": int, "optimizer_states": int,
            "communication_buffers": int, "gathered_parameters": int,
            "activations": int,           # 0 when the top-level "activations" is null
            "total": int                  # all of the above: what "fits" compares with usable_gpu_memory
          },
          "model_states": int,            # parameters + gradients + master_weights + optimizer_states
          "host_per_rank": {"parameters": int, "gradients": int, "master_weights": int,
                            "optimizer_states": int, "total": int},  # + "activations" with --cpu_checkpointing
          "nvme_per_rank": {same keys as host_per_rank},
          "cpu_ram_per_node": int,        # host_per_rank.total * num_gpus
          "nvme_per_node": int,           # nvme_per_rank.total * num_gpus
          "fits": bool | null,            # device.total <= usable_gpu_memory (and the node's CPU RAM /
                                          # NVMe within --cpu_memory / --nvme_space when given); null
                                          # without --gpu_memory
          "phases": {"init": int, "forward": int, "backward": int, "optimizer_step": int,
                     "between_steps": int}, # bytes per GPU at the peak of each phase
                                          # ([Note: the peak of each phase] in debug/phases.py)
          "step_seconds": {"no_offload": float, "gradients_to_host": float, "host_step": float,
                           "uploads": float, "parameter_reads": float, "total": float} | null
                                          # with --step_seconds/--copy_gbps/--host_rate (cli/estimate_time.py)
        }
      ],
      "recommendation": {"stage": int, "offload": str, "deepspeed_config": {"zero_optimization": {...}}} | null,
      "expert_parallel": {"size": int, "peers": int, "layers": int, "experts_per_layer": int,
        "experts_per_rank_per_layer": int, "expert_parameters": int, "expert_parameters_per_rank": int,
        "expert_bytes_per_rank": {"1" | "2" | "3": {...}}} | null,  # --expert_parallel: stages 1-3, offload none
      "layouts": {                        # stage 3 on --num_nodes > 1 ([Note: the layout formulas] in
        "per": "node and micro-step",     # debug/layouts.py); null on one node or with --expert_parallel
        "rows": [{"layout": "flat" | "hpZ" | "MiCS" | "ZeRO++", "zero_optimization": {...},
                  "between_nodes_per_micro_step": int, "inside_node_per_micro_step": int,
                  "model_states": int, "secondary_copy": int, "exact": bool}],
        "recommended": str                # the exact layout with the fewest bytes between nodes that fits
      } | null,
      "notes": [str]
    }

Sizes are binary: `80GB`, `80GiB` and `80G` all mean 80 * 2**30 bytes (what a GPU sold as "80GB" has, and what
DeepSpeed's estimator prints); a plain number is bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any

from accelerate_zero.cli import estimate_time
from accelerate_zero.cli.estimate_render import render
from accelerate_zero.debug import estimate as est
from accelerate_zero.debug import estimate_experts as est_experts
from accelerate_zero.debug.activations_host import cpu_checkpointed_bytes
from accelerate_zero.debug.layouts import layout_rows, recommend_layout
from accelerate_zero.debug.phases import phase_peaks


INVALID_INPUT_EXIT_CODE = 2
SCHEMA_VERSION = 1
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_OFFLOAD_CHOICES = ("all", *est.OFFLOAD_MODES)


def parse_size(text: str) -> int:
    """Bytes from "80GB", "80GiB", "81920MiB", "1.5T" or "85899345920" (every multiple is binary)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]?)(i?b?)\s*", text.lower())
    if match is None or (match.group(3) and not match.group(2) and match.group(3) != "b"):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 80GB, 40GiB, 512G, 1.5T)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_count(text: str) -> int:
    """A parameter count: "7e9", "7B", "13b", "350M", "7000000000"."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if match is None or float(match.group(1)) * _COUNT_SUFFIXES[match.group(2)] < 1:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (examples: 7e9, 7B, 350M)")
    return round(float(match.group(1)) * _COUNT_SUFFIXES[match.group(2)])


def register(subcommands: Any) -> None:
    """Adds the `estimate` subcommand to `subcommands` (the object `add_subparsers()` returns)."""
    parser = subcommands.add_parser(
        "estimate",
        help="memory per GPU of every ZeRO stage and offload mode, and the cheapest that fits",
        description="Estimate the bytes one GPU, one node's CPU RAM and its NVMe hold for ZeRO stages 0-3\n"
        "with and without offload, from the engine's own layout (padding, buckets, stage 3 units, persistent\n"
        "parameters); say which fit --gpu_memory and recommend the cheapest: stage 2 before stage 3, offload\n"
        "only when needed. The model is never allocated (meta device, or safetensors headers).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=parse_count, metavar="N", help="parameter count: 7e9, 7B, 350M")
    source.add_argument("--config_json", metavar="PATH", help="a transformers config.json, or a folder with one")
    source.add_argument("--model", metavar="DIR", help="a local model folder (config.json or *.safetensors)")
    _add_run_arguments(parser)
    _add_budget_arguments(parser)
    estimate_time.add_arguments(parser)
    parser.set_defaults(run=run)


_EPILOG = """\
what is counted (per GPU unless said otherwise):
  parameters/gradients/master/optimizer  the model states, laid out as the engine does (see
      accelerate_zero/debug/estimate.py); grads are in the compute dtype, master weights fp32 under bf16/fp16
  buffers     reduce buckets being filled or reduced (stages 2 and 3)
  gathered    stage 3 units gathered for forward/backward (root unit + running unit + prefetch, or up to
              stage3_max_live_parameters when units are kept for reuse)
  activations rough: 34*s*b*h bytes per layer in 16-bit (Korthikanti et al. 2022, no recomputation;
              + 5*a*s^2*b with --eager_attention), doubled in fp32; with --gradient_checkpointing
              2*s*b*h per layer + one layer recomputed; + the logits s*b*V*(c+8). Needs a config (not --params).
              --cpu_checkpointing: all but one layer's (the checkpoints) move to host_per_rank "activations".
offload modes: cpu = optimizer states, fp32 master and grads on CPU (stages 1-3); cpu+param = also the stage 3
  parameter shards on CPU; nvme = optimizer states, master and parameter shards on NVMe (stage 3).
"""


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num_gpus", type=int, default=None, metavar="N", help="GPUs per node (default: this machine's, or 1)"
    )
    parser.add_argument("--num_nodes", type=int, default=1, metavar="N", help="nodes (default: 1)")
    parser.add_argument(
        "--mixed_precision",
        choices=("no", "fp16", "bf16"),
        default=None,
        help="compute dtype; default: the --deepspeed_config's bf16/fp16 block, else bf16",
    )
    parser.add_argument("--optimizer", choices=sorted(est.OPTIMIZERS), default="adamw", help="default: adamw")
    parser.add_argument(
        "--offload", choices=_OFFLOAD_CHOICES, default="all", help="offload mode(s) to estimate (default: all)"
    )
    parser.add_argument(
        "--micro_batch", type=int, default=1, metavar="B", help="sequences per GPU per forward (default: 1)"
    )
    parser.add_argument("--seq_len", type=int, default=2048, metavar="S", help="tokens per sequence (default: 2048)")
    parser.add_argument(
        "--gradient_checkpointing", action="store_true", help="activations with every layer checkpointed"
    )
    parser.add_argument("--cpu_checkpointing", action="store_true", help="saved activations in host memory")
    parser.add_argument(
        "--eager_attention", action="store_true", help="count the attention score matrices (not SDPA/flash)"
    )
    parser.add_argument(
        "--sequence_parallel", type=int, default=1, metavar="P", help="Ulysses: ranks sharing a sequence (default 1)"
    )
    parser.add_argument(
        "--tile_tokens", type=int, default=None, metavar="T", help="tiled MLP and logits + loss of T positions"
    )
    parser.add_argument(
        "--deepspeed_config",
        metavar="PATH",
        help="a DeepSpeed config, or an accelerate config file, for the bucket sizes, stage 3 thresholds, "
        "overlap_comm and data types (its stage and offload are ignored: every one is estimated)",
    )
    parser.add_argument(
        "--expert_parallel", type=int, default=None, metavar="EP", help="MoE: experts split over EP GPUs (AutoEP)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (schema in the module docstring)")


def _add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu_memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="memory per GPU, e.g. 80GB; sizes are binary: 80GB = 80GiB, as GPUs are sold (default: this GPU's)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="fraction of --gpu_memory kept free for the CUDA context, fragmentation and temporaries (default: 0.1)",
    )
    parser.add_argument(
        "--cpu_memory", type=parse_size, default=None, metavar="SIZE", help="CPU RAM per node, e.g. 512GB"
    )
    parser.add_argument(
        "--nvme_space", type=parse_size, default=None, metavar="SIZE", help="NVMe space per node, e.g. 4TB"
    )


def run(args: argparse.Namespace) -> int:
    """Runs `estimate`; returns 0, or 2 with the problem on stderr."""
    from accelerate_zero.config import ZeroConfigError

    try:
        report = build_report(args)
    except (ValueError, ZeroConfigError) as error:
        print(f"accelerate-zero estimate: {error}", file=sys.stderr)
        return INVALID_INPUT_EXIT_CODE
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


# ------------------------------------------------------------------------------------------------- report
def build_report(args: argparse.Namespace) -> dict[str, Any]:
    """The whole estimate as the JSON document described in the module docstring.

    Raises:
        ValueError: invalid flags, an unreadable model or config.
    """
    _check_flags(args)
    num_gpus = args.num_gpus if args.num_gpus is not None else _local_gpus()
    gpu_memory = args.gpu_memory if args.gpu_memory is not None else _local_gpu_memory()
    loaded = _load_model(args)
    setup, zero_notes = _setup_from(args, num_gpus * args.num_nodes, loaded.architecture if loaded else None)
    shapes = loaded.shapes(setup.zero) if loaded else est.shapes_from_count(args.params, setup.zero)
    experts = est_experts.for_estimate(args.expert_parallel, loaded, setup, args.offload)
    activations, host_activations = _activations(shapes, setup, args)
    usable = None if gpu_memory is None else int(gpu_memory * (1 - args.headroom))
    budget = est.Budget(usable, args.cpu_memory, args.nvme_space, gpus_per_node=num_gpus)
    rows, verdicts = [], {}
    for stage, offload in _combinations(args.offload, experts):
        estimate = est_experts.estimate(experts, shapes, setup, stage, offload)
        if args.cpu_checkpointing:  # [Note: activations in host memory, estimated]
            estimate.host["activations"] = host_activations
            estimate.host["total"] += host_activations
        verdicts[(stage, offload)] = est.fits(estimate, activations or 0, budget)
        rows.append(_row(estimate, activations or 0, num_gpus, verdicts[(stage, offload)]))
        rows[-1]["phases"] = phase_peaks(estimate, activations or 0, _largest_gradient(shapes, setup, stage))
    estimate_time.add_step_times(rows, shapes, setup, args)
    choice = est.recommend(verdicts)
    layouts = _layouts(shapes, setup, rows, num_gpus, args.num_nodes, usable) if experts is None else None
    return {
        "schema_version": SCHEMA_VERSION,
        "model": _model_section(shapes, loaded, args),
        "setup": _setup_section(args, setup, num_gpus, gpu_memory, usable),
        "activations": activations,
        "estimates": rows,
        "expert_parallel": None if experts is None else est_experts.report_section(experts, setup),
        "recommendation": None if choice is None else _recommendation(*choice, experts),
        "layouts": layouts,
        "notes": [
            *zero_notes,
            *_notes(shapes, activations, gpu_memory, choice, args),
            *est_experts.notes(experts, setup, args.micro_batch * args.seq_len),
        ],
    }


def _layouts(
    shapes: est.ModelShapes,
    setup: est.TrainingSetup,
    rows: list[dict[str, Any]],
    num_gpus: int,
    num_nodes: int,
    usable: int | None,
) -> dict[str, Any] | None:
    """Stage 3's layouts on several nodes ([Note: the layout formulas] in debug/layouts.py); None on one node."""
    flat = next((row for row in rows if (row["stage"], row["offload"]) == (3, "none")), None)
    if num_nodes == 1 or flat is None:
        return None
    table = layout_rows(
        shapes.numel, shapes.numel, setup.compute_bytes, setup.comm_bytes, num_nodes, num_gpus, flat["model_states"]
    )
    room = None if usable is None else usable - flat["device"]["total"]
    chosen = recommend_layout(table, room, num_nodes)
    return {"per": "node and micro-step", "rows": [row.as_dict() for row in table], "recommended": chosen.name}


def _check_flags(args: argparse.Namespace) -> None:
    problems = [
        f"--{name} must be at least 1, got {getattr(args, name)}"
        for name in ("num_gpus", "num_nodes", "micro_batch", "seq_len", "expert_parallel")
        if getattr(args, name) is not None and getattr(args, name) < 1
    ]
    if not 0 <= args.headroom < 1:
        problems.append(f"--headroom must be in [0, 1), got {args.headroom}")
    if problems:
        raise ValueError("; ".join(problems))


def _load_model(args: argparse.Namespace) -> Any:
    """The meta-device model of --config_json / --model; None for --params."""
    from accelerate_zero.debug import model_source

    if args.config_json is not None:
        return model_source.load_from_config(args.config_json)
    if args.model is not None:
        return model_source.load_from_folder(args.model)
    return None


def _setup_from(
    args: argparse.Namespace, world_size: int, architecture: est.Architecture | None
) -> tuple[est.TrainingSetup, list[str]]:
    """The run's knobs: the flags, and the --deepspeed_config for buckets, thresholds and dtypes."""
    from accelerate_zero.cli.validate import config_from_accelerate_file, is_accelerate_config
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug.estimate_setup import setup_from_config

    if args.deepspeed_config is None:
        return est.TrainingSetup(world_size, args.mixed_precision or "bf16", args.optimizer), []
    if is_accelerate_config(args.deepspeed_config):  # what `accelerate-zero launch --config_file` would run
        config, _ = config_from_accelerate_file(args.deepspeed_config)
    else:
        config = ZeroConfig.from_any(args.deepspeed_config)
    return setup_from_config(config, world_size, args.mixed_precision, args.optimizer, architecture)


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _local_gpu_memory() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _combinations(offload: str, experts: Any = None) -> list[tuple[int, str]]:
    modes = est.OFFLOAD_MODES if offload == "all" else (offload,)
    applicable = est.is_applicable if experts is None else est_experts.is_applicable
    return [(stage, mode) for stage in est.STAGES for mode in modes if applicable(stage, mode)]


def _activations(shapes: est.ModelShapes, setup: est.TrainingSetup, args: argparse.Namespace) -> tuple:
    if shapes.architecture is None:
        return None, 0
    setup_args = dict(
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        compute_bytes=setup.compute_bytes,
        gradient_checkpointing=args.gradient_checkpointing,
        eager_attention=args.eager_attention,
        sequence_parallel=args.sequence_parallel,
        tile_tokens=args.tile_tokens,
    )
    total = est.activation_bytes(shapes.architecture, **setup_args)
    host = cpu_checkpointed_bytes(shapes.architecture, **setup_args) if args.cpu_checkpointing else 0
    return total - host, host


def _largest_gradient(shapes: est.ModelShapes, setup: est.TrainingSetup, stage: int) -> int:
    """Bytes of the largest full gradient a backward holds beside the rest: a unit's at stage 3, else a parameter's."""
    groups = shapes.units if stage == 3 and shapes.units else tuple((shape,) for shape in shapes.shapes)
    return max((sum(math.prod(shape) for shape in group) for group in groups), default=0) * setup.grad_bytes


def _row(estimate: est.MemoryEstimate, activations: int, num_gpus: int, fits: bool | None) -> dict[str, Any]:
    device = {kind: estimate.device[kind] for kind in est.DEVICE_KINDS}
    device["activations"] = activations
    device["total"] = estimate.device["total"] + activations
    return {
        "stage": estimate.stage,
        "offload": estimate.offload,
        "device": device,
        "model_states": estimate.model_states,
        "host_per_rank": dict(estimate.host),
        "nvme_per_rank": dict(estimate.nvme),
        "cpu_ram_per_node": estimate.host["total"] * num_gpus,
        "nvme_per_node": estimate.nvme["total"] * num_gpus,
        "fits": fits,
    }


def _model_section(shapes: est.ModelShapes, loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    arch = shapes.architecture
    return {
        "source": loaded.source if loaded else "params",
        "name": loaded.name if loaded else "--params",
        "num_parameters": shapes.numel,
        "stage3_units": sum(1 for unit in shapes.units if unit),
        "persistent_parameters": sum(math.prod(shape) for shape in shapes.persistent),
        "exact_layout": shapes.exact_units,
        "architecture": None if arch is None else dict(vars(arch)),
    }


def _setup_section(
    args: argparse.Namespace, setup: est.TrainingSetup, num_gpus: int, gpu_memory: int | None, usable: int | None
) -> dict[str, Any]:
    return {
        "num_gpus": num_gpus,
        "num_nodes": args.num_nodes,
        "world_size": setup.world_size,
        "mixed_precision": setup.mixed_precision,
        "optimizer": setup.optimizer,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "gradient_checkpointing": args.gradient_checkpointing,
        "cpu_checkpointing": args.cpu_checkpointing,
        "eager_attention": args.eager_attention,
        "sequence_parallel": args.sequence_parallel,
        "tile_tokens": args.tile_tokens,
        "gpu_memory": gpu_memory,
        "headroom": args.headroom,
        "usable_gpu_memory": usable,
        "cpu_memory": args.cpu_memory,
        "nvme_space": args.nvme_space,
    }


def _recommendation(stage: int, offload: str, experts: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload != "none":
        device = "nvme" if offload == "nvme" else "cpu"
        zero["offload_optimizer"] = {"device": device, "pin_memory": True}
        if offload in ("cpu+param", "nvme"):
            zero["offload_param"] = {"device": device, "pin_memory": True}
    config = {"zero_optimization": zero, **est_experts.deepspeed_block(experts)}
    return {"stage": stage, "offload": offload, "deepspeed_config": config}


def _notes(
    shapes: est.ModelShapes, activations: int | None, gpu_memory: int | None, choice: Any, args: argparse.Namespace
) -> list[str]:
    notes = []
    if activations is None:
        notes.append(
            "activations are not included (the architecture is unknown): give --config_json or --model for them"
        )
    if not shapes.exact_units:
        notes.append(
            "a bare parameter count: laid out as tensors of reduce_bucket_size elements, one stage 3 unit each, so "
            "buffers and gathered are approximate"
        )
    if gpu_memory is None:
        notes.append("no --gpu_memory: give one (e.g. 80GB) to check fits and get a recommendation")
    elif choice is None:
        notes.append(
            "nothing fits: add GPUs or nodes, lower --micro_batch or --seq_len, use --gradient_checkpointing, "
            "or allow more --cpu_memory / --nvme_space"
        )
    if args.offload in ("all", "nvme") and args.expert_parallel is None:
        notes.append(
            "the nvme rows (optimizer and parameter shards in files) are stage 3 only; NVMe optimizer offload at "
            "stages 1-2 is not estimated"
        )
    return notes
