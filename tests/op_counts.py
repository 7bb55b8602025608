"""Counting the aten ops that run (below autograd: forward's, backward's and recomputed ones),
for tests of what a piece of code makes the host or the GPU do."""

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounts(TorchDispatchMode):
    """How many times each op ran inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.counts.values())
