"""The one timer of the benchmarks that time GPU work in-process."""

import statistics
import time
from typing import Callable, Optional

import torch


def median_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 10, *, cuda: bool = True,
              before_each: Optional[Callable[[], object]] = None) -> float:
    """Median milliseconds of fn() over `reps` calls, after `warmup` untimed calls.

    On the GPU each call is timed by CUDA events recorded around it and the host waits for it
    to finish before the next one starts, so calls never overlap; with cuda=False (CPU runs,
    e.g. tests) the wall clock times it. before_each (e.g. a barrier across ranks) runs before
    every timed call, outside the timing."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
