"""Which scaled-dot-product-attention kernel the model runs on CUDA: `[model] sdpa_backend`.

Attention is about a third of a training step of the 1B model at seq 8192, and the kernels differ
by 1.6x there (`scripts/bench/attention.py`, benchmarks/attention_h200.md: cuDNN 9.3 ms, flash
15.0 ms forward+backward per layer at batch 4). "auto" keeps PyTorch's choice, which on an H200
with torch 2.11 is already cuDNN (seen in a profile of train.py); naming a backend pins it, e.g.
when another PyTorch or GPU would choose differently. It disables the others, so a shape the
named kernel cannot run fails with PyTorch's "No available kernel" error instead of silently
falling back to the math kernel.
"""

import torch

_SWITCHES = {
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    "flash": torch.backends.cuda.enable_flash_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "math": torch.backends.cuda.enable_math_sdp,
}
# models imports nothing from components: components.config.schema's SdpaBackend lists the same
# names (tests/test_config.py checks that they agree).
BACKENDS = ("auto", *_SWITCHES)


def check_sdpa_backend(name: str, device: torch.device) -> None:
    """A ValueError naming [model] sdpa_backend when `name` cannot run on `device`."""
    if name not in BACKENDS:
        raise ValueError(f"[model] sdpa_backend = {name!r}: expected one of {BACKENDS}")
    if name != "auto" and device.type != "cuda":
        raise ValueError(f"[model] sdpa_backend = {name!r} selects a CUDA kernel, but the model "
                         f"runs on {device.type}: use \"auto\"")


def set_sdpa_backend(name: str, device: torch.device) -> None:
    """Enable only `name`'s kernel for F.scaled_dot_product_attention ("auto": PyTorch's order).

    Process-wide, and read when torch.compile traces the model: call it before compiling."""
    check_sdpa_backend(name, device)
    if name == "auto":  # PyTorch's defaults: every backend enabled (undoes an earlier choice)
        for enable in _SWITCHES.values():
            enable(True)
        return
    for backend, enable in _SWITCHES.items():
        enable(backend == name)
