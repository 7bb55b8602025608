"""flce: an exact, fast fused linear cross-entropy (Triton on the GPU, PyTorch on the CPU).

The loss: fused_linear_cross_entropy (the function), FusedLinearCrossEntropyLoss (the module),
LossOptions; the baselines linear_cross_entropy (unfused) and chunked_linear_cross_entropy.
Under tensor parallelism the module's forward is parallelised by a torch ParallelStyle:
LinearLossParallel (sequence-sharded tokens, a replicated weight) or VocabParallelLinearLoss
(the weight sharded on the vocabulary).
"""

from flce.dispatch import triton_usable
from flce.function import fused_linear_cross_entropy
from flce.module import FusedLinearCrossEntropyLoss
from flce.options import LossOptions
from flce.parallel import LinearLossParallel, VocabParallelLinearLoss
from flce.reference import chunked_linear_cross_entropy, linear_cross_entropy

__all__ = [
    "FusedLinearCrossEntropyLoss",
    "LinearLossParallel",
    "LossOptions",
    "VocabParallelLinearLoss",
    "chunked_linear_cross_entropy",
    "fused_linear_cross_entropy",
    "linear_cross_entropy",
    "triton_usable",
]
