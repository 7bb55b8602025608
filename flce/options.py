"""The loss options, checked once when they are given."""

import math
from dataclasses import dataclass
from typing import Optional

REDUCTIONS = ("mean", "sum", "none")


def finite(v: float) -> bool:
    # comparisons, not math.isfinite: torch.compile(dynamic=True) passes floats as SymFloats,
    # on which it can guard a comparison but cannot call math.isfinite
    return -math.inf < v < math.inf


@dataclass(frozen=True)
class LossOptions:
    ignore_index: int = -100
    label_smoothing: float = 0.0
    logit_scale: float = 1.0
    z_loss: float = 0.0
    softcap: Optional[float] = None
    reduction: str = "mean"

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r}: expected one of {REDUCTIONS}")
        # 1 is torch's too: the target is then the uniform distribution over the vocabulary
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing}: must be in [0, 1]")
        if not (finite(self.logit_scale) and self.logit_scale > 0):
            raise ValueError(f"logit_scale={self.logit_scale}: must be a finite number > 0")
        if not (finite(self.z_loss) and self.z_loss >= 0):
            raise ValueError(f"z_loss={self.z_loss}: must be a finite number >= 0")
        if self.softcap is not None and not (finite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap={self.softcap}: must be None or a finite number > 0")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index={self.ignore_index!r}: must be an int")
        if not -2**63 <= self.ignore_index < 2**63:
            raise ValueError(f"ignore_index={self.ignore_index}: must fit in int64 (targets are "
                             "compared with it as integers)")

    def loss_kwargs(self) -> dict:
        """The options as keyword arguments of the loss functions (reduction excluded)."""
        return {k: getattr(self, k) for k in
                ("ignore_index", "label_smoothing", "logit_scale", "z_loss", "softcap")}
