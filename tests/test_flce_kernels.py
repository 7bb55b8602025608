"""The Triton row kernel against its PyTorch twin on one chunk, several vocabulary blocks."""

import os

import pytest
import torch

from flce.options import LossOptions
from flce.reference import chunk_rows

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs CUDA or TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, logits, target, weight, opts, stats_in=None, compute_grad=True, in_place=False):
    """(loss, (row max, log sum exp), logits after the pass); with stats_in, a gradient pass
    reading those statistics. in_place: the pass runs on `logits` itself, not a copy."""
    logits = logits if in_place else logits.clone()
    C = logits.shape[0]
    loss = torch.full((C,), float("nan"), device=DEVICE)  # poisoned: every row must be written
    stats = (tuple(torch.full((C,), float("nan"), device=DEVICE) for _ in range(2))
             if stats_in is None else tuple(t.clone() for t in stats_in))
    fn(logits, target, loss, stats, weight, opts, stats_in is not None, compute_grad)
    return loss, stats, logits


@pytest.mark.parametrize("opts", [
    LossOptions(),
    LossOptions(label_smoothing=0.2, z_loss=1e-3),
    LossOptions(logit_scale=0.5, softcap=2.5, label_smoothing=0.1, ignore_index=3),
], ids=["plain", "smooth+z", "all"])
@pytest.mark.parametrize("per_row_weight", [False, True])
def test_kernel_matches_torch_rows(opts, per_row_weight):
    from flce.kernels import launch_rows
    C, V = 13, 37  # V not a multiple of the 16-wide vocabulary blocks used below
    logits = torch.randn(C, V, device=DEVICE) * 4
    target = torch.randint(0, V, (C,), device=DEVICE)
    target[::4] = opts.ignore_index
    weight = torch.rand(C, device=DEVICE) if per_row_weight else torch.tensor(0.3, device=DEVICE)
    triton_rows = lambda *a: launch_rows(*a, block_v=16)
    ref = _run(chunk_rows, logits, target, weight, opts)
    out = _run(triton_rows, logits, target, weight, opts)
    for o, r in zip((out[0], *out[1], out[2]), (ref[0], *ref[1], ref[2])):
        torch.testing.assert_close(o, r, rtol=2e-6, atol=2e-6)
    # the gradient-only pass with given statistics, as the one-block backward and the chunked
    # reduction "none" use
    out = _run(triton_rows, logits, target, weight, opts, stats_in=ref[1])
    torch.testing.assert_close(out[2], ref[2], rtol=2e-6, atol=2e-6)
    # ... which writes no loss, not even for ignored rows: callers pass a buffer they still need
    assert torch.isnan(out[0]).all() and torch.isnan(_run(chunk_rows, logits, target, weight, opts,
                                                          stats_in=ref[1])[0]).all()
    # loss only: logits left untouched
    out = _run(triton_rows, logits, target, weight, opts, compute_grad=False)
    assert torch.equal(out[2], logits)
    torch.testing.assert_close(out[0], ref[0], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("per_row_weight", [False, True])
def test_weight_scale_equals_the_premultiplied_weight(per_row_weight):
    """The one-block backward hands the kernel the upstream gradient and the loss weight apart
    (weight_scale: no launch for their product); the gradient must be bit-equal to the one with
    the product formed first, and scaled by it (not ignored)."""
    from flce.kernels import launch_rows
    C, V = 11, 37
    opts = LossOptions(label_smoothing=0.1)
    logits = torch.randn(C, V, device=DEVICE) * 3
    target = torch.randint(0, V, (C,), device=DEVICE)
    target[2] = opts.ignore_index
    grad = torch.rand(C, device=DEVICE) + 0.5 if per_row_weight else torch.tensor(1.7, device=DEVICE)
    scale = torch.tensor(1 / 9, device=DEVICE)
    rows = lambda *a, **k: launch_rows(*a, block_v=16, **k)
    stats = _run(rows, logits, target, grad, opts)[1]
    product = _run(rows, logits, target, grad * scale, opts, stats_in=stats)[2]
    folded = _run(lambda *a: rows(*a, weight_scale=scale), logits, target, grad, opts,
                  stats_in=stats)[2]
    unscaled = _run(rows, logits, target, grad, opts, stats_in=stats)[2]
    assert torch.equal(folded, product)
    assert not torch.allclose(folded, unscaled)


@pytest.mark.parametrize("float8", [False, True], ids=["bf16", "e4m3"])
def test_gradient_pass_order_changes_no_bit(float8):
    """With reverse_grad pass 2 walks the row from its last block back to its first (the loss's
    order where both passes run in one kernel without the e4m3 copy, `walks_back`); each
    element's gradient depends on the row statistics alone, so both orders give the same bits,
    the e4m3 copy included, and match the PyTorch rows."""
    from flce.kernels import launch_rows
    C, V = 7, 53  # four 16-wide blocks, the last a partial one
    opts = LossOptions(label_smoothing=0.1, softcap=4.0)
    logits = torch.randn(C, V, device=DEVICE) * 3
    target = torch.randint(0, V, (C,), device=DEVICE)
    target[3] = opts.ignore_index
    weight = torch.rand(C, device=DEVICE) + 0.5
    outs = []
    for reverse in (True, False):
        g8 = (torch.zeros(C, V, device=DEVICE, dtype=torch.float8_e4m3fn),
              torch.zeros(C, device=DEVICE), torch.zeros(C, device=DEVICE)) if float8 else None
        got = _run(lambda *a: launch_rows(*a, block_v=16, fp8_grad=g8, reverse_grad=reverse),
                   logits, target, weight, opts)
        outs.append((*got[:1], *got[1], got[2], *(g8 or ())))
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    ref = _run(chunk_rows, logits, target, weight, opts)
    torch.testing.assert_close(outs[0][3], ref[2], rtol=2e-6, atol=2e-6)


def test_out_of_range_target_is_nan_not_garbage():
    """Documented: on the Triton path a target outside [0, V) gives a NaN loss and gradient for
    its row (no host sync to check); the PyTorch path raises IndexError instead."""
    from flce.kernels import launch_rows
    logits = torch.randn(4, 10, device=DEVICE)
    target = torch.tensor([1, 10, -3, -100], device=DEVICE)
    loss, _, grad = _run(launch_rows, logits, target, torch.tensor(1.0, device=DEVICE),
                         LossOptions())
    assert torch.isfinite(loss[0]) and loss[3] == 0
    assert torch.isnan(loss[1]) and torch.isnan(loss[2])
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[0]).all()
    with pytest.raises(IndexError, match="target id 10 is outside"):
        _run(chunk_rows, logits.cpu(), target.cpu(), torch.tensor(1.0), LossOptions())


