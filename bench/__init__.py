"""Benchmark harness (`make bench`): ours vs target-only vs Hugging Face assisted generation."""
