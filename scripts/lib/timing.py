"""The timers of the benchmarks that time GPU work in-process: `median_ms` (one function, calls
in a row), `timed_ms` (as many calls as fit in a time) and `interleaved_rounds` / `interleaved_ms`
(several functions in rounds of balanced orders, each settled before its timed call: every
round's time, or their medians; with host_ahead, the GPU's time with the call's kernels queued
ahead of it, as in a training step whose host runs ahead: `ahead_ms`)."""

import random
import statistics
import sys
import time
from typing import Callable, Optional

import torch

SETTLE_MS = 50.0  # untimed calls before each timed one (interleaved_ms)
AHEAD_MIN_MS = 5.0  # GEMMs keep the GPU busy at least this long while the host queues a call ...
AHEAD_HOST_FACTOR = 3.0  # ... this many times the longest host time of a call at the point ...
AHEAD_MAX_MS = 60.0  # ... and at most this long (a call that synchronises gains nothing from more)
AHEAD_FILL = "GEMMs, one length a point"  # the rule's name in a report's meta (`ahead_fill_ms`)
FILL_SIZE = 4096  # the filler's GEMMs: bf16 FILL_SIZE^3, 0.19 ms on an H100


def require_cuda(prog: str) -> None:
    """Exit 2 with one line where torch sees no CUDA device: the benchmarks time GPU kernels."""
    if not torch.cuda.is_available():
        print(f"error: {prog} times CUDA kernels and needs a CUDA GPU; torch "
              f"{torch.__version__} sees none", file=sys.stderr)
        sys.exit(2)


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


def timed_ms(fn, seconds, max_reps):
    """Median ms of fn() over as many calls as fit in about `seconds` (3 at least, max_reps at
    most), after one untimed call (compilation, autotuning)."""
    fn()
    probe = median_ms(fn, warmup=0, reps=1)
    return median_ms(fn, warmup=0, reps=max(3, min(max_reps, int(seconds * 1e3 / probe))))


def interleaved_ms(runs: dict, seconds: float, max_reps: int, settle_ms: float = SETTLE_MS,
                   seed: int = 0) -> dict:
    """The median of each run's rounds in `interleaved_rounds` (None where it did not fit)."""
    return medians(interleaved_rounds(runs, seconds, max_reps, settle_ms, seed))


_cycles_per_ms: list = []


def gpu_sleep(ms: float) -> None:
    """Queue a kernel that keeps the GPU busy for about `ms` (torch.cuda._sleep counts clock
    cycles: their rate is measured once), its SMs idle: for timing the host while the GPU is
    busy (`bench.loss_kernels`), not the GPU's work after it (`gpu_fill`)."""
    if not _cycles_per_ms:
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # the clocks up first
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _cycles_per_ms.append(cycles / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(int(ms * _cycles_per_ms[0]))


_fill: list = []


def gpu_fill(ms: float) -> None:
    """Queue bf16 GEMMs that keep the GPU busy for about `ms`, at the clocks and power of full
    load, as the model's GEMMs keep it before the loss in a training step. A sleep kernel
    (`gpu_sleep`) idles the SMs instead, and a call after it starts with the headroom of an idle
    GPU: on an H100, with 60 ms of sleep ahead of every call, the bare GEMMs of the grid's
    points with N <= 16384 ran at a median 777-801 TFLOP/s, against 707-717 after 5 ms and
    672-683 synchronised (`flce_grid_host_ahead_one_sleep_h100.md`, `flce_grid_host_ahead_h100`,
    `flce_grid_h100`), and flce's memory-bound part does not speed up with the clocks. The
    operands (3 x 32 MiB) are made once, and one GEMM's time is measured once (the fastest of
    five batches, so that a GPU shared for a moment does not shorten every later lead)."""
    if not _fill:
        a = torch.randn(FILL_SIZE, FILL_SIZE, device="cuda", dtype=torch.bfloat16)
        b, out = torch.randn_like(a), torch.empty_like(a)
        for _ in range(20):  # the clocks down to their loaded level first
            torch.mm(a, b, out=out)
        times = []
        for _ in range(5):  # the fastest of five: work of other processes on the GPU only slows
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                torch.mm(a, b, out=out)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 5)
        _fill.append((a, b, out, max(min(times), 1e-3)))
    a, b, out, gemm_ms = _fill[0]
    for _ in range(max(1, round(ms / gemm_ms))):
        torch.mm(a, b, out=out)


def ahead_ms(fn: Callable[[], object], lead_ms: float,
             lead: Callable[[float], None] = gpu_fill) -> tuple[float, float]:
    """(the GPU's ms, the host's ms) of one call of fn made while work queued before it keeps
    the GPU busy for lead_ms (`gpu_fill`'s GEMMs, or `gpu_sleep`): the host queues the call's
    kernels before the GPU reaches them, so CUDA events around the call time the kernels back to
    back (the gaps between them on the GPU included, the host's time to launch them not), as in
    a training step whose host runs ahead. Where the host's time comes near lead_ms (a call that
    synchronises, or a longer lead was needed) the GPU waited for the host within it. So does
    the first launch of a kernel, whose module CUDA loads lazily: time settled calls."""
    torch.cuda.synchronize()
    lead(lead_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), host


def medians(rounds: dict) -> dict:
    """{name: the median of its times, or None where it has none}."""
    return {name: statistics.median(v) if v else None for name, v in rounds.items()}


