"""Peer benchmarks for kvledger (HF generate, vLLM CPU). Run as ``python -m benchmarks.X``."""
