"""`deepspeed.runtime` (DeepSpeed's internals) is not available: scripts use the public API instead."""

raise ImportError(
    "accelerate_zero.deepspeed.runtime: DeepSpeed's internals (runtime.zero.partition_parameters, "
    "runtime.engine, ...) are not available; use accelerate_zero.deepspeed.zero (Init, GatheredParameters, "
    "register_external_parameter), .comm, and the engine's methods. Parameters carry no ds_* attributes: a "
    "partitioned parameter's data is a 0-element placeholder until gathered"
)
