"""Loss and gradients of the fused loss against float64, for every option and odd shapes."""

import pytest
import torch

import flce
from flce_cases import (IMPL_DEVICES, OPTIONS, float64_reference, impl_devices, loss_and_grads,
                        make_inputs, rel_err, skip_if_interpreted_bf16)

REDUCTIONS = ["mean", "sum", "none"]
# The two sweeps of flce/ops.py: one block of all tokens (no chunk size: the tests' token counts
# are far below a chunk), and chunks of 16 tokens.
PATHS = pytest.mark.parametrize("chunk", [None, 16], ids=["one_block", "chunked"])
# (N, H, V, chunk_size): N not a multiple of the chunk, N = 1, V = 3, V not a power of two, V < H
SHAPES = [(67, 24, 101, 16), (1, 8, 3, None), (40, 64, 5, 7), (33, 16, 257, None)]


def _check(impl, device, dtype, N, H, V, chunk, bias, tol=1e-5, memory_lean=False, **kw):
    x, t, w, b = make_inputs(N, H, V, device, dtype, bias=bias)
    if "ignore_index" in kw:
        t[t == -100] = kw["ignore_index"]
    ref_loss, ref_grads = None, None
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b,
                                     chunk_size=chunk, impl=impl, memory_lean=memory_lean, **kw)
    ref_loss, ref_grads = float64_reference(x, t, w, b, up, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert torch.isfinite(loss).all()
    assert rel_err(loss, ref_loss) <= tol, kw
    for name, g, r in zip("x W b".split(), grads, ref_grads):
        assert g.dtype == dtype
        assert rel_err(g, r) <= tol, (name, rel_err(g, r), kw)


@IMPL_DEVICES
@PATHS
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_options_fp32(impl, device, chunk, options, reduction):
    _check(impl, device, torch.float32, 67, 24, 101, chunk, bias=True, reduction=reduction,
           **options)


@IMPL_DEVICES
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_label_smoothing_one_in_memory_lean_chunks(impl, device, reduction):
    """label_smoothing = 1 (OPTIONS: the one-block and chunked paths, and memory_lean's
    vocabulary sweep in test_flce_vocab_sweep.py) in memory_lean's token chunks, which it takes
    at this small W."""
    for kw in ({"bias": True}, {"bias": False, "z_loss": 1e-3, "softcap": 3.0, "ignore_index": 5}):
        _check(impl, device, torch.float32, 67, 24, 101, None, reduction=reduction,
               memory_lean=True, label_smoothing=1.0, **kw)


@IMPL_DEVICES
@pytest.mark.parametrize("N,H,V,chunk", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_odd_shapes_fp32(impl, device, N, H, V, chunk, bias):
    _check(impl, device, torch.float32, N, H, V, chunk, bias, reduction="mean", label_smoothing=0.1)
    _check(impl, device, torch.float32, N, H, V, chunk, bias, reduction="none", z_loss=1e-3)


@IMPL_DEVICES
def test_random_calls_match_float64(impl, device, rng):
    """Random combinations the parametrized tests do not cross: odd shapes down to one token
    and two classes, every option, reduction, normalizer (number or tensor), chunk size or one
    block, memory_lean, bias, 3-D input, all or no targets ignored, logits from tiny to large,
    a random upstream gradient. fp32 against float64, within a relative bound plus four times
    the plain fp32 loss's own error on the same inputs; the seed is printed when it fails. (V = 1,
    where every gradient is the z-loss's alone, left out: flce forms it as p·(1 + 2·zl·lse) - 1
    with p = 1, whose fp32 cancellation the plain loss, differentiating lse² directly, has not.)"""
    for _ in range(8 if (impl, device) == ("triton", "cpu") else 24):  # the interpreter is slow
        N, H, V = rng.choice([1, 2, 7, 33, 130]), rng.choice([1, 3, 17, 64]), \
            rng.choice([2, 5, 31, 257])
        options = {"ignore_index": rng.choice([-100, 0, 3]),
                   "label_smoothing": rng.choice([0.0, 0.0, 0.15]),
                   "logit_scale": rng.choice([1.0, 0.5, 3.0]), "z_loss": rng.choice([0.0, 1e-3]),
                   "softcap": rng.choice([None, None, 5.0]), "reduction": rng.choice(REDUCTIONS)}
        if options["reduction"] != "none" and rng.random() < 0.3:
            options["normalizer"] = rng.choice([7, 2.5, torch.tensor(11.0, device=device)])
        call = {"chunk_size": rng.choice([None, 1, 5, 64]), "memory_lean": rng.random() < 0.3,
                "impl": impl}
        three_d = rng.random() < 0.3
        x, t, w, b = make_inputs(N, H, V, device, torch.float32, bias=rng.random() < 0.5,
                                 ignore_frac=rng.choice([0.0, 0.2, 1.0]),
                                 scale=rng.choice([0.1, 1.0, 4.0]), seed=rng.randrange(1 << 30))
        t[t == -100] = options["ignore_index"]

        def fused(x, t, w, b, **kw):
            if three_d:
                return flce.fused_linear_cross_entropy(x[None], t[None], w, b, **kw).reshape(
                    (N,) if kw["reduction"] == "none" else ())
            return flce.fused_linear_cross_entropy(x, t, w, b, **kw)

        loss, grads, up = loss_and_grads(fused, x, t, w, b, **options, **call)
        on_cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
        ref_loss, ref_grads = float64_reference(x, t, w, b, up, **on_cpu)
        # the plain fp32 computation's own error on these inputs: where terms cancel (V = 1, a
        # large logit_scale) fp32 rounding alone moves the result by more than a relative bound
        plain_loss, plain_grads, _ = loss_and_grads(flce.linear_cross_entropy, x, t, w, b, up,
                                                    **options)
        case = {"N": N, "H": H, "V": V, "3d": three_d, **options, **call}
        for name, a, plain, ref in [("loss", loss, plain_loss, ref_loss),
                                    *zip(("x", "W", "b"), grads, plain_grads, ref_grads)]:
            a, plain, ref = (v.detach().cpu().double() for v in (a, plain, ref))
            bound = 1e-5 * ref.norm() + 4 * (plain - ref).norm() + 1e-9
            error = (a - ref).norm()
            assert error <= bound, f"{name}: {error:.3g} > {bound:.3g} at {case}"


@IMPL_DEVICES
@pytest.mark.parametrize("chunk", [None, 64], ids=["one_block", "chunked"])
@pytest.mark.parametrize("options", [{}, OPTIONS[-1]], ids=["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_no_worse_than_unfused(impl, device, chunk, options, reduction):
    """bf16: error against float64 within the unfused bf16 path's own error on the same inputs.

    Single draws scatter widely around each other (where the rounded dlogits fall on the bf16
    grid): the chunked path with every option is 1.045x the unfused error over 24 draws on the
    CPU (0.98x over 8 on an H200), and means of 3 draws ranged 1.00-1.13 (limits 1.1 and 1.35
    failed now and then). Averaged over 8 fresh draws, with room for their spread; truncating
    instead of rounding to nearest doubles the error."""
    skip_if_interpreted_bf16(impl, device)
    kw = dict(reduction=reduction, **options)
    ratios = []
    for _ in range(8):
        x, t, w, b = make_inputs(256, 64, 300, device, torch.bfloat16)
        if "ignore_index" in kw:
            t[t == -100] = kw["ignore_index"]
        loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b,
                                         chunk_size=chunk, impl=impl, **kw)
        base_loss, base_grads, _ = loss_and_grads(flce.linear_cross_entropy, x, t, w, b, up, **kw)
        ref_loss, ref_grads = float64_reference(x, t, w, b, up, **kw)
        assert rel_err(loss, ref_loss) <= 1.05 * rel_err(base_loss, ref_loss) + 1e-6
        ratios.append([rel_err(g, r) / rel_err(gb, r)
                       for g, gb, r in zip(grads, base_grads, ref_grads)])
    ratios = torch.tensor(ratios)
    assert ratios.mean() <= 1.15 and ratios.max() <= 1.5, ratios


@IMPL_DEVICES
def test_dw_accumulates_in_fp32(impl, device):
    """Pitfall 1: dW summed over many token chunks; bf16 accumulation visibly loses precision."""
    skip_if_interpreted_bf16(impl, device)
    x, t, w, b = make_inputs(2048, 32, 64, device, torch.bfloat16, ignore_frac=0.0, seed=3)
    up = torch.tensor(1.0, dtype=torch.float64)
    errs = {}
    for lean in (False, True):
        _, (dx, dw, db), _ = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, up,
                                            chunk_size=16, impl=impl, memory_lean=lean)
        _, (rdx, rdw, rdb) = float64_reference(x, t, w, b, up)
        errs[lean] = rel_err(dw, rdw)
    _, (_, base_dw, _), _ = loss_and_grads(flce.linear_cross_entropy, x, t, w, b, up)
    assert errs[False] <= 1.1 * rel_err(base_dw, rdw) + 1e-4
    assert errs[False] * 3 < errs[True], errs


@IMPL_DEVICES
@PATHS
def test_odd_vocabulary_runs_the_gemms_at_an_aligned_width(impl, device, chunk):
    """A vocabulary whose rows are not whole 16-byte words (GPT-2's 50257) made cuBLAS run each
    GEMM about 5x slower: W gets zero rows up to a multiple of 16 (`ops.gemm_vocab`), the logits
    and dW that width, and the padding changes nothing: loss and gradients as float64's, dW of
    V rows."""
    from flce.ops import gemm_vocab
    assert [gemm_vocab(v, 2) for v in (50257, 50264, 32000, 100277)] == [50272, 50264, 32000,
                                                                          100288]
    assert [gemm_vocab(v, 4) for v in (37, 36, 0)] == [48, 36, 0]
    x, t, w, b = make_inputs(45, 16, 37, device, torch.float32)
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl=impl,
                                     chunk_size=chunk)
    ref_loss, ref = float64_reference(x, t, w, b, up)
    assert grads[1].shape == w.shape and grads[1].is_contiguous()
    assert rel_err(loss, ref_loss) <= 1e-6
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref)), [
        rel_err(g, r) for g, r in zip(grads, ref)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_operands_append_zero_rows(dtype):
    """W and the bias with exact zero rows up to the GEMM width, whatever the new memory held;
    W itself where no padding is needed."""
    from flce.ops import gemm_operands
    for _ in range(3):  # fresh allocations, which may reuse freed, non-zero memory
        w, b = torch.randn(37, 5, dtype=dtype) * 3, torch.randn(37, dtype=dtype)
        wp, bp = gemm_operands(w, b)
        assert wp.shape == (48, 5) and bp.shape == (48,) and wp.is_contiguous()
        assert torch.equal(wp[:37], w) and torch.equal(bp[:37], b)
        assert not wp[37:].any() and not bp[37:].any()
        del wp, bp
    w = torch.randn(48, 5, dtype=dtype)
    assert gemm_operands(w, None)[0] is w


@pytest.mark.parametrize("device", [d for i, d in impl_devices() if i == "triton"])
@pytest.mark.parametrize("path", ["one_block", "chunked", "lean", "lean_sweep"])
def test_odd_vocabulary_row_passes_take_the_aligned_width(monkeypatch, device, path):
    """The row passes were told only V: at an odd vocabulary their masked accesses could not be
    vectorized, and the row pass ran 3-5x slower than at V = 32000 on an H200 (V = 32001 and
    50257). Every pass of every path now gets the buffer's width (a multiple of 16 above V),
    and the result stays float64's (`test_odd_vocabulary_runs_the_gemms_at_an_aligned_width`).
    memory_lean's token chunks at H = 64 (one chunk of 48 tokens); at H = 16 its chunks would
    be 16 tokens, so it sweeps the vocabulary in slices of 16 columns, the last one 5 wide."""
    import flce.kernels
    import flce.vocab_sweep
    seen, launch = [], flce.kernels.launch_rows

    def spy(logits, *args, **kwargs):
        seen.append((logits.shape[1], kwargs.get("width")))
        return launch(logits, *args, **kwargs)

    monkeypatch.setattr(flce.kernels, "launch_rows", spy)
    monkeypatch.setattr(flce.vocab_sweep, "SWEEP_MIN_WEIGHT", 0)  # the sweep at this small W
    x, t, w, b = make_inputs(45, 64 if path == "lean" else 16, 37, device, torch.float32)
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl="triton",
                                     chunk_size=16 if path == "chunked" else None,
                                     memory_lean=path.startswith("lean"))
    assert seen and set(seen) == ({(16, 16), (5, 16)} if path == "lean_sweep" else {(37, 48)}), seen
    ref_loss, ref = float64_reference(x, t, w, b, up)
    assert rel_err(loss, ref_loss) <= 1e-6
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref))


