"""One intra-op torch thread in a test worker while a module's training tests run, and in the
processes they start (ONE_THREAD, for a subprocess's environment).

CI runs `pytest -n 2` on 2 cores, and torch takes a thread per core by default: two workers
training at once put 4 spinning threads on 2 cores. Measured on such a machine, 20 steps of the
debug model took 15-20 s with 2 threads and 1 s with 1; the tests' models are far too small for
a second thread to pay. The trainers that torchrun starts get OMP_NUM_THREADS=1 already.

A module uses it with `from torch_threads import one_torch_thread  # noqa: F401` (autouse)."""

import pytest
import torch

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