def test_gradient_pass_keeps_the_digits_of_large_logits():
    """Logits ~1e4: an fp32 lse is ~1e-3 off, and exp(z - lse) with it. A gradient pass after a
    statistics pass reads the row max and log sum exp(z - max) apart, so its dlogits equal the
    one-pass gradient's (which never formed lse) to fp32 rounding."""
    from flce.kernels import launch_rows
    C, V = 9, 40
    logits = torch.randn(C, V, device=DEVICE) * 3 + 1.0e4
    target = torch.randint(0, V, (C,), device=DEVICE)
    weight = torch.tensor(1.0, device=DEVICE)
    for fn in (chunk_rows, lambda *a: launch_rows(*a, block_v=16)):
        one_pass = _run(fn, logits, target, weight, LossOptions())
        split = _run(fn, logits, target, weight, LossOptions(), stats_in=one_pass[1])
        torch.testing.assert_close(split[2], one_pass[2], rtol=1e-6, atol=1e-7)


def test_in_place_scale_by_one_leaves_the_tensor_and_others_scale():
    """The backward's in-place multiply by the upstream gradient skips its memory traffic when
    that is exactly 1 (decided on the device); any other value scales, rounded once."""
    from flce.kernels import scale_cast
    t = torch.randn(5000, device=DEVICE).bfloat16()
    before = t.clone()
    scale_cast(t, t, torch.tensor(1.0, device=DEVICE))
    assert torch.equal(t, before)
    scale_cast(t, t, torch.tensor(-0.5, device=DEVICE))
    assert torch.equal(t, (before.float() * -0.5).bfloat16())
    out = torch.empty(5000, device=DEVICE)
    scale_cast(before, out, torch.tensor(1.0, device=DEVICE))  # a cast: always written
    assert torch.equal(out, before.float())


@pytest.mark.parametrize("n", [0, 1, 2047, 2048, 2049, 5000])
@pytest.mark.parametrize("divisor", ["count", "all_ignored", "number", "int_tensor",
                                     "float64_tensor", "shape_1_tensor", "bad_tensor"])
