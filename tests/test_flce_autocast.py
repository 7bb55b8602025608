"""The loss under torch.autocast takes its inputs as nn.Linear does: in autocast's dtype, on
every path, its gradients in the inputs' own dtypes."""

import pytest
import torch
import torch.nn.functional as F

import flce


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    w = torch.randn(37, 16, generator=g, dtype=torch.float64) / 4
    b = torch.randn(37, generator=g, dtype=torch.float64) * 0.1
    t = torch.randint(0, 37, (8,), generator=g)
    t[3] = -100
    return [a.to(dtype).requires_grad_() for a in (x, w, b)], t


@pytest.mark.parametrize("chunk_size", [None, 4], ids=["one_block", "chunks"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_inputs_under_autocast_run_in_its_dtype(chunk_size, reduction):
    """Autocast cast the one-block path's forward GEMM alone (fp32 inputs got bf16 logits) and
    that path's backward failed on a bf16 and an fp32 operand (torch's bare "expected m1 and m2
    to have the same dtype"), while the chunks' GEMMs (written with out=) ran in fp32: the
    precision followed the path. Now every path is the bf16 loss of the inputs cast to bf16."""
    (x, w, b), t = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = flce.fused_linear_cross_entropy(x, t, w, b, reduction=reduction,
                                               chunk_size=chunk_size, impl="torch")
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(loss, (x, w, b), upstream)
    cast = [a.detach().bfloat16().requires_grad_() for a in (x, w, b)]
    want = flce.fused_linear_cross_entropy(*cast[:1], t, *cast[1:], reduction=reduction,
                                           chunk_size=chunk_size, impl="torch")
    want_grads = torch.autograd.grad(want, cast, upstream)
    assert torch.equal(loss, want)
    for name, g, wg in zip(("dx", "dW", "db"), grads, want_grads):
        assert g.dtype == torch.float32, name
        assert torch.equal(g, wg.float()), name
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the unfused loss under autocast
        unfused = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction)
    assert torch.allclose(loss, unfused.float(), rtol=2e-2, atol=2e-2)


def test_float64_inputs_under_autocast_stay_float64():
    """Autocast leaves float64 alone, and so does the loss: exact to float64 rounding."""
    (x, w, b), t = _inputs(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = flce.fused_linear_cross_entropy(x, t, w, b, impl="torch")
    want = F.cross_entropy(F.linear(x, w, b), t)
    assert loss.dtype == torch.float64
    assert torch.allclose(loss, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_compiled_with_fullgraph_where_dynamo_cannot_trace_the_availability_check(
        monkeypatch, autocast):
    """torch 2.11's dynamo cannot trace torch.amp.is_autocast_available (a builtin it skips):
    every fullgraph compile of the loss failed there (32 CUDA tests on the device image), while
    torch 2.13's traces it. Here the check is made untraceable as it is on 2.11."""
    monkeypatch.setattr(torch.amp, "is_autocast_available",
                        torch.compiler.disable(torch.amp.is_autocast_available))
    torch._dynamo.reset()
    (x, w, b), t = _inputs(torch.float32)
    fn = lambda x, w, b: flce.fused_linear_cross_entropy(x, t, w, b, impl="torch")  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = torch.compile(fn, fullgraph=True)(x, w, b)
        want = fn(x, w, b)
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
