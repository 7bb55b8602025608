"""Shared helpers for the flce tests: where each implementation can run, and float64 references."""

import os

import pytest
import torch

import flce


def impl_devices():
    """(impl, device) pairs that can run here: torch on the CPU always; Triton on CUDA, or on
    the CPU through the interpreter when there is no GPU; torch on CUDA too when present."""
    pairs = [("torch", "cpu")]
    if os.environ.get("TRITON_INTERPRET") == "1":
        pairs.append(("triton", "cpu"))
    if torch.cuda.is_available():
        pairs += [("triton", "cuda"), ("torch", "cuda")]
    return pairs


IMPL_DEVICES = pytest.mark.parametrize("impl,device", impl_devices(), ids=lambda v: str(v))
# the loss options, alone and all together (with an ignore_index other than the default)
OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"logit_scale": 0.6},
    {"softcap": 3.0},
    # 1: a uniform target, which torch's cross_entropy accepts (the target's logit drops out)
    {"label_smoothing": 1.0},
    {"label_smoothing": 1.0, "z_loss": 1e-3, "softcap": 3.0, "ignore_index": 5},
    {"label_smoothing": 0.25, "z_loss": 1e-2, "logit_scale": 1.7, "softcap": 4.0, "ignore_index": 5},
]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def skip_if_interpreted_bf16(impl, device):
    """Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest (measured:
    twice the rounding error), so bf16 accuracy of the Triton kernels is checked on CUDA only."""
    if impl == "triton" and device == "cpu":
        pytest.skip("bf16 rounding of Triton's interpreter is truncation; checked on CUDA")


def make_inputs(N, H, V, device, dtype, bias=True, ignore_frac=0.2, scale=1.0, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.randint(1 << 30, ()).item())
    x = torch.randn(N, H, generator=g, dtype=torch.float64) * scale
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.1 if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < ignore_frac] = -100
    cast = lambda a: None if a is None else a.to(device=device, dtype=dtype).requires_grad_()
    return cast(x), t.to(device), cast(w), cast(b)


def loss_and_grads(fn, x, t, w, b, upstream=None, **kw):
    """Loss and (dx, dW, db) of fn for the upstream gradient given (random if None)."""
    loss = fn(x, t, w, b, **kw)
    if upstream is None:
        upstream = torch.randn(loss.shape, dtype=torch.float64)
    inputs = [a for a in (x, w, b) if a is not None]
    grads = torch.autograd.grad(loss, inputs, upstream.to(device=loss.device, dtype=loss.dtype))
    return loss, grads, upstream


def float64_reference(x, t, w, b, upstream, **kw):
    up = lambda a: None if a is None else a.detach().cpu().double().requires_grad_()
    return loss_and_grads(flce.linear_cross_entropy, up(x), t.cpu(), up(w), up(b), upstream, **kw)[:2]


def rel_err(a, ref):
    a, ref = a.detach().cpu().double(), ref.detach().cpu().double()
    return ((a - ref).norm() / ref.norm().clamp(min=1e-30)).item()