@IMPL_DEVICES
@pytest.mark.parametrize("lean", [False, True], ids=["one_block", "lean"])
@pytest.mark.parametrize("options", [{}, OPTIONS[-1]], ids=["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_few_long_rows(impl, device, lean, options, reduction):
    """Few rows of more than 40960 classes take the row kernel's wide blocks (32768 columns for
    both passes in one, 16384 for each alone: `kernels._block_and_warps`), whose last block is
    mostly masked here: loss and gradients as float64's through the one-block path (a
    statistics pass, then a gradient pass) and the memory-lean chunks (both in one)."""
    from flce.kernels import _block_and_warps
    N, V = 9, 45007
    assert [_block_and_warps(N, V, None, None, k)[0] for k in ("stats", "grad", "full")] == [
        16384, 16384, 32768]
    _check(impl, device, torch.float32, N, 8, V, None, True, memory_lean=lean,
           reduction=reduction, **options)


@pytest.mark.parametrize("C, V, full", [(9, 45007, 32768), (255, 128256, 32768),
                                         (256, 128256, 16384), (2048, 256000, 16384),
                                         (2049, 128256, 4096), (2048, 32000, 8192)])
def test_row_blocks_of_both_passes_by_chunk_height(C, V, full):
    """Both passes in one (memory_lean's chunks) take 32768-column blocks below 256 rows of
    V > 40960, 16384 from 256 to 2048 rows, and the many-rows rule above or where V <= 40960
    (the kernel's code is the same at every block width: test_flce_kernels runs it at 16)."""
    from flce.kernels import _block_and_warps
    assert _block_and_warps(C, V, None, None, "full")[0] == full


@IMPL_DEVICES
@PATHS
def test_confident_target_gradient(impl, device, chunk):
    """Pitfall 2: p_y close to 1, where p_y - 1 must come from fp32 lse, not a rounded p_y."""
    x, t, w, b = make_inputs(48, 16, 40, device, torch.float32, bias=False, ignore_frac=0.0)
    with torch.no_grad():  # make the target logit dominate: p_y ~ 1 - 1e-6
        w[t.clamp(min=0)] += x * 3.0 / x.norm(dim=1, keepdim=True) ** 2 * 5
    for kw in ({}, {"label_smoothing": 0.05}):
        _, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, None, impl=impl,
                                      chunk_size=chunk, **kw)
        _, ref = float64_reference(x, t, w, None, up, **kw)
        assert all(rel_err(g, r) <= 1e-4 for g, r in zip(grads, ref))


@IMPL_DEVICES
@PATHS
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero(impl, device, chunk, reduction):
    x, t, w, b = make_inputs(20, 8, 30, device, torch.float32)
    t.fill_(-100)
    loss, grads, _ = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, chunk_size=chunk,
                                    impl=impl, reduction=reduction, z_loss=1e-3)
    assert torch.equal(loss.detach().cpu(), torch.zeros_like(loss).cpu())
    assert all(torch.equal(g.cpu(), torch.zeros_like(g).cpu()) for g in grads)


