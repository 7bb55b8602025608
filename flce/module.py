"""FusedLinearCrossEntropyLoss: the loss as an nn.Module, argument order of fla's module."""

from typing import Optional

from torch import Tensor, nn

from flce.function import check_settings, fused_linear_cross_entropy
from flce.options import LossOptions


class FusedLinearCrossEntropyLoss(nn.Module):
    """`forward(x, target, weight, bias=None, normalizer=None)` -> loss; options fixed at init."""

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        logit_scale: float = 1.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        reduction: str = "mean",
        chunk_size: Optional[int] = None,
        memory_lean: bool = False,
        float8: str = "none",
        impl: str = "auto",
    ):
        super().__init__()
        # checked here, not at the first step
        self.options = LossOptions(ignore_index, label_smoothing, logit_scale, z_loss, softcap,
                                   reduction)
        check_settings(chunk_size, memory_lean, float8, impl)
        self.chunk_size = chunk_size
        self.memory_lean = memory_lean
        self.float8 = float8
        self.impl = impl

    def forward(self, x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                normalizer=None) -> Tensor:
        o = self.options
        return fused_linear_cross_entropy(
            x, target, weight, bias, **o.loss_kwargs(), reduction=o.reduction,
            normalizer=normalizer,
            chunk_size=self.chunk_size, memory_lean=self.memory_lean, float8=self.float8,
            impl=self.impl)

    def extra_repr(self) -> str:
        return (f"{self.options}, chunk_size={self.chunk_size}, memory_lean={self.memory_lean}, "
                f"float8={self.float8!r}, impl={self.impl!r}")
