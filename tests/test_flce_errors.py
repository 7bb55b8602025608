"""Bad input gets an error that names the problem."""

from functools import partial

import pytest
import torch

import flce
from flce_cases import IMPL_DEVICES


def _inputs(N=6, H=4, V=9):
    return (torch.randn(N, H, requires_grad=True), torch.randint(0, V, (N,)),
            torch.randn(V, H, requires_grad=True), torch.randn(V))


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(x=torch.randn(6, 5)), ValueError, "weight must be"),
    (lambda a: a.update(x=torch.randn(6)), ValueError, "x must be"),
    (lambda a: a.update(target=torch.randint(0, 9, (5,))), ValueError, "target shape"),
    (lambda a: a.update(target=torch.rand(6)), TypeError, "integer class ids"),
    (lambda a: a.update(bias=torch.randn(8)), ValueError, "bias must be"),
    (lambda a: a.update(weight=torch.randn(9, 4, dtype=torch.float64)), TypeError, "weight dtype"),
    (lambda a: a.update(target=torch.randint(0, 9, (6,), device="meta")), ValueError, "one device"),
    (lambda a: a.update(reduction="avg"), ValueError, "reduction='avg'"),
    (lambda a: a.update(label_smoothing=1.01), ValueError,
     r"label_smoothing=1.01: must be in \[0, 1\]"),
    (lambda a: a.update(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (lambda a: a.update(softcap=0.0), ValueError, "softcap"),
    (lambda a: a.update(z_loss=-1.0), ValueError, "z_loss"),
    (lambda a: a.update(impl="cuda"), ValueError, "impl='cuda'"),
    (lambda a: a.update(float8="fp8"), ValueError, "float8='fp8': expected one of"),
    (lambda a: a.update(chunk_size=0), ValueError, "chunk_size"),
    (lambda a: a.update(chunk_size=True), ValueError, "chunk_size=True"),
    (lambda a: a.update(ignore_index=2**70), ValueError, "ignore_index=.*must fit in int64"),
    (lambda a: a.update(normalizer=torch.tensor(4.0, requires_grad=True)), ValueError,
     "normalizer requires grad"),
    (lambda a: a.update(normalizer=torch.ones(2)), ValueError, "normalizer must be a scalar"),
    (lambda a: a.update(normalizer=0), ValueError, "normalizer=0"),
    (lambda a: a.update(normalizer=float("inf")), ValueError, "normalizer=inf: must be a finite"),
    (lambda a: a.update(normalizer="8"), TypeError, "normalizer='8': must be a number"),
    (lambda a: a.update(reduction="none", normalizer=3), ValueError, "normalizer applies"),
    (lambda a: a.update(memory_lean="yes"), TypeError, "memory_lean"),
    (lambda a: a.update(weight=torch.randn(0, 4), bias=None), ValueError, "no rows"),
])
def test_bad_input(change, error, match):
    x, target, weight, bias = _inputs()
    args = dict(x=x, target=target, weight=weight, bias=bias)
    change(args)
    kwargs = {k: args.pop(k) for k in list(args) if k not in ("x", "target", "weight", "bias")}
    with pytest.raises(error, match=match):
        flce.fused_linear_cross_entropy(args["x"], args["target"], args["weight"], args["bias"],
                                        **kwargs)


def test_module_checks_options_at_construction():
    """All of them: chunk_size=0 and memory_lean="yes" were taken at construction and failed
    only at the first step's forward."""
    for kwargs, error, match in [(dict(reduction="max"), ValueError, "reduction"),
                                 (dict(float8="e4m3"), ValueError, "float8='e4m3'"),
                                 (dict(chunk_size=0), ValueError, "chunk_size=0"),
                                 (dict(memory_lean="yes"), TypeError, "memory_lean='yes'"),
                                 (dict(impl="cuda"), ValueError, "impl='cuda'")]:
        with pytest.raises(error, match=match):
            flce.FusedLinearCrossEntropyLoss(**kwargs)