@IMPL_DEVICES
@PATHS
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_strided_target(impl, device, chunk, reduction):
    """A target that is a strided view (a column of [N, 3]; LinearLossParallel's sequence slice
    of one token per row): the Triton kernels read it as contiguous and took other rows' ids."""
    x, t, w, b = make_inputs(20, 8, 30, device, torch.float32)
    t = torch.stack([t.flip(0), t, t.roll(1)], dim=1)[:, 1]
    assert not t.is_contiguous()
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl=impl,
                                     chunk_size=chunk, reduction=reduction)
    ref_loss, ref_grads = float64_reference(x, t, w, b, up, reduction=reduction)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref_grads))


@IMPL_DEVICES
@PATHS
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_tokens(impl, device, chunk, reduction):
    """N = 0 (a tensor-parallel rank whose sequence shard is empty): loss 0 (or empty), zero dW
    and db, empty dx."""
    x, t, w, b = make_inputs(0, 8, 30, device, torch.float32)
    loss, grads, _ = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl=impl,
                                    chunk_size=chunk, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert torch.equal(loss.detach().cpu(), torch.zeros_like(loss).cpu())
    assert grads[0].shape == (0, 8)
    assert all(torch.equal(g.cpu(), torch.zeros_like(g).cpu()) for g in grads[1:])