def balanced_orders(n: int, seed: int = 0):
    """Endless orders of range(n), a block at a time, in which every run takes every position
    equally often and follows every other run equally often (a Williams design: n orders per
    block for even n, 2n for odd n), the runs' labels shuffled anew each block (seeded).

    A GPU's clocks lag behind its load, past the settling calls: on an H200 a run timed right
    after the bare GEMMs was on average 1.7% slower than its own median (the grid at 69a67fb,
    N <= 16384), and at single points up to 4% slower than the round's mean of the variants
    (`bench.row_order`). Rounds shuffled from one seed gave each slot the same predecessors at
    every point and in every session (flce's followed the bare GEMMs in 2 of the 3 rounds at
    every 3-round point of the grid; in `bench.row_order` the variant that held that slot was
    the slower at most points in both sessions that ran it, whichever code it ran), so between
    runs a few percent apart the slot decided; balanced blocks give every run the same
    predecessors."""
    base = [0]
    for k in range(1, n):
        base.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    rng = random.Random(seed)
    while True:
        labels = list(range(n))
        rng.shuffle(labels)
        for row in rows:
            yield [labels[i] for i in row]


def block_rounds(n: int) -> int:
    """The rounds of one balanced block of n runs (`balanced_orders`)."""
    return n if n % 2 == 0 else 2 * n


def ahead_fill_ms(runs: dict) -> float:
    """How long the GPU is kept busy (`gpu_fill`) before every run's timed call at one point when
    the host runs ahead: AHEAD_HOST_FACTOR x the longest host time of a call of any of the runs
    (one call each, synchronised), within AHEAD_MIN_MS and AHEAD_MAX_MS. The same for every run:
    with a sleep kernel ahead, its length moved the call after it, and each run's own 3x had
    Liger-Kernel, whose call synchronises (its host time about its GPU time, 350 ms at
    131072x2048x128256), timed after a second's sleep and flce after 11 ms: on an H100 Liger
    took 298.7 ms against flce's 330.5; with one 60 ms sleep for both, 309.8 against 313.0
    (`flce_large_n_{own,one}_sleep_h100.md`, one call); their kernels take 321 and 324 ms under
    the profiler (`loss_kernels_large_n_h100.md`). A run out of memory here counts for nothing."""
    longest = 0.0
    for run in runs.values():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            run()
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        longest = max(longest, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return min(AHEAD_MAX_MS, max(AHEAD_MIN_MS, AHEAD_HOST_FACTOR * longest * 1e3))


def interleaved_rounds(runs: dict, seconds: float, max_reps: int, settle_ms: float = SETTLE_MS,
                       seed: int = 0, host_ahead: bool = False,
                       host: Optional[dict] = None) -> dict:
    """Each run's ms in each of the rounds, which visit every run once, in balanced orders
    (`balanced_orders`: whole blocks, in which each run takes each position and follows each
    other run equally often). At each visit the run is called untimed until settle_ms have
    passed (once at least), then timed once (synchronised, as median_ms): the GPU's clocks and
    power state, which lag behind its load, are then mostly the run's own, what remains of its
    predecessor's falls on all runs alike, and so does a drift over the seconds spent at a
    point. A fixed order with one untimed call per visit favoured whichever run followed a light
    one: the bare GEMMs timed 10% faster after a light run at 16384x4096x128256, and at
    2048x8192x128256 flce (always right after the bare GEMMs) timed 1.164x them against
    torch.compile's 1.061x (always after the light flce_lean), while the profiler gave their
    kernels 16.5 and 16.7 ms per call. The untimed calls also leave the caching allocator as the
    run itself leaves it (a fresh cudaMalloc otherwise). About `seconds` of timed calls per run,
    in whole blocks: 3 rounds at least (even where a block exceeds max_reps), else as many blocks
    as fit in max_reps rounds. A run that runs out of memory beside the others' cached blocks is
    timed alone after the rounds (one value: the median of those calls), or gets [] if it does
    not fit alone either.

    host_ahead: each timed call is `ahead_ms`'s, the GPU kept busy by GEMMs while the host queues
    it: the GPU's time alone, which a synchronised call exceeds where the host launches kernels
    more slowly than the GPU runs them (a few thousand tokens). The GEMMs' length is one for
    every run at the point (`ahead_fill_ms`). `host`, a dict, receives each run's host ms of its
    timed calls (with host_ahead), in the order of the rounds."""
    times = {name: [] for name in runs}
    if host is not None:
        host.update({name: [] for name in runs})
    alone = []
    names = list(runs)
    orders = balanced_orders(len(names), seed)
    lead_ms = ahead_fill_ms(runs) if host_ahead else 0.0

    def visit(name) -> float:
        run = runs[name]
        end = time.perf_counter() + settle_ms / 1e3
        while True:  # once at least
            run()
            torch.cuda.synchronize()
            if time.perf_counter() >= end:
                break
        if not host_ahead:
            return median_ms(run, warmup=0, reps=1)
        gpu, host_ms = ahead_ms(run, lead_ms)
        if host is not None:
            host[name].append(host_ms)
        return gpu

    def one_round():
        for name in (names[i] for i in next(orders)):
            if name in alone:
                continue
            try:
                times[name].append(visit(name))
            except torch.OutOfMemoryError:
                alone.append(name)
                torch.cuda.empty_cache()

    one_round()  # also sizes the rest: about `seconds` of timed calls per run
    per_round = sum(v[0] for v in times.values() if v) or 1.0
    wanted = int(seconds * 1e3 * len(runs) / per_round)
    block = block_rounds(len(runs))
    least = block * -(-3 // block)  # 3 rounds at least
    rounds = max(least, block * min(-(-wanted // block), max_reps // block))
    for _ in range(rounds - 1):
        one_round()
    for name in alone:
        torch.cuda.empty_cache()
        try:
            if host_ahead:  # settled and timed as in the rounds, three times
                if host is not None:
                    host[name] = []
                times[name] = [statistics.median(visit(name) for _ in range(3))]
            else:
                times[name] = [timed_ms(runs[name], seconds, max_reps)]
        except torch.OutOfMemoryError:
            times[name] = []
    return times
