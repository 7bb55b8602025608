"""The background thread that makes batches ahead: the state is that of the last batch taken (a
checkpoint resumes where training is, not where the thread is), errors reach the training loop,
and loading a state or closing stops the thread, as does the end of the process when an error
ends the run without close()."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from components.data.windows import Batches, SyntheticTokens
from components.data.prefetch import Prefetched


class Counting(Batches):
    """Synthetic batches that can be told to fail at a batch."""

    def __init__(self, fail_at: int | None = None):
        super().__init__(SyntheticTokens(100, 8, seed=0), local_batch_size=2)
        self.fail_at = fail_at

    def __next__(self):
        if self.fail_at is not None and self.windows._windows == 2 * self.fail_at:
            raise ValueError(f"document {self.fail_at} is bad")
        return super().__next__()


def test_the_state_is_the_last_batch_taken_and_resumes_exactly():
    reference = Counting()
    expected = [next(reference) for _ in range(12)]
    states = [Counting().state_dict()]
    ahead = Prefetched(Counting(), depth=3)
    for k in range(6):
        assert torch.equal(next(ahead)[0], expected[k][0])
        time.sleep(0.05)  # the thread runs ahead by up to 3 batches
        states.append(ahead.state_dict())
    assert [s["windows"] for s in states] == [0, 2, 4, 6, 8, 10, 12]
    ahead.load_state_dict(states[2])
    assert [torch.equal(next(ahead)[0], expected[k][0]) for k in (2, 3, 4)] == [True] * 3
    ahead.resume_at_batch(9)
    assert torch.equal(next(ahead)[0], expected[9][0])
    ahead.close()


def test_errors_reach_the_training_loop_and_close_stops_the_thread():
    threads = set(threading.enumerate())
    failing = Prefetched(Counting(fail_at=2))
    next(failing), next(failing)
    with pytest.raises(ValueError, match="document 2 is bad"):
        next(failing)
    working = Prefetched(Counting())
    next(working)
    assert len(set(threading.enumerate()) - threads) == 1
    working.close()
    assert set(threading.enumerate()) - threads == set()


# A run that ends with an error (a failed save) and so never closes its batches, while the thread
# is making one in torch ops that release the GIL.
ENDS_WITH_AN_ERROR = """
import torch
from components.data.prefetch import Prefetched

class Busy:
    def __init__(self):
        self.a = torch.randn(256, 256)
    def state_dict(self):
        return {}
    def __next__(self):
        for _ in range(200):
            self.a = (self.a @ self.a).tanh()
        return self.a

batches = Prefetched(Busy())
next(batches)
raise RuntimeError("writing step-4 failed")
"""


@pytest.mark.slow
def test_an_error_that_ends_the_run_does_not_abort_the_process_on_exit():
    """The thread is stopped and joined at exit: Python 3.11 ended the daemon thread inside a
    torch op with pthread_exit during finalization, which aborted the process (SIGABRT,
    "terminate called without an active exception") after the error had been reported."""
    root = Path(__file__).resolve().parents[1]
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", ENDS_WITH_AN_ERROR], cwd=root, text=True,
                              capture_output=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert proc.stderr.rstrip().endswith("RuntimeError: writing step-4 failed"), proc.stderr