def _logit_rounding_sensitivity(x, t, w, b, upstream, draws: int = 4) -> float:
    """The largest relative change of the float64 gradients (mean loss) when every logit moves
    by a standard normal times its fp32 rounding scale, u * (sum_k |x_ik w_jk| + |b_j|): how far
    this draw's gradients are from any fp32 computation of its logits, whatever the order."""
    xd, wd, bd = (a.detach().cpu().double().requires_grad_() for a in (x, w, b))
    scale = (xd.detach().abs() @ wd.detach().abs().T + bd.detach().abs()) * 2.0 ** -24
    generator = torch.Generator().manual_seed(0)

    def grads(noise):
        z = xd @ wd.T + bd + noise
        loss = torch.nn.functional.cross_entropy(z, t.cpu(), ignore_index=-100)
        return torch.autograd.grad(loss, (xd, wd, bd), upstream.to(torch.float64))

    exact = grads(torch.zeros_like(scale))
    return max(rel_err(moved, e) for _ in range(draws) for moved, e in zip(
        grads(scale * torch.randn(scale.shape, generator=generator, dtype=torch.float64)), exact))


@IMPL_DEVICES
@PATHS
def test_large_logits(impl, device, chunk):
    """Logits around 1e4: lse needs the running max subtracted. One fp32 ulp of such a logit
    is ~1e-3, so near-ties make the softmax of any fp32 implementation off by up to ~1e-4 in a
    way that depends on summation order: the gradients are held to a few times the draw's own
    sensitivity to its logits' rounding (on the CPU the loss's error stayed within 0.69x of that
    bound over 6000 draws). Against the unfused loss's error instead (5x it + 1e-5), a draw on an
    H100 failed: 1.8e-5 for the unfused 8.5e-7, their cuBLAS GEMMs summing in other orders.
    Most rows of these draws are saturated, where an lse of ~1e4 in one fp32 number is exact:
    test_exact_large_logits_keep_their_digits holds that defect."""
    x, t, w, b = make_inputs(30, 16, 50, device, torch.float32, scale=3000.0)
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl=impl,
                                     chunk_size=chunk)
    ref_loss, ref = float64_reference(x, t, w, b, up)
    assert torch.isfinite(loss) and rel_err(loss, ref_loss) <= 1e-5
    bound = 4 * _logit_rounding_sensitivity(x, t, w, b, up) + 1e-6
    for g, r in zip(grads, ref):
        assert torch.isfinite(g).all() and rel_err(g, r) <= bound


