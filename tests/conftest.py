import os
import random

import pytest
import torch

# Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter; it must be
# switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"random seed {seed}")  # shown by pytest when a test fails
    return random.Random(seed)


@pytest.fixture
def float8_at_any_size(monkeypatch):
    """The float8 GEMMs at every size: the loss otherwise runs bf16 GEMMs below
    flce.ops.FLOAT8_MIN_TOKENS tokens and FLOAT8_MIN_WORK (where quantizing W costs more than
    float8 saves), and the tests' shapes are smaller than that."""
    import flce.ops
    monkeypatch.setattr(flce.ops, "FLOAT8_MIN_TOKENS", 0)
    monkeypatch.setattr(flce.ops, "FLOAT8_MIN_WORK", 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The environment as it was before each test, its fixtures' setup included: an in-process
    train.main sets variables (the flight recorder's TORCH_FR_* with the run's folder, a
    deterministic run's CUBLAS_WORKSPACE_CONFIG) that every later test's subprocesses would
    inherit, and for which tests/forked_ranks.py would start another zygote."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
