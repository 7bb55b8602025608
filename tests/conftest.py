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