@IMPL_DEVICES
@PATHS
def test_exact_large_logits_keep_their_digits(impl, device, chunk):
    """Logits of 1e4 + O(1) that fp32 (and TF32) hold exactly: integer x, W in 32nds, the bias
    1e4 + eighths. An lse of them in one fp32 number is up to half an ulp of 1e4 (4.9e-4) off, and
    every softmax probability with it; kept apart as max and log-sum (z - max exact), the loss and
    gradients carry only exp's and log's rounding (~1e-7)."""
    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    N, H, V = 30, 16, 50
    x = torch.randint(-4, 5, (N, H), generator=g).double()
    w = torch.randint(-8, 9, (V, H), generator=g).double() / 8 / 4
    b = 1e4 + torch.randint(-16, 17, (V,), generator=g).double() / 8
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.2] = -100
    x, w, b = (a.to(device=device, dtype=torch.float32).requires_grad_() for a in (x, w, b))
    t = t.to(device)
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl=impl,
                                     chunk_size=chunk)
    ref_loss, ref = float64_reference(x, t, w, b, up)
    # on the CPU over 300 draws: loss 1.9e-7, gradients 2.0e-7; with that lse: 1.1e-5 and more
    assert rel_err(loss, ref_loss) <= 2e-6
    assert all(rel_err(gr, r) <= 1e-5 for gr, r in zip(grads, ref))


