"""The benchmark harness: launch ranks (launch, rank), wrap a model as each peer (peers), the shared workloads
(models), read the machine (readings), the timed loop (steps), combine and report (summary, report), the command
line of every question (cli), which code the ranks import (code). bench/README.md, "Layout", has a whole question.
"""
