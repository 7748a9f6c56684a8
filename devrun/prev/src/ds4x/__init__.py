"""ds4x: inference runtime for long-context sparse-attention MoE models."""

__version__ = "0.1.0"
