"""Benchmarks: ``python -m fmoe2.bench`` (fmoe2 vs a vLLM-style Triton path)."""
