"""Classes masked by a -inf logit (a bias of -inf, e.g. a vocabulary padded past the tokenizer's
classes) on the loss's PyTorch paths over vocabulary slices: finite, as torch's cross_entropy.
All inputs fp32: the tolerance 1e-5 (relative, against float64) is ~100x fp32's epsilon, far
above the rounding of these tiny shapes (~3e-7 on the paths that were right) and far below the
errors seen (NaN)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flce
import flce.vocab_sweep
from flce.vocab_parallel import vocab_parallel_linear_cross_entropy

TOL = 1e-5


def _inputs(N, H, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.1
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.1] = -100
    return x, t, w, b


def _masked(b, t, lo, hi):
    """Classes [lo, hi) masked out by a -inf bias (e.g. a vocabulary padded past the tokenizer's
    classes), and no target among them: the loss is finite, as torch's cross_entropy gives it."""
    b = b.clone()
    b[lo:hi] = float("-inf")
    t = t.clone()
    t[(t >= lo) & (t < hi)] = hi if hi < b.shape[0] else lo - 1
    return b, t


def _rel(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def _float64_ce(x, t, w, b, upstream, reduction):
    xd, wd, bd = (a.detach().double().requires_grad_() for a in (x, w, b))
    loss = F.cross_entropy(F.linear(xd, wd, bd), t, reduction=reduction)
    return loss, torch.autograd.grad(loss, (xd, wd, bd), upstream)


# --- 1. memory_lean's vocabulary sweep on the PyTorch path: a -inf logit makes every loss NaN ---
#
# Input: memory_lean=True at a shape that takes the vocabulary sweep (flce/vocab_sweep.py; the
# tests' small W reaches it with SWEEP_MIN_WEIGHT = 0, as tests/test_flce_vocab_sweep.py does),
# impl="torch" (every CPU call), a bias of -inf on some classes, no target among them.
# Expected: the loss and gradients of torch's cross_entropy (finite), as the default path, the
# token chunks and the Triton sweep all give. Actual: NaN loss for every token and NaN dx, dW,
# db. Cause: vocab_slices.loss_from_sums adds label_smoothing * (... sum z ...) even when
# label_smoothing == 0 (0 * -inf = NaN), and a slice whose logits are all -inf gets
# exp(-inf - (-inf)) = NaN in slice_stats.

@pytest.mark.parametrize("lo,hi", [(290, 300), (0, 16), (100, 140)],
                         ids=["part_of_the_last_slice", "one_whole_slice", "across_slices"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_memory_lean_vocab_sweep_torch_path_with_masked_classes(monkeypatch, lo, hi, reduction):
    monkeypatch.setattr(flce.vocab_sweep, "SWEEP_MIN_WEIGHT", 0)
    N, H, V = 64, 8, 300
    assert flce.vocab_sweep.uses_vocab_sweep(N, H, V, 4, None, True, "none")
    x64, t, w64, b64 = _inputs(N, H, V)
    b64, t = _masked(b64, t, lo, hi)
    x, w, b = (a.float().requires_grad_() for a in (x64, w64, b64))
    loss = flce.fused_linear_cross_entropy(x, t, w, b, reduction=reduction, memory_lean=True,
                                           impl="torch")
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64)
    grads = torch.autograd.grad(loss, (x, w, b), upstream.float())
    ref_loss, ref_grads = _float64_ce(x, t, w, b, upstream, reduction)
    assert _rel(loss, ref_loss) < TOL
    for name, g, r in zip(("dx", "dW", "db"), grads, ref_grads):
        assert _rel(g, r) < TOL, name


# --- 2. the same root cause in the vocab-parallel loss's CPU path ---
#
# Input: flce.vocab_parallel's loss (what VocabParallelLinearLoss runs) on the CPU, here one
# gloo rank holding the whole vocabulary, a -inf bias on the last class.
# Expected: torch's cross_entropy (2.77 here, finite); actual: NaN loss and gradients
# (vocab_slices.loss_from_sums).

def test_vocab_parallel_cpu_path_with_a_masked_class(tmp_path):
    N, H, V = 8, 6, 11
    x64, t, w64, b64 = _inputs(N, H, V)
    b64, t = _masked(b64, t, V - 1, V)
    x, w, b = (a.float().requires_grad_() for a in (x64, w64, b64))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        loss = vocab_parallel_linear_cross_entropy(x, t, w, b, vocab_start=0, vocab_size=V,
                                                   chunk_size=4, impl="torch")
        grads = torch.autograd.grad(loss, (x, w, b))
    finally:
        dist.destroy_process_group()
    ref_loss, ref_grads = _float64_ce(x, t, w, b, torch.tensor(1.0, dtype=torch.float64), "mean")
    assert _rel(loss, ref_loss) < TOL
    for name, g, r in zip(("dx", "dW", "db"), grads, ref_grads):
        assert _rel(g, r) < TOL, name