@IMPL_DEVICES
def test_chunk_size_independence(impl, device):
    x, t, w, b = make_inputs(50, 16, 70, device, torch.float32)
    up = torch.tensor(0.7, dtype=torch.float64)
    results = [loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, up, chunk_size=c,
                              impl=impl, label_smoothing=0.1) for c in (1, 7, 16, 50, 4096)]
    loss0, grads0, _ = results[0]
    for loss, grads, _ in results[1:]:
        assert rel_err(loss, loss0) <= 1e-6
        assert all(rel_err(g, g0) <= 1e-6 for g, g0 in zip(grads, grads0))


@IMPL_DEVICES
@PATHS
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradient_accumulation_and_upstream_scale(impl, device, chunk, reduction):
    """Two forward/backward calls into .grad with upstream gradients != 1, as the unfused loss."""
    x, t, w, b = make_inputs(40, 16, 30, device, torch.float32)
    refs = [a.detach().cpu().double().requires_grad_() for a in (x, w, b)]
    for scale in (0.37, -2.5):
        for fn, (xi, wi, bi), tt in ((flce.fused_linear_cross_entropy, (x, w, b), t),
                                     (flce.linear_cross_entropy, refs, t.cpu())):
            kw = {"impl": impl, "chunk_size": chunk} if fn is flce.fused_linear_cross_entropy else {}
            loss = fn(xi, tt, wi, bi, reduction=reduction, label_smoothing=0.1, **kw)
            (loss.sum() * scale).backward()
    for a, r in zip((x, w, b), refs):
        assert rel_err(a.grad, r.grad) <= 1e-5


@IMPL_DEVICES
def test_normalizer_gives_global_mean_across_micro_batches(impl, device):
    """sum / global count over two micro-batches equals the mean over the whole batch."""
    x, t, w, b = make_inputs(60, 16, 30, device, torch.float32)
    count = (t != -100).sum()
    total = sum(flce.fused_linear_cross_entropy(x[i:i + 30], t[i:i + 30], w, b, normalizer=count,
                                                impl=impl) for i in (0, 30))
    total.backward()
    refs = [a.detach().cpu().double().requires_grad_() for a in (x, w, b)]
    ref = flce.linear_cross_entropy(refs[0], t.cpu(), refs[1], refs[2])
    ref.backward()
    assert rel_err(total, ref) <= 1e-6
    assert all(rel_err(a.grad, r.grad) <= 1e-5 for a, r in zip((x, w, b), refs))
    as_number = flce.fused_linear_cross_entropy(x, t, w, b, normalizer=float(count), impl=impl)
    assert rel_err(as_number, ref) <= 1e-6


@IMPL_DEVICES
@PATHS
def test_module_3d_input_and_partial_grads(impl, device, chunk):
    x, t, w, b = make_inputs(24, 16, 30, device, torch.float32)
    loss_fn = flce.FusedLinearCrossEntropyLoss(label_smoothing=0.1, impl=impl, chunk_size=chunk)
    x3, t3 = x.detach().reshape(4, 6, 16).requires_grad_(), t.reshape(4, 6)
    w.requires_grad_(False)  # a frozen head: only dx and db are formed
    loss = loss_fn(x3, t3, w, b)
    loss.backward()
    ref = flce.linear_cross_entropy(x3.detach().double().cpu().requires_grad_(), t3.cpu(),
                                    w.double().cpu(), b.detach().double().cpu(), label_smoothing=0.1)
    assert rel_err(loss, ref) <= 1e-6 and x3.grad.shape == (4, 6, 16) and w.grad is None
    with torch.no_grad():
        assert rel_err(loss_fn(x3, t3, w, b), ref) <= 1e-6


