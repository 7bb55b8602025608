"""memory_lean's sweep over vocabulary slices (flce/vocab_sweep.py): where it is taken, that its
buffer stays within memory_lean's token chunk, and its loss and gradients against float64."""

import pytest
import torch

import flce
from flce.ops import pick_chunk_size
import flce.vocab_sweep
from flce.vocab_sweep import sweep_columns, uses_vocab_sweep
from flce_cases import (IMPL_DEVICES, OPTIONS, cuda_only, float64_reference, loss_and_grads,
                        make_inputs, rel_err, skip_if_interpreted_bf16)


@pytest.fixture
def small_weights_sweep(monkeypatch):
    """The sweep at the tests' small W too (it is taken only from SWEEP_MIN_WEIGHT up)."""
    monkeypatch.setattr(flce.vocab_sweep, "SWEEP_MIN_WEIGHT", 0)


def test_taken_where_the_token_chunks_would_be_short_and_w_large():
    # memory_lean's token chunks: next_pow2(N / ceil(V / H)) tokens (Liger-Kernel's)
    assert uses_vocab_sweep(2048, 1024, 256000, 2, None, True, "none")        # 8-token chunks
    assert uses_vocab_sweep(16384, 1024, 256000, 2, None, True, "none")       # 128
    assert uses_vocab_sweep(2048, 2048, 128256, 2, None, True, "none")        # 32
    # 256-token chunks: each chunk's dW GEMM is bound by dW's traffic (H200 and H100 probes)
    assert uses_vocab_sweep(4096, 8192, 128256, 2, None, True, "none")        # 256
    assert uses_vocab_sweep(8192, 8192, 256000, 2, None, True, "none")        # 256
    assert uses_vocab_sweep(8192, 2048, 128256, 2, None, True, "none")        # 256
    assert not uses_vocab_sweep(8192, 8192, 128256, 2, None, True, "none")    # 512
    assert not uses_vocab_sweep(16384, 4096, 256000, 2, None, True, "none")   # 512
    assert not uses_vocab_sweep(65536, 4096, 256000, 2, None, True, "none")
    # W of 2^25-2^27 elements: the sweep was faster there too (an H100, synchronised calls and
    # with the host ahead; it was not taken at first, under a bound of 2^27)
    assert uses_vocab_sweep(2048, 1024, 128256, 2, None, True, "none")        # 32
    assert uses_vocab_sweep(16384, 1024, 128256, 2, None, True, "none")       # 256
    assert uses_vocab_sweep(2048, 2048, 32000, 2, None, True, "none")         # 128
    assert uses_vocab_sweep(2048, 4096, 32000, 2, None, True, "none")         # 256
    # W of fewer than SWEEP_MIN_WEIGHT elements: the host's launches set the time, not W's traffic
    assert not uses_vocab_sweep(2048, 1024, 32000, 2, None, True, "none")     # 64
    assert not uses_vocab_sweep(4096, 512, 50257, 2, None, True, "none")      # 64
    # only memory_lean, only without a chunk_size asked for, only without float8 GEMMs
    assert not uses_vocab_sweep(2048, 1024, 256000, 2, None, False, "none")
    assert not uses_vocab_sweep(2048, 1024, 256000, 2, 64, True, "none")
    assert not uses_vocab_sweep(2048, 1024, 256000, 2, None, True, "logits")
    # all tokens in one chunk: nothing to sweep
    assert not uses_vocab_sweep(4, 1 << 20, 1000, 2, None, True, "none")      # a chunk of 4
    assert not uses_vocab_sweep(100, 1 << 20, 1000, 2, None, True, "none")    # of 104


@pytest.mark.parametrize("N,H,V", [(2048, 1024, 256000), (4096, 8192, 128256), (333, 24, 50257),
                                   (16384, 1024, 32000)])
def test_slices_take_no_more_memory_than_the_token_chunk(N, H, V):
    """The slice's logits and the statistics backward keeps (KEPT_BYTES_PER_TOKEN) within the
    token chunk's logits: at first the statistics came on top, 8 bytes a token over Liger-Kernel's
    peak on an H200."""
    cols = sweep_columns(N, H, V, 2)
    assert cols % 16 == 0 and cols >= 16
    kept = flce.vocab_sweep.KEPT_BYTES_PER_TOKEN * N
    assert N * cols * 2 + kept <= pick_chunk_size(N, H, V, 2, None, lean=True) * V * 2


def _check(impl, device, dtype, N, H, V, bias, tol, **kw):
    assert uses_vocab_sweep(N, H, V, torch.tensor([], dtype=dtype).element_size(), None, True,
                            "none")
    x, t, w, b = make_inputs(N, H, V, device, dtype, bias=bias)
    t[0] = V - 1  # a target in the last slice (the narrow one), whatever the seed
    if "ignore_index" in kw:
        t[t == -100] = kw["ignore_index"]
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl=impl,
                                     memory_lean=True, **kw)
    ref_loss, ref_grads = float64_reference(x, t, w, b, up, **kw)
    assert loss.shape == ref_loss.shape and torch.isfinite(loss).all()
    assert rel_err(loss, ref_loss) <= tol, rel_err(loss, ref_loss)
    for name, g, r in zip("x W b".split(), grads, ref_grads):
        assert g.dtype == dtype
        assert rel_err(g, r) <= tol, (name, rel_err(g, r), kw)