def test_out_of_range_target_on_cpu_raises():
    x, target, weight, bias = _inputs()
    target[2] = 9
    with pytest.raises(IndexError, match="target id 9 is outside \\[0, 9\\)"):
        flce.fused_linear_cross_entropy(x, target, weight, bias, impl="torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_triton_on_cpu_without_interpreter(monkeypatch):
    # triton imported first with the interpreter on, as conftest set it: imported while it is
    # off, it stays so, and the next test's kernels failed when this file ran alone
    import flce.kernels  # noqa: F401
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, target, weight, bias = _inputs()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        flce.fused_linear_cross_entropy(x, target, weight, bias, impl="triton")


@IMPL_DEVICES
@pytest.mark.parametrize("bad", [-5.0, 0.0, float("inf"), float("nan")])
def test_a_tensor_normalizer_that_is_not_a_positive_number_gives_nan(impl, device, bad):
    """A tensor normalizer is not read on the host (no sync): -5 gave a negative loss and inf a
    loss of 0; both, and 0 and NaN, now make the loss and gradients NaN."""
    x, target, weight, bias = (t.to(device).detach().requires_grad_(t.is_floating_point())
                               for t in _inputs())
    for chunk in (None, 2):
        loss = flce.fused_linear_cross_entropy(x, target, weight, bias, chunk_size=chunk,
                                               normalizer=torch.tensor(bad), impl=impl)
        loss.backward()
        assert torch.isnan(loss) and torch.isnan(x.grad).all() and torch.isnan(weight.grad).all()
        x.grad = weight.grad = None


@IMPL_DEVICES
@pytest.mark.parametrize("chunk", [None, 2])
def test_int32_targets_with_an_ignore_index_beyond_int32(impl, device, chunk):
    """int32 targets were compared with ignore_index in int32 on the PyTorch path, where torch
    wrapped 2**32 to 0: class 0's tokens lost their loss and gradient, silently."""
    x, target, weight, bias = (t.to(device) for t in _inputs(N=8))
    target[::2] = 0
    for ignore_index in (2**32, -2**31 - 1):
        ref = flce.fused_linear_cross_entropy(x, target, weight, bias, reduction="none",
                                              ignore_index=ignore_index, impl=impl)
        got = flce.fused_linear_cross_entropy(x, target.int(), weight, bias, reduction="none",
                                              ignore_index=ignore_index, chunk_size=chunk,
                                              impl=impl)
        assert (ref > 0).all()  # nothing ignored
        torch.testing.assert_close(got, ref)


@IMPL_DEVICES
@pytest.mark.parametrize("chunk,reduction", [(None, "mean"), (2, "mean"), (2, "none"),
                                             (None, "none")])
def test_double_backward_is_refused(impl, device, chunk, reduction):
    """create_graph=True: the chunked path handed back gradients without a graph, so a gradient
    penalty through the loss silently got nothing (the one-block path failed with autograd's
    misleading in-place error)."""
    x, target, weight, bias = (t.to(device).detach().requires_grad_(t.is_floating_point())
                               for t in _inputs())
    loss = flce.fused_linear_cross_entropy(x, target, weight, bias, chunk_size=chunk,
                                           reduction=reduction, impl=impl).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_integer_targets(dtype):
    """uint8/int8/int16 class ids failed with a bare gather error on the PyTorch path."""
    x, target, weight, bias = _inputs()
    ref = flce.fused_linear_cross_entropy(x, target, weight, bias)
    for chunk in (None, 2):
        got = flce.fused_linear_cross_entropy(x, target.to(dtype), weight, bias, chunk_size=chunk)
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
@pytest.mark.parametrize("baseline", ["unfused", "torch_chunked"])
def test_baselines_take_the_targets_the_fused_loss_takes(dtype, baseline):
    """The unfused baselines stopped at cross_entropy's "expected target dtype to be Long" for
    the narrow class ids the fused loss takes, so [loss] impl could not be switched alone."""
    x, target, weight, bias = _inputs()
    target[1] = 3  # the ignored id below
    kwargs = {"ignore_index": 3}
    ref = flce.fused_linear_cross_entropy(x, target, weight, bias, **kwargs)
    loss = (flce.linear_cross_entropy if baseline == "unfused" else
            partial(flce.chunked_linear_cross_entropy, chunk_size=2))
    torch.testing.assert_close(loss(x, target.to(dtype), weight, bias, **kwargs), ref)


def test_torch_chunked_loss_with_no_tokens():
    """A tensor-parallel rank with an empty sequence shard: a zero loss with zero gradients (it
    crashed: 'int' object has no attribute 'reshape')."""
    x, target, weight, bias = _inputs(N=0)
    loss = flce.chunked_linear_cross_entropy(x, target, weight, bias, chunk_size=4,
                                             normalizer=torch.tensor(3.0))
    loss.backward()
    assert loss.item() == 0 and not weight.grad.any() and x.grad.shape == (0, 4)
