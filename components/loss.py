"""The training loss, chosen by `[loss] impl`, and the module that joins it to the model.

All three implementations compute the same quantity, sum of token losses / normalizer (the
global count of non-ignored tokens), from the same hidden states and output weight, so loss
curves of runs that differ only in `impl` are comparable.
"""

import dataclasses
import math
import typing
from contextlib import contextmanager
from typing import Iterator, Optional

from torch import Tensor, nn

import flce
from flce.function import check_settings
from components.config.schema import Loss, LossImpl

IGNORE_INDEX = -100
IMPLS = typing.get_args(LossImpl)


class TrainingLoss(nn.Module):
    def __init__(self, cfg: Loss):
        super().__init__()
        if cfg.impl not in IMPLS:
            raise ValueError(f"[loss] impl = {cfg.impl!r}: expected one of {IMPLS}")
        self.impl = cfg.impl
        # 0 is "none" here, where flce's API takes None, which a config cannot say
        if not (cfg.softcap == 0 or math.isfinite(cfg.softcap) and cfg.softcap > 0):
            raise ValueError(f"[loss] softcap = {cfg.softcap}: expected 0 (none) or a finite "
                             "number > 0")
        if cfg.chunk_size < 0:
            raise ValueError(f"[loss] chunk_size = {cfg.chunk_size}: expected 0 (automatic) or a "
                             "number of tokens > 0")
        try:  # flce's own checks, here rather than at the first step
            # sums: the trainer always divides by the global token count (normalizer)
            self.options = flce.LossOptions(IGNORE_INDEX, cfg.label_smoothing, cfg.logit_scale,
                                            cfg.z_loss, cfg.softcap or None, reduction="sum")
            check_settings(cfg.chunk_size or None, cfg.memory_lean, cfg.float8, "auto")
        except (ValueError, TypeError) as e:
            raise ValueError(f"[loss] {e}") from None
        if cfg.float8 != "none" and cfg.impl != "flce":
            raise ValueError(f"[loss] float8 = {cfg.float8!r} needs [loss] impl = \"flce\" "
                             f"(got {cfg.impl!r}): only the fused loss has float8 GEMMs")
        self.chunk_size = cfg.chunk_size or None
        self.memory_lean = cfg.memory_lean
        self.float8 = cfg.float8

    def forward(self, hidden: Tensor, labels: Tensor, weight: Tensor, bias: Optional[Tensor],
                normalizer: Tensor) -> Tensor:
        if self.impl == "flce":
            return flce.fused_linear_cross_entropy(
                hidden, labels, weight, bias, normalizer=normalizer, chunk_size=self.chunk_size,
                memory_lean=self.memory_lean, float8=self.float8, **self.options.loss_kwargs())
        if self.impl == "torch_chunked":
            return flce.chunked_linear_cross_entropy(
                hidden, labels, weight, bias, normalizer=normalizer,
                chunk_size=self.chunk_size or 4096, **self.options.loss_kwargs())
        return flce.linear_cross_entropy(hidden, labels, weight, bias, normalizer=normalizer,
                                         **self.options.loss_kwargs())

    @contextmanager
    def cross_entropy_only(self) -> Iterator[None]:
        """Inside the block the loss is the plain cross-entropy (validation, bits per byte):
        label smoothing and z-loss regularise training only; logit_scale and softcap stay, they
        define the logits. Every implementation and parallel style reads `options` per call."""
        saved = self.options
        self.options = dataclasses.replace(saved, label_smoothing=0.0, z_loss=0.0)
        try:
            yield
        finally:
            self.options = saved

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, float8={self.float8!r}, {self.options}"


class ModelWithLoss(nn.Module):
    """model(tokens) -> final hidden states; then the loss with model.output's weight and bias.

    The loss runs inside this module's forward so that FSDP, which owns model.output's
    parameters at this level, has them unsharded during the loss and frees them after."""

    def __init__(self, model: nn.Module, loss: TrainingLoss):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, tokens: Tensor, labels: Tensor, normalizer: Tensor) -> Tensor:
        hidden = self.model(tokens)
        out = self.model.output
        return self.loss(hidden, labels, out.weight, out.bias, normalizer)
