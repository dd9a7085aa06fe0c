"""QLoRA: LoRA adapters on a 4-bit NF4 base (bitsandbytes), trained with ZeRO-2 or ZeRO-3 through the Trainer.

Usage (needs `pip install -e ".[qlora]"` for bitsandbytes):
    accelerate-zero launch --config_file accelerate_configs/zero3.yaml recipes/qlora.py --config recipes/configs/qlora_demo.yaml
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml recipes/qlora.py --config recipes/configs/qlora_demo.yaml

The base model is quantized to NF4 as it loads (bitsandbytes quantizes on the CPU too), frozen, and prepared for
k-bit training (norms in fp32, input gradients enabled for checkpointing); LoRA adapters on every linear layer are
the only trainable parameters. What ZeRO does with each part:
  * the quantized base weights (uint8, packed 4-bit) are not floating point: they get no gradient, no optimizer
    state, and are not partitioned; every rank keeps its own copy (1/8 of the fp32 size);
  * the floating-point frozen parameters (embeddings, norms, LM head) are sharded at stage 3, kept whole below;
  * the adapters' gradients, fp32 master weights and optimizer states are sharded (stages 2 and 3), and at stage 3
    their parameters too.
The recipe saves the adapter (adapter_model.safetensors + adapter_config.json) and evaluates held-out exact match
with the adapter on its quantized base, before and after training.
"""

from __future__ import annotations

import dataclasses

import torch
from common import EMBEDDED_MODEL, exact_match, load_rows, parse_config, print_rank0
from sft import Collator, SFTScriptArguments, ThroughputMemoryCallback, tokenize_chats
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, set_seed

from accelerate_zero import Trainer, TrainingArguments


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
    tokenizer = AutoTokenizer.from_pretrained(script_args.tokenizer_name_or_path or path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = with_adapters(
        load_quantized(path, script_args.bnb_4bit_quant_type), script_args, training_args.gradient_checkpointing
    )
    if training_args.process_index == 0:
        model.print_trainable_parameters()

    train = load_rows(script_args.dataset_name, script_args.dataset_train_split, script_args.dataset_config)
    with training_args.main_process_first(desc="tokenizing"):
        train = train.map(
            tokenize_chats,
            batched=True,
            fn_kwargs={"tokenizer": tokenizer, "max_length": script_args.max_length},
            remove_columns=train.column_names,
        )
    held_out = None
    if script_args.eval_dataset_name:
        held_out = load_rows(script_args.eval_dataset_name, script_args.eval_dataset_split)
        if script_args.eval_samples:
            held_out = held_out.select(range(min(script_args.eval_samples, len(held_out))))

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        return exact_match(model, tokenizer, held_out, script_args.eval_batch_size, script_args.eval_max_new_tokens)

    # [Note: bitsandbytes on the CPU] A forward without gradients repacks a 4-bit weight in place into the layout
    # of bitsandbytes' CPU inference kernel, and gradients no longer flow back through that layer afterwards (the
    # adapters below it stop learning; plain transformers + peft does the same). So the untrained baseline is
    # measured on a second copy of the quantized base (new adapters start as a no-op: B = 0), never on `model`.
    before = None
    if held_out is not None:
        baseline = load_quantized(path, script_args.bnb_4bit_quant_type)
        before = evaluate(baseline)
        del baseline
    callback = ThroughputMemoryCallback()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=Collator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    callback.trainer = trainer
    trainer.train()
    trainer.save_model(training_args.output_dir)
    print_rank0(f"saved the adapter to {training_args.output_dir}")
    if held_out is not None:
        after = evaluate(trainer.model)
        print_rank0(f"held-out exact match ({after['n']} prompts, greedy, adapter on the 4-bit base):")
        for key in (k for k in after if k.startswith("accuracy")):
            print_rank0(f"  {key:<20} untrained {before[key]:6.1%}   trained {after[key]:6.1%}")


if __name__ == "__main__":
    main()
