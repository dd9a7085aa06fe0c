"""`flops_profiler`: the floating-point operations of one optimizer step, counted by `torch.utils.flop_counter`.

[Note: the flops profile]
DeepSpeed's profiler patches torch's functionals to count the forward of the step `profile_step` (the step that
starts after `profile_step` optimizer steps) and estimates backward as twice the forward (plus
`recompute_fwd_factor` of it for recomputed activations). Here `FlopCounterMode` counts what runs: the forwards and
the backwards of that step's micro-batches on rank 0, recomputed forwards included (so `recompute_fwd_factor`, an
estimate of those, is not needed and not applied). The summary prints DeepSpeed's fields that are measured: the
world and batch sizes, forward and backward flops (and MACs: flops / 2), the latencies of forward, backward and the
optimizer step (the device synchronized around each), the FLOPS they give, the iteration latency and samples per
second; then the forward flops of the `top_modules` largest modules at each depth up to `module_depth`. DeepSpeed's
parameter counts and per-module latencies are not printed: the flop counter measures neither.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any


def _number(value: float, unit: str = "") -> str:
    for threshold, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}".rstrip()


class FlopsProfile:
    """Counts the forwards and backwards of step `profile_step` on rank 0 and prints DeepSpeed's summary once."""

    def __init__(self, block: Any, rank: int, world_size: int) -> None:
        self.block, self.rank, self.world_size = block, rank, world_size
        self.flops: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.module_flops: dict[str, int] = defaultdict(int)
        self.done = False

    def profiles(self, completed_steps: int) -> bool:
        """Whether the step after `completed_steps` optimizer steps is the profiled one (on this rank)."""
        return self.rank == 0 and not self.done and completed_steps == self.block.profile_step

    @contextlib.contextmanager
    def counting(self, phase: str) -> Iterator[None]:
        """Counts the flops of `phase` ("forward" or "backward") run inside."""
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as mode:
            yield
        self.flops[phase] += mode.get_total_flops()
        if phase == "forward":
            for name, ops in mode.get_flop_counts().items():
                self.module_flops[name] += sum(ops.values())

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def report(self, step: int, samples_per_rank: int) -> str:
        """The summary of the profiled step ([Note: the flops profile]); marks the profile done."""
        self.done = True
        fwd, bwd = self.flops["forward"], self.flops["backward"]
        t_fwd, t_bwd, t_step = self.seconds["forward"], self.seconds["backward"], self.seconds["step"]
        iteration = t_fwd + t_bwd + t_step

        def rate(flops: float, seconds: float) -> str:
            return _number(flops / seconds, "FLOPS") if seconds > 0 else "n/a"

        rows = [
            ("world size", str(self.world_size)),
            ("data parallel size", str(self.world_size)),
            ("batch size per GPU (the step's micro-batches)", str(samples_per_rank)),
            ("fwd MACs per GPU", _number(fwd / 2, "MACs")),
            ("fwd flops per GPU", _number(fwd)),
            ("fwd latency", f"{1000 * t_fwd:.2f} ms"),
            ("fwd FLOPS per GPU = fwd flops per GPU / fwd latency", rate(fwd, t_fwd)),
            ("bwd flops per GPU (counted)", _number(bwd)),
            ("bwd latency", f"{1000 * t_bwd:.2f} ms"),
            ("bwd FLOPS per GPU = bwd flops per GPU / bwd latency", rate(bwd, t_bwd)),
            ("fwd+bwd FLOPS per GPU = (fwd + bwd flops) / (fwd+bwd latency)", rate(fwd + bwd, t_fwd + t_bwd)),
            ("step latency", f"{1000 * t_step:.2f} ms"),
            ("iter latency", f"{1000 * iteration:.2f} ms"),
            ("samples/second", f"{samples_per_rank * self.world_size / iteration:.2f}" if iteration > 0 else "n/a"),
        ]
        lines = [
            "-------------------------- DeepSpeed Flops Profiler --------------------------",
            f"Profile Summary at step {step}:",
            *(f"{name + ':':<70}{value}" for name, value in rows),
        ]
        if self.block.detailed:
            lines += self._modules()
        lines.append("------------------------------------------------------------------------------")
        return "\n".join(lines)

    def _modules(self) -> list[str]:
        """The forward flops of the largest modules at each depth (the root module is depth 0)."""
        by_depth: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for name, flops in self.module_flops.items():
            if name != "Global":
                by_depth[name.count(".")].append((flops, name))
        lines = [f"Top {self.block.top_modules} modules in terms of fwd flops at different model depths:"]
        for depth in sorted(by_depth):
            if 0 <= self.block.module_depth < depth:
                break
            top = sorted(by_depth[depth], reverse=True)[: self.block.top_modules]
            lines.append(f"depth {depth}: " + ", ".join(f"{name}: {_number(flops)}" for flops, name in top))
        return lines
