"""The host's work a chunk of tokens (`ops.chunk_loop`) or a slice of the vocabulary
(`vocab_sweep`): the aten ops it issues beside its GEMMs and kernel launches, counted on the CPU
with the launches stubbed. At a few thousand tokens that work, not the GPU's, can set the time:
each aten op costs the host microseconds whatever its size."""

import collections

import pytest
import torch

import flce.kernels
import flce.ops
import flce.vocab_sweep
from flce.options import LossOptions
from op_counts import OpCounts


@pytest.fixture
def launches(monkeypatch):
    """The row kernels' launches, counted instead of run."""
    seen = collections.Counter()
    monkeypatch.setattr(flce.kernels, "launch_row_stats", lambda *a, **k: seen.update(["stats"]))
    monkeypatch.setattr(flce.kernels, "launch_rows", lambda *a, **k: seen.update(["rows"]))
    return seen


def _inputs(N, H, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, generator=g), torch.randint(0, V, (N,), generator=g),
            torch.randn(V, H, generator=g) / H ** 0.5, torch.randn(V, generator=g))


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("per_token_weight", [False, True])
def test_a_chunk_of_tokens_is_its_three_gemms_and_a_launch(launches, lean, per_token_weight):
    """64 chunks (the last one shorter) with the row statistics kept: made per chunk, the views
    of x, dx, the per-token tensors and the logits buffer took 11-12 aten ops a chunk, its 3
    GEMMs among them; made once a call, about 3."""
    x, t, w, _ = _inputs(8 * 63 + 5, 4, 100)
    row_weight = torch.rand(x.shape[0]) if per_token_weight else torch.tensor(0.5)
    stats = (torch.empty(x.shape[0]), torch.empty(x.shape[0]))
    with OpCounts() as ops:
        flce.ops.chunked_pass(x, t, w, None, row_weight, stats, False, LossOptions(), 8, lean,
                              True, True, True, False, True)
    assert launches == {"rows": 64}
    assert ops.total() <= 4 * 64, ops.total() / 64  # logits, dx, dW and the call's own


def test_a_slice_of_the_vocabulary_is_its_gemms_and_two_launches(launches, monkeypatch):
    """65 slices of 16 columns (the last 5 wide, padded for its GEMMs), with a bias: made per
    slice and pass, the views took 24 aten ops a slice; made once a call, about 7: the GEMMs
    (logits twice, dx, dW) and db's sum. At 2048x1024x128256 (64 slices) on an H100 the host
    took 10.2 ms a call before, against 5.0 ms of GPU time; 8.0 ms after
    (`benchmarks/flce_lean_paths_views_once_h100.md`)."""
    monkeypatch.setattr(flce.vocab_sweep, "sweep_columns", lambda *a: 16)
    x, t, w, b = _inputs(8, 4, 64 * 16 + 5)
    with OpCounts() as ops:
        flce.vocab_sweep.sweep_pass(x, t, w, b, torch.tensor(0.5), LossOptions(), True, True,
                                    True, True)
    assert launches == {"stats": 65, "rows": 65}
    assert ops.total() <= 8 * 65, ops.total() / 65  # 4 GEMMs, db's sum, and the call's own


def test_a_float8_dx_row_block_is_its_gemm_a_launch_and_its_target_term(launches, monkeypatch):
    """With "logits+dx" each dx row block runs the row kernel, its float8 dx GEMM and the exact
    target term (W's target rows gathered and added). The target ids are clamped once a call:
    clamped and cast per block they were two more ops, and launches, a block (at 1024x32000 a
    block's GEMM is about 0.1 ms: 32 blocks at 65536 tokens)."""
    import flce.float8
    import flce.quantize_kernels
    monkeypatch.setattr(flce.ops, "FLOAT8_MIN_TOKENS", 1)
    monkeypatch.setattr(flce.ops, "FLOAT8_MIN_WORK", 1)
    monkeypatch.setattr(flce.ops, "FLOAT8_DX_BLOCK_TOKENS", 8)
    for name in ("quantize_rows", "quantize_scaled"):  # Triton kernels: counted out, as the rows'
        monkeypatch.setattr(flce.quantize_kernels, name, lambda *a, **k: None)
    monkeypatch.setattr(flce.float8, "scaled_mm", lambda a, b, *r, out=None, **k:
                        torch.empty(a.shape[0], b.shape[1]) if out is None else out)
    x, t, w, _ = _inputs(8 * 63 + 5, 4, 100)
    with OpCounts() as ops:
        flce.ops.chunked_pass(x, t, w, None, torch.tensor(0.5), None, False, LossOptions(), 64,
                              False, True, True, True, False, True, float8="logits+dx")
    assert launches == {"rows": 64}
    clamps = sum(n for op, n in ops.counts.items() if "clamp" in str(op))
    assert clamps == 1, clamps
    # views of the block's rows most of them (about 11): host microseconds beside a GEMM
    assert ops.total() <= 18 * 64, ops.total() / 64
