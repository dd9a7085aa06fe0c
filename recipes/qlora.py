"""QLoRA: LoRA adapters on a 4-bit NF4 base (bitsandbytes), trained with ZeRO-2 or ZeRO-3 through the Trainer.

Usage (needs `pip install -e ".[qlora]"` for bitsandbytes):
    accelerate-zero launch --config_file accelerate_configs/zero3.yaml recipes/qlora.py --config recipes/configs/qlora_demo.yaml
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml recipes/qlora.py --config recipes/configs/qlora_demo.yaml

The base model is quantized to NF4 as it loads (bitsandbytes quantizes on the CPU too), frozen, and prepared for
k-bit training (norms in fp32, input gradients enabled for checkpointing); LoRA adapters on every linear layer are
the only trainable parameters. What ZeRO does with each part:
  * the quantized base weights (uint8, packed 4-bit) are not floating point: they get no gradient, no optimizer
    state, and are not partitioned; every rank keeps its own copy (1/8 of the fp32 size). Stored as floats
    (`bnb_4bit_quant_storage=torch.float32` or bf16 in BitsAndBytesConfig, as transformers documents for ZeRO-3
    QLoRA) they are partitioned at stage 3 like any frozen weight (tests/integration/test_qlora.py trains both);
  * the floating-point frozen parameters (embeddings, norms, LM head) are sharded at stage 3, kept whole below;
  * the adapters' gradients, fp32 master weights and optimizer states are sharded (stages 2 and 3), and at stage 3
    their parameters too.
The recipe saves the adapter (adapter_model.safetensors + adapter_config.json) and evaluates held-out exact match
with the adapter on its quantized base, before and after training.
"""

from __future__ import annotations

import dataclasses

import torch
from common import EMBEDDED_MODEL, parse_config
from sft import SFTScriptArguments, load_tokenizer, train_and_evaluate
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, set_seed

from accelerate_zero import TrainingArguments


@dataclasses.dataclass
class QLoRAScriptArguments(SFTScriptArguments):
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = dataclasses.field(
        default="all-linear", metadata={"help": 'comma-separated module names, or "all-linear"'}
    )
    bnb_4bit_quant_type: str = dataclasses.field(default="nf4", metadata={"help": "nf4 or fp4"})


def load_quantized(path: str, quant_type: str) -> torch.nn.Module:
    """The base model with its linear layers quantized to 4 bits as they load (computing in fp32)."""
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.float32
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32)


def with_adapters(model: torch.nn.Module, args: QLoRAScriptArguments, checkpointing: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def main() -> None:
    script_args, training_args = parse_config((QLoRAScriptArguments, TrainingArguments))
    set_seed(training_args.seed)
    path = script_args.model_name_or_path or EMBEDDED_MODEL
    tokenizer = load_tokenizer(script_args, path)
    model = with_adapters(
        load_quantized(path, script_args.bnb_4bit_quant_type), script_args, training_args.activation_checkpointing
    )
    if training_args.process_index == 0:
        model.print_trainable_parameters()
    # [Note: bitsandbytes on the CPU] A forward without gradients repacks a 4-bit weight in place into the layout
    # of bitsandbytes' CPU inference kernel, and gradients no longer flow back through that layer afterwards (the
    # adapters below it stop learning; plain transformers + peft does the same). So the untrained baseline is
    # measured on a second copy of the quantized base (new adapters start as a no-op: B = 0), never on `model`.
    train_and_evaluate(
        model,
        script_args,
        training_args,
        tokenizer,
        baseline=lambda: load_quantized(path, script_args.bnb_4bit_quant_type),
    )


if __name__ == "__main__":
    main()
