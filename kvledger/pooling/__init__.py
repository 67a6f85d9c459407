"""Pooling models (vLLM's pooling runner): a prompt in, one vector out (embeddings).

``params.py`` and ``config.py`` are plain data read by the engine and the front ends, and
``requests.py`` the engine's side of a pooling request (no torch in any of them); ``pooler.py``
is the runner's side, which pools hidden states across prefill chunks.
"""
