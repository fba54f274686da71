"""Running a model: loading, int8 layers, per-row attention, sessions and their KV caches,
batched passes, pass costs, the runner. Torch only; no gRPC."""
