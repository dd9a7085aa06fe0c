"""The benchmark harness: launch ranks, wrap a model as each peer, read the machine, report. One file per question
sits beside this package in bench/ (engine_bench.py, stage3_bench.py, ...) and is a few lines on top of it.

| module | what |
| --- | --- |
| launch.py | `on_ranks(W, function, kwargs)`: W fresh ranks (torchrun; one process at W = 1) run `function` |
| rank.py | the rank side of `on_ranks` (never run by hand) |
| peers.py | DDP, DDP + ZeroRedundancyOptimizer, FSDP2, accelerate_zero stages 0-3, DeepSpeed 1-3: `build(name, ...)` |
| readings.py | memory (RSS, anonymous, peaks), wire bytes, live tensors, collective bytes ([Note: how ...]) |
| steps.py | the timed loop (wall, CPU, faults, bytes per step) and `train`, one peer on the Linear stack |
| models.py | the shared workloads: the Linear stack, its data, its ZeRO config; a Llama from a config |
| summary.py | every rank's readings of a training run into one `Summary` per peer (pure Python) |
| report.py | markdown tables, PASS/FAIL checks, the machine and its load, the saved JSON (pure Python) |
| code.py | which accelerate_zero the ranks import: the working tree or a `git archive` of a commit |

A question, whole (run it as `python bench/my_question.py`; the function given to `on_ranks` must be top-level):

    from harness import launch, peers, report, steps, summary

    def main() -> None:
        facts, runs = report.machine_facts(), {}
        for _, system in launch.interleaved(["ddp", "fsdp2", "az3"], rounds=2):
            ranks = launch.on_ranks(2, steps.train, {"system": system, "steps": 20, "warmup": 3}, name=system)
            runs.setdefault(system, []).append(summary.records(ranks))
        done = [summary.summarize(system, rounds) for system, rounds in runs.items()]
        print(report.header(facts, "stage 3 against FSDP2 and DDP, W = 2"))
        rows = [(peers.PEERS[s.system].label, report.fmt(s.step_ms), report.ratio(s.step_ms, done[0].step_ms))
                for s in done]
        print(report.table(["system", "step ms", "vs DDP"], rows))

Another model: write a top-level rank function that builds it and calls `peers.build(system, model, loss,
zero_config=...)` and `steps.run_steps(...)` (see `steps.train`), and give it to `on_ranks`. A single-process
question calls `launch.single_process_env()` and reads `readings` directly.
"""