@IMPL_DEVICES
@PATHS
def test_deterministic(impl, device, chunk):
    x, t, w, b = make_inputs(64, 32, 100, device, torch.float32)
    up = torch.tensor(1.0, dtype=torch.float64)
    runs = [loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, up, impl=impl,
                           chunk_size=chunk) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(g0, g1) for g0, g1 in zip(runs[0][1], runs[1][1]))


@IMPL_DEVICES
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_memory_lean_fp32(impl, device, reduction):
    """The lean mode changes precision only through the parameter dtype: exact in fp32."""
    _check(impl, device, torch.float32, 67, 24, 101, None, bias=True, reduction=reduction,
           label_smoothing=0.1, memory_lean=True)


def test_chunk_sizes():
    from flce.ops import pick_chunk_size
    assert pick_chunk_size(65536, 4096, 128256, 2, None, lean=False) == 8192
    assert pick_chunk_size(65536, 1024, 32000, 2, None, lean=False) == 16384  # ~1 GiB of logits
    assert pick_chunk_size(65536, 2048, 256000, 2, None, lean=False) == 8192  # ~4 GiB of logits
    assert pick_chunk_size(65536, 2048, 524288, 2, None, lean=False) == 4096  # 4 GiB at most
    assert pick_chunk_size(100, 64, 1000, 4, None, lean=False) == 104  # one chunk, 8-aligned
    assert pick_chunk_size(10000, 64, 1000, 4, 4096, lean=False) == 3336  # three even chunks
    # lean: Liger-Kernel's size, next_pow2(N / ceil(V / H))
    assert pick_chunk_size(8192, 2048, 128256, 2, None, lean=True) == 256
    assert pick_chunk_size(32768, 2048, 128256, 2, None, lean=True) == 1024


def test_one_block_where_it_takes_no_more_memory_than_chunks():
    from flce.ops import uses_one_block
    # bf16 at V = 128256: one block up to about a chunk (8192) + 2 H tokens
    assert uses_one_block(8192, 4096, 128256, 2, None, lean=False)
    assert uses_one_block(16384, 4096, 128256, 2, None, lean=False)
    assert not uses_one_block(16384, 2048, 128256, 2, None, lean=False)
    assert not uses_one_block(65536, 8192, 128256, 2, None, lean=False)
    # fp32: no fp32 accumulator to save, one block only where one chunk would hold every token
    # (8192 tokens at V = 128256: 4 GiB of fp32 logits)
    assert not uses_one_block(16384, 4096, 128256, 4, None, lean=False)
    assert uses_one_block(8192, 4096, 128256, 4, None, lean=False)
    # a chunk_size below N asks for chunks; memory_lean always chunks
    assert not uses_one_block(100, 64, 1000, 2, 64, lean=False)
    assert uses_one_block(100, 64, 1000, 2, 100, lean=False)
    assert not uses_one_block(100, 64, 1000, 2, None, lean=True)


@IMPL_DEVICES
@pytest.mark.parametrize("N,chunk", [(67, None), (24, None), (67, 40)],
                         ids=["one_block", "one_block_even", "chunked"])
def test_dx_in_row_blocks(impl, device, monkeypatch, N, chunk):
    """dx = dlogits @ W runs in even row blocks of at most DX_BLOCK_TOKENS rows (one 16384-row
    GEMM ran up to 1.35x two of 8192 on an H100), in one block of all tokens and in each chunk:
    every row once, as float64 has it, including an uneven last block."""
    import flce.ops
    mm, shapes = torch.mm, []
    monkeypatch.setattr(flce.ops, "DX_BLOCK_TOKENS", 16)
    monkeypatch.setattr(flce.ops.torch, "mm", lambda a, b, **kw: shapes.append(a.shape) or
                        mm(a, b, **kw))
    _check(impl, device, torch.float32, N, 24, 101, chunk, True, reduction="mean",
           label_smoothing=0.1)
    _check(impl, device, torch.float32, N, 24, 101, chunk, True, reduction="none", z_loss=1e-3)
    heights = [N] if chunk is None else [chunk, N - chunk]
    expected = sorted(b - a for h in heights for a, b in flce.ops.dx_row_blocks(h))
    assert max(expected) <= 16 and sum(expected) == N
    dx_gemms = sorted(r[0] for r in shapes if r[1] >= 101)  # dlogits blocks: [rows, V]
    assert dx_gemms == sorted(expected * 2), shapes  # once a call: "mean", then "none"


