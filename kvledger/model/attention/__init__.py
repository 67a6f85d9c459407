"""Attention backends: the interface, the step metadata, and the PyTorch (CPU) reference."""

from kvledger.model.attention.backend import AttentionBackend
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