def test_weighted_sum_matches_the_pytorch_ops(n, divisor):
    """The one-block loss's reduction in one launch (sum of the token losses times 1 / the
    divisor, and that weight) against the PyTorch ops it replaced, across its 2048-wide blocks,
    for each kind of divisor; a normalizer that is not a finite positive number gives NaN."""
    from flce.dispatch import divisor_of, weight_of_sum
    from flce.kernels import weighted_sum
    g = torch.Generator().manual_seed(n)
    loss = (torch.rand(n, generator=g) * 5).to(DEVICE)
    target = torch.randint(0, 50, (n,), generator=g).to(DEVICE)
    target[torch.rand(n, generator=g) < 0.3] = -7
    normalizer = {"count": None, "all_ignored": None, "number": 123.5,
                  "int_tensor": torch.tensor(977), "float64_tensor": torch.tensor(31.25,
                  dtype=torch.float64), "shape_1_tensor": torch.tensor([8.0]),
                  "bad_tensor": torch.tensor(-2.0)}[divisor]
    if divisor == "all_ignored":
        target.fill_(-7)
    opts = LossOptions(ignore_index=-7)
    norm, inv = divisor_of(normalizer, opts)
    norm = None if norm is None else norm.to(DEVICE)
    out, w = torch.empty((), device=DEVICE), torch.empty((), device=DEVICE)
    weighted_sum(loss, target, norm, inv, -7, out, w)
    ref_w = weight_of_sum(target, norm, inv, -7, DEVICE, torch.float32)
    if divisor == "bad_tensor":
        assert torch.isnan(w) and torch.isnan(out)
        return
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=0)
    torch.testing.assert_close(out, (loss.double().sum() * ref_w.double()).float(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("opts", [LossOptions(), LossOptions(label_smoothing=0.2, z_loss=1e-3,
                                                             softcap=4.0, ignore_index=2)],
                         ids=["plain", "all"])
@pytest.mark.parametrize("float8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("block_v", [16, 64])
def test_padded_width_reads_its_padding_as_nothing_and_zeroes_it(opts, float8, block_v):
    """A row pass given the padded width of an odd vocabulary (`launch_rows(width=...)`, the
    vectorized accesses) reads columns V.. as absent, whatever they hold (NaN here), and a
    gradient pass writes 0 there, in dlogits and in the e4m3 copy; everything else is as at
    width V: both passes, the statistics pass alone, then the gradient pass reading its
    statistics."""
    from flce.kernels import launch_rows
    C, V, width = 9, 37, 48
    logits = torch.randn(C, V, device=DEVICE) * 3
    target = torch.randint(0, V, (C,), device=DEVICE)
    target[2] = opts.ignore_index
    target[5] = V - 1  # the last real column, next to the padding
    weight = torch.rand(C, device=DEVICE) + 0.5
    wide = torch.full((C, width), float("nan"), device=DEVICE)
    wide[:, :V] = logits

    def g8_of(cols):
        return ((torch.full((C, cols), 7.0, device=DEVICE).to(torch.float8_e4m3fn),
                 torch.zeros(C, device=DEVICE), torch.zeros(C, device=DEVICE))
                if float8 else None)

    # (a float8 gradient pass after a statistics pass also needs the maxima off the target:
    # the one-block path's, tested through the loss in test_flce_float8)
    for stats_from in (None,) if float8 else (None, "stats pass"):
        narrow_g8, wide_g8 = g8_of(V), g8_of(width)
        stats_in = None
        if stats_from:
            stats_in = _run(lambda *a: launch_rows(*a, block_v=block_v), logits, target, weight,
                            opts, compute_grad=False)[1]
            padded_stats = _run(lambda *a: launch_rows(*a, block_v=block_v, width=width),
                                wide[:, :V], target, weight, opts, compute_grad=False,
                                in_place=True)[1]
            assert torch.isnan(wide[:, V:]).all()  # a statistics pass only reads
            for a, b in zip(padded_stats, stats_in):
                torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
        ref = _run(lambda *a: launch_rows(*a, block_v=block_v, fp8_grad=narrow_g8), logits,
                   target, weight, opts, stats_in=stats_in)
        rows = wide.clone()
        got = _run(lambda *a: launch_rows(*a, block_v=block_v, fp8_grad=wide_g8, width=width),
                   rows[:, :V], target, weight, opts, stats_in=stats_in, in_place=True)
        # compiled for the GPU, the two widths may sum a block's lanes in other orders
        close = lambda a, b: torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
        if stats_in is None:  # a gradient pass writes no loss
            close(got[0], ref[0])
        for a, b in zip((*got[1], got[2]), (*ref[1], ref[2])):
            close(a, b)
        assert torch.equal(rows[:, V:], torch.zeros(C, width - V, device=DEVICE))
        if float8:
            # e4m3 keeps 3 bits: a last-bit change of the statistics may move a value one step
            torch.testing.assert_close(wide_g8[0][:, :V].float(), narrow_g8[0].float(),
                                       rtol=0.13, atol=2.0 ** -9)
            assert not wide_g8[0][:, V:].view(torch.uint8).any()
            for a, b in zip(wide_g8[1:], narrow_g8[1:]):
                close(a, b)


def test_a_width_outside_the_rows_is_a_clear_error():
    from flce.kernels import launch_rows
    buf = torch.randn(4, 48, device=DEVICE)
    t = torch.zeros(4, dtype=torch.long, device=DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    for width in (36, 49):
        with pytest.raises(ValueError, match=f"width={width}"):
            launch_rows(buf[:, :37], t, torch.empty(4, device=DEVICE), None, one, LossOptions(),
                        False, False, width=width)
    with pytest.raises(ValueError, match="width=48"):  # one row, no wider buffer behind it
        launch_rows(torch.randn(1, 37, device=DEVICE), t[:1], torch.empty(1, device=DEVICE), None,
                    one, LossOptions(), False, False, width=48)
    launch_rows(buf[:1, :37], t[:1], torch.empty(1, device=DEVICE), None, one, LossOptions(),
                False, False, width=48)  # one row of the wider buffer: allowed
