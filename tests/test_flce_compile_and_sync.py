"""The loss inside torch.compile, and no host-device synchronisation on the GPU."""

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import flce
from flce.custom_ops import NAMESPACE, source_digest
from flce_cases import IMPL_DEVICES, cuda_only, make_inputs, rel_err


class TinyHead(nn.Module):
    def __init__(self, H, V, impl, float8="none", chunk_size=None):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.out = nn.Linear(H, V)
        self.loss = flce.FusedLinearCrossEntropyLoss(label_smoothing=0.1, z_loss=1e-4, impl=impl,
                                                     float8=float8, chunk_size=chunk_size)

    def forward(self, x, target):
        h = torch.tanh(self.proj(x))
        return self.loss(h, target, self.out.weight, self.out.bias)


@pytest.mark.slow
@IMPL_DEVICES
@pytest.mark.parametrize("float8", ["none", "logits+dx"])
# V = 37: fp32 rows of 148 bytes, so the GEMMs run 48 wide (flce.ops.gemm_vocab): the one-block
# logits' fake shape and the chunked dW (a slice of its padded accumulator) under the compiler
@pytest.mark.parametrize("V,chunk", [(40, None), (37, None), (37, 16)],
                         ids=["V40", "V37_one_block", "V37_chunked"])
def test_inside_torch_compile(impl, device, float8, V, chunk, float8_at_any_size):
    torch._dynamo.reset()  # each case compiles TinyHead.forward anew: no recompile limit across cases
    torch.manual_seed(0)
    model = TinyHead(16, V, impl, float8, chunk).to(device)
    x = torch.randn(2, 24, 16, device=device)
    target = torch.randint(0, V, (2, 24), device=device)
    target[0, :5] = -100
    eager = model(x, target)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    loss = compiled(x, target)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert rel_err(loss, eager) <= 1e-6
    assert all(rel_err(g, ge) <= 1e-5 for g, ge in zip(grads, eager_grads))


def test_inside_torch_compile_with_dynamic_shapes():
    """fullgraph + dynamic=True: the options' checks called math.isfinite, which dynamo cannot
    trace on the symbolic floats it passes (Unsupported: torch.* op returned non-Tensor)."""
    torch._dynamo.reset()
    fn = lambda x, t, w: flce.fused_linear_cross_entropy(x, t, w, label_smoothing=0.1)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for N in (11, 19):
        x, t, w, _ = make_inputs(N, 8, 37, "cpu", torch.float32)
        got = compiled(x, t, w)
        got_grads = torch.autograd.grad(got, (x, w))
        ref = fn(x, t, w)
        ref_grads = torch.autograd.grad(ref, (x, w))
        assert rel_err(got, ref) <= 1e-6
        assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got_grads, ref_grads))


@cuda_only
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("float8", ["none", "logits", "logits+dx"])
def test_no_host_sync_on_cuda(reduction, float8, float8_at_any_size):
    x, t, w, b = make_inputs(300, 64, 1000, "cuda", torch.bfloat16)
    count = (t != -100).sum()
    flce.fused_linear_cross_entropy(x, t, w, b, reduction=reduction,
                                    float8=float8).sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for normalizer in ((None, count) if reduction != "none" else (None,)):
            loss = flce.fused_linear_cross_entropy(x, t, w, b, reduction=reduction,
                                                   normalizer=normalizer, chunk_size=128,
                                                   label_smoothing=0.1, z_loss=1e-4, softcap=20.0,
                                                   float8=float8)
            loss.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


def test_the_op_names_change_with_flces_sources(tmp_path):
    # Inductor's disk cache keys a graph on the ops' names: a graph cached by another flce (whose
    # fakes may give other shapes) must not match, so the names carry the sources' digest.
    package = Path(flce.__file__).parent
    assert NAMESPACE == f"flce_{source_digest(package)}"
    assert hasattr(getattr(torch.ops, NAMESPACE), "block_forward")
    copy = tmp_path / "flce"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == source_digest(package)
    ops = copy / "ops.py"
    ops.write_text(ops.read_text() + "MIN_CHUNK_TOKENS = 4096  # another flce\n")
    assert source_digest(copy) != source_digest(package)


@pytest.mark.parametrize("transposed", ["x", "weight"])
@pytest.mark.parametrize("path", [
    {}, {"chunk_size": 8}, {"memory_lean": True}, {"memory_lean": True, "sweep": True},
    {"reduction": "none"}], ids=["one_block", "chunks", "lean_chunks", "lean_slices", "none"])
def test_inside_torch_compile_with_transposed_inputs(transposed, path, monkeypatch):
    """A head stored [H, V] and passed as W.t() (or an x transposed): the fake gradients copied
    the input's strides (`empty_like`) while the real ones are contiguous, and Inductor's stride
    assertion failed the compiled step on every path (`expected ... stride 8==1`)."""
    path = dict(path)
    if path.pop("sweep", False):
        monkeypatch.setattr(flce.vocab_sweep, "SWEEP_MIN_WEIGHT", 0)
    torch._dynamo.reset()
    N, H, V = 21, 8, 40
    x, t, w, b = make_inputs(N, H, V, "cpu", torch.float32)
    x_in = x.detach().t().contiguous().t().requires_grad_() if transposed == "x" else x
    w_in = w.detach().t().contiguous().t().requires_grad_() if transposed == "weight" else w
    assert not (x_in if transposed == "x" else w_in).is_contiguous()
    upstream = torch.rand(N, dtype=torch.float64) + 0.5

    def loss_of(fn, *args):
        loss = fn(*args, reduction=path.get("reduction", "mean"),
                  **{k: v for k, v in path.items() if k != "reduction"})
        return (loss.double() * upstream).sum() if loss.dim() else loss.double()

    compiled = torch.compile(flce.fused_linear_cross_entropy, fullgraph=True)
    got = loss_of(compiled, x_in, t, w_in, b)
    got_grads = torch.autograd.grad(got, (x_in, w_in, b))
    xd, wd, bd = (a.detach().double().requires_grad_() for a in (x, w, b))
    losses = torch.nn.functional.cross_entropy(xd @ wd.t() + bd, t, reduction="none")
    kept = (t != -100).sum()
    ref = (losses * upstream).sum() if path.get("reduction") == "none" else losses.sum() / kept
    ref_grads = torch.autograd.grad(ref, (xd, wd, bd))
    assert rel_err(got, ref) <= 1e-6
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got_grads, ref_grads))