@IMPL_DEVICES
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_float64(impl, device, options, reduction, small_weights_sweep):
    # 8-token chunks -> slices of 16 columns: 7, the last one 5 wide (padded for its GEMMs).
    # 23 tokens (an odd count): Triton's interpreter runs a program a row and slice (67 took 3x
    # as long)
    _check(impl, device, torch.float32, 23, 24, 101, True, 1e-5, reduction=reduction, **options)


@IMPL_DEVICES
@pytest.mark.parametrize("bias", [False, True])
def test_more_slices_than_a_statistics_group(impl, device, bias, small_weights_sweep,
                                             monkeypatch):
    """1-token chunks -> 16-column slices: 13 of them, combined in groups of 5 (STATS_GROUP's
    default, 32, would take 33 slices: a minute in Triton's interpreter)."""
    monkeypatch.setattr(flce.vocab_sweep, "STATS_GROUP", 5)
    assert pick_chunk_size(20, 8, 200, 4, None, lean=True) == 1
    assert -(-200 // sweep_columns(20, 8, 200, 4)) == 13
    _check(impl, device, torch.float32, 20, 8, 200, bias, 1e-5, reduction="mean",
           label_smoothing=0.1, normalizer=7.0)
    _check(impl, device, torch.float32, 20, 8, 200, bias, 1e-5, reduction="none", z_loss=1e-3)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mean_and_sum_keep_the_row_statistics_in_the_logits_buffer(monkeypatch, reduction,
                                                                   small_weights_sweep):
    """Both passes run in forward for mean and sum, the rows' (max, log sum) in the tail of the
    one buffer: kept as tensors of their own (8 bytes a token) they put the peak up to 30 KiB
    above Liger-Kernel's on an H200 (benchmarks/flce_lean_sweep_h200.md, 99f3567)."""
    seen, grads = [], flce.vocab_sweep.sweep_grads

    def spy(row_weight, x, target, weight, bias, loss, stats, *rest, **kw):
        seen.append((stats, rest[-2]))
        return grads(row_weight, x, target, weight, bias, loss, stats, *rest, **kw)

    monkeypatch.setattr(flce.vocab_sweep, "sweep_grads", spy)
    x, t, w, b = make_inputs(67, 24, 101, "cpu", torch.float32)
    flce.fused_linear_cross_entropy(x, t, w, b, memory_lean=True, reduction=reduction,
                                    impl="torch").backward()
    (stats, buf), = seen
    assert all(s.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
               for s in stats)


@IMPL_DEVICES
def test_bf16(impl, device, small_weights_sweep):
    skip_if_interpreted_bf16(impl, device)
    # dx accumulates in bf16 over the slices (memory_lean's precision); dW is rounded once
    _check(impl, device, torch.bfloat16, 300, 64, 1000, True, 2e-2, reduction="mean")


def test_a_target_outside_the_vocabulary_is_a_clear_error(small_weights_sweep):
    x, t, w, b = make_inputs(67, 24, 101, "cpu", torch.float32)
    t[3] = 101
    with pytest.raises(IndexError, match="target id 101 is outside"):
        flce.fused_linear_cross_entropy(x, t, w, b, memory_lean=True, impl="torch")


@pytest.mark.slow
@IMPL_DEVICES
def test_inside_torch_compile(impl, device, small_weights_sweep):
    torch._dynamo.reset()
    x, t, w, b = make_inputs(48, 16, 37, device, torch.float32)

    def loss_of(x, w, b):
        return flce.fused_linear_cross_entropy(torch.tanh(x), t, w, b, memory_lean=True,
                                               label_smoothing=0.1, impl=impl)
    eager = loss_of(x, w, b)
    eager_grads = torch.autograd.grad(eager, (x, w, b))
    compiled = torch.compile(loss_of, backend="inductor", fullgraph=True)
    loss = compiled(x, w, b)
    grads = torch.autograd.grad(loss, (x, w, b))
    assert rel_err(loss, eager) <= 1e-6
    assert all(rel_err(g, ge) <= 1e-5 for g, ge in zip(grads, eager_grads))


@cuda_only
def test_no_host_sync_on_cuda(small_weights_sweep):
    x, t, w, b = make_inputs(300, 64, 1000, "cuda", torch.bfloat16)
    assert uses_vocab_sweep(300, 64, 1000, 2, None, True, "none")
    flce.fused_linear_cross_entropy(x, t, w, b, memory_lean=True).backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for reduction in ("mean", "none"):
            loss = flce.fused_linear_cross_entropy(x, t, w, b, reduction=reduction,
                                                   memory_lean=True, label_smoothing=0.1)
            loss.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


def test_slice_grads_has_no_data_dependent_shape():
    """The target column's gradient by a scatter: indexing by owns.nonzero() made a tensor whose
    shape depends on the values (on CUDA the host waits for them; on the meta device it cannot
    run at all, which is what this checks on the CPU)."""
    from flce.options import LossOptions
    from flce.vocab_slices import slice_grads
    meta = lambda *shape, dtype=torch.float32: torch.empty(*shape, device="meta", dtype=dtype)  # noqa: E731
    logits = meta(6, 5)
    slice_grads(logits, meta(6, dtype=torch.int64), meta(6), meta(6), meta(6), meta(()),
                LossOptions(label_smoothing=0.1), 2, 10)
    assert logits.shape == (6, 5)