def test_chunked_torch_loss_matches_unfused():
    x, t, w, b = make_inputs(50, 16, 40, "cpu", torch.float64)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    ref = flce.linear_cross_entropy(x, t, w, b, **kw)
    ref_grads = torch.autograd.grad(ref, (x, w, b))
    out = flce.chunked_linear_cross_entropy(x, t, w, b, chunk_size=16, **kw)
    grads = torch.autograd.grad(out, (x, w, b))
    assert rel_err(out, ref) <= 1e-12 and all(rel_err(g, r) <= 1e-12 for g, r in zip(grads, ref_grads))


@IMPL_DEVICES
def test_one_block_second_backward_is_an_error(impl, device):
    """The one-block path overwrites its kept logits with dlogits in backward: a second
    backward over the same graph (retain_graph=True) must fail loudly, not read dlogits as
    logits."""
    x, t, w, b = make_inputs(20, 8, 30, device, torch.float32)
    loss = flce.fused_linear_cross_entropy(x, t, w, b, impl=impl)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@IMPL_DEVICES
def test_one_block_frees_its_row_statistics_before_the_gemms(impl, device, monkeypatch):
    """The backward's peak is its dx and dW GEMMs: the row maxima, the log-sums and the loss
    weight, read only by the row pass before them, hold no memory there (eager mode)."""
    import flce.custom_ops
    import flce.function
    kept = []
    stats, weighted = flce.custom_ops.block_stats, flce.function.weighted_sum
    monkeypatch.setattr(flce.custom_ops, "block_stats", lambda *a: _keep(stats(*a), kept, 1, 2))
    monkeypatch.setattr(flce.function, "weighted_sum", lambda *a: _keep(weighted(*a), kept, 1))
    held_at_gemms = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: held_at_gemms.append(
        [t.untyped_storage().nbytes() for t in kept]) or mm(*a, **k))
    x, t, w, b = make_inputs(20, 8, 30, device, torch.float32)  # with a bias: logits by addmm
    loss, grads, up = loss_and_grads(flce.fused_linear_cross_entropy, x, t, w, b, impl=impl)
    ref_loss, ref_grads = float64_reference(x, t, w, b, up)
    assert [t.shape for t in kept] == [(20,), (20,), ()]
    assert held_at_gemms == [[0, 0, 0]] * 2  # at dx's GEMM and at dW's
    assert rel_err(loss, ref_loss) <= 1e-5
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref_grads))


def _keep(outputs: tuple, kept: list, *which: int) -> tuple:
    kept.extend(outputs[i] for i in which)
    return outputs


def test_float8_runs_only_where_it_pays(monkeypatch):
    """Below FLOAT8_MIN_TOKENS tokens or FLOAT8_MIN_WORK the bf16 GEMMs run (faster there, and
    exact): the loss then equals the bf16 loss bit for bit; above, float8 rounds visibly."""
    import flce.ops
    assert flce.ops.float8_used("logits+dx", 512, 8192, 128256) == "none"
    assert flce.ops.float8_used("logits+dx", 2048, 1024, 32000) == "none"
    assert flce.ops.float8_used("logits+dx", 2048, 1024, 128256) == "none"
    assert flce.ops.float8_used("logits+dx", 1024, 4096, 128256) == "logits+dx"
    assert flce.ops.float8_used("logits", 2048, 2048, 128256) == "logits"
    x, t, w, b = make_inputs(40, 32, 64, "cpu", torch.float32)
    bf16 = flce.fused_linear_cross_entropy(x, t, w, b, impl="torch")
    small = flce.fused_linear_cross_entropy(x, t, w, b, impl="torch", float8="logits+dx")
    assert torch.equal(small, bf16)
    monkeypatch.setattr(flce.ops, "FLOAT8_MIN_TOKENS", 16)
    monkeypatch.setattr(flce.ops, "FLOAT8_MIN_WORK", 0)
    forced = flce.fused_linear_cross_entropy(x, t, w, b, impl="torch", float8="logits+dx")
    assert not torch.equal(forced, bf16) and rel_err(forced, bf16) < 0.05
