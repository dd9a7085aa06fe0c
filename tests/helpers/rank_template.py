"""What every pooled rank has imported before it starts: the forkserver imports this module once, then forks each
rank from itself (tests/helpers/dist.py).

Why: a rank started fresh spent 8-12 CPU seconds importing torch, transformers, accelerate, TRL, peft and our
package, about a quarter of all the CPU time the pooled ranks used in the suite (py-spy, distributed tests), and the
session starts 18-24 of them on 2 cores. A forked rank shares the imported modules with the template (copy on
write) and starts in milliseconds. Forking is safe here as the template ran no computation: no OpenMP pool, no
process group, no CUDA (torch's DataLoader forks its workers from processes in that state too). deepspeed is left
out: tests check that code under test does not import it, and a rank imports it only when a body does.

The imports run with the garbage collector off (a few million objects, created once), and what they leave is
frozen out of its view (tests/helpers/heap.py).
"""

from __future__ import annotations

import gc


gc.disable()

import accelerate  # noqa: E402, F401
import datasets  # noqa: E402, F401
import peft  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import transformers  # noqa: E402, F401
import trl  # noqa: E402, F401
from transformers import (  # noqa: E402, F401
    AutoTokenizer,
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Trainer,
    TrainingArguments,
)
from trl import DPOTrainer, GRPOTrainer, SFTTrainer  # noqa: E402, F401

import accelerate_zero  # noqa: E402, F401
import accelerate_zero.integrations.transformers  # noqa: E402, F401
import accelerate_zero.integrations.trl  # noqa: E402, F401
import tests.helpers.models  # noqa: E402, F401
import tests.helpers.rank_process  # noqa: E402, F401
from tests.helpers.heap import freeze_new_imports  # noqa: E402


gc.enable()
freeze_new_imports()
