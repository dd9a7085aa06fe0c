"""`deepspeed.pipe` (PipelineModule, LayerSpec, TiedLayerSpec): pipeline parallelism is not available."""

raise ImportError(
    "accelerate_zero.deepspeed.pipe: pipeline parallelism (PipelineModule, LayerSpec) is not available in "
    "accelerate_zero; train the whole model on every rank with ZeRO (stage 3 shards it) and use "
    "sequence_parallel_size for long sequences"
)
