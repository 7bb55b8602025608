"""Activation checkpointing of transformer blocks: none, full, or every k-th block."""

import typing

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from components.config.schema import ACMode

MODES = typing.get_args(ACMode)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: str = "2") -> int:
    """Wrap blocks of model.layers in place; returns how many were wrapped."""
    if mode not in MODES:
        raise ValueError(f"[activation_checkpoint] mode = {mode!r}: expected one of {MODES}")
    if mode == "none":
        return 0
    k = 1
    if mode == "selective":
        if not every.isdigit() or int(every) < 1:
            raise ValueError(f"[activation_checkpoint] selective_ac_option = {every!r}: "
                             "expected a positive integer k (checkpoint every k-th block)")
        k = int(every)
    wrapped = 0
    for name, block in list(model.layers.items()):
        if int(name) % k == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
            wrapped += 1
    return wrapped
