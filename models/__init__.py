"""Llama-3 model: architecture, hyperparameters and named flavors, parameter/FLOP/activation
counts."""

from models.args import (FLAVORS, LlamaArgs, flops_per_token, param_count_for,
                         saved_values_per_token, with_context)
from models.llama import KVCache, Llama, apply_rope, build_rope_cache, num_params, rope_frequencies

__all__ = [
    "FLAVORS",
    "KVCache",
    "Llama",
    "LlamaArgs",
    "apply_rope",
    "build_rope_cache",
    "flops_per_token",
    "num_params",
    "param_count_for",
    "rope_frequencies",
    "saved_values_per_token",
    "with_context",
]
