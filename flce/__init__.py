"""flce: an exact, fast fused linear cross-entropy (Triton on the GPU, PyTorch on the CPU)."""

from flce.dispatch import triton_usable
from flce.function import fused_linear_cross_entropy
from flce.module import FusedLinearCrossEntropyLoss
from flce.options import LossOptions
from flce.reference import chunked_linear_cross_entropy, linear_cross_entropy

__all__ = [
    "FusedLinearCrossEntropyLoss",
    "chunked_linear_cross_entropy",
    "LossOptions",
    "fused_linear_cross_entropy",
    "linear_cross_entropy",
    "triton_usable",
]
