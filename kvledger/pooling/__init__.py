"""Pooling models (vLLM's pooling runner): a prompt in, one vector out (embeddings).

``params.py`` and ``config.py`` are plain data read by the engine and the front ends (no
torch); ``pooler.py`` is the runner's side, which pools hidden states across prefill chunks.
"""
