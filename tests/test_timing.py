"""scripts/lib/timing.py: the timer, interleaved rounds in balanced orders, the host-ahead GEMMs."""

import collections
import itertools
import time

import pytest
import torch

from scripts.lib import timing
from scripts.lib.timing import median_ms


def test_the_timer_on_the_cpu():
    calls, barriers = [], []
    ms = median_ms(lambda: (calls.append(1), time.sleep(0.02)), warmup=2, reps=3, cuda=False,
                   before_each=lambda: barriers.append(1))
    assert len(calls) == 5 and len(barriers) == 3
    assert 20 <= ms < 200


def test_interleaved_rounds_balance_the_order_and_settle_each_run(monkeypatch):
    """Rounds come in balanced blocks: each run takes each position and follows each other run
    equally often (rounds shuffled from one seed gave a slot the same predecessor at every point,
    and a run right after the heavy bare GEMMs times slower), and each visit calls its run
    untimed until settle_ms have passed before the one timed call."""
    calls, clock = [], [0.0]

    def run_of(name):
        def run():  # a call that takes 2 ms of a clock of the test's own: a loaded machine's
            calls.append(name)  # sleeps overran and let fewer calls into the settling time
            clock[0] += 0.002
        return run
    runs = {name: run_of(name) for name in "abcde"}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    ms = timing.interleaved_ms(runs, seconds=0.0, max_reps=6, settle_ms=10.0)
    assert ms == dict.fromkeys("abcde", 1.0)
    visits = [(name, len(list(run))) for name, run in itertools.groupby(calls)]
    assert len(visits) == 10 * 5  # one block of an odd count: 10 rounds, beyond max_reps
    assert all(n == 6 for _, n in visits)  # 10 ms of 2 ms calls, then the timed one
    orders = [tuple(name for name, _ in visits[i:i + 5]) for i in range(0, 50, 5)]
    assert all(sorted(order) == list("abcde") for order in orders)
    positions = collections.Counter((name, i) for order in orders for i, name in enumerate(order))
    pairs = collections.Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert set(positions.values()) == {2} and len(positions) == 25
    assert set(pairs.values()) == {2} and len(pairs) == 20


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 7, 8])
def test_balanced_orders_are_a_williams_design_in_every_block(n):
    orders = timing.balanced_orders(n, seed=5)
    block = timing.block_rounds(n)
    for _ in range(2):  # the labels change between blocks, the balance does not
        rows = [next(orders) for _ in range(block)]
        assert all(sorted(row) == list(range(n)) for row in rows)
        positions = collections.Counter((r, i) for row in rows for i, r in enumerate(row))
        pairs = collections.Counter(pair for row in rows for pair in zip(row, row[1:]))
        assert len(positions) == n * n and len(set(positions.values())) == 1
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


def test_interleaved_rounds_fill_whole_blocks_up_to_max_reps(monkeypatch):
    clock = [0.0]

    def run():
        clock[0] += 0.001
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    runs = dict.fromkeys("abcd", run)
    assert len(timing.interleaved_rounds(runs, 0.0, 20, settle_ms=0.0)["a"]) == 4
    # 1 ms a run: 0.01 s asks for 10 rounds, 3 blocks of 4 (12) within max_reps 20
    assert len(timing.interleaved_rounds(runs, 0.01, 20, settle_ms=0.0)["a"]) == 12
    assert len(timing.interleaved_rounds(runs, 1.0, 20, settle_ms=0.0)["a"]) == 20


def test_interleaved_rounds_with_the_host_ahead_time_the_gpu_behind_long_enough_gemms(
        monkeypatch):
    """host_ahead: each timed call is ahead_ms's, whose GEMMs ahead of it last 3x the longest
    host time of a call of any run at the point, as long for all (5 ms at least); the rounds get
    its GPU time
    and `host` its host time. Without host_ahead the timed call is a synchronised one
    (median_ms), as before."""
    clock, led = [0.0], []
    host_s = {"fast": 0.0005, "slow": 0.004}

    def run_of(name):
        def run():
            clock[0] += host_s[name]
        return run
    runs = {name: run_of(name) for name in host_s}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: pytest.fail("synchronised"))

    def ahead(fn, lead_ms):
        led.append(lead_ms)
        fn()
        return 0.25, 0.75
    monkeypatch.setattr(timing, "ahead_ms", ahead)
    host = {}
    rounds = timing.interleaved_rounds(runs, 0.0, 4, settle_ms=10.0, host_ahead=True, host=host)
    assert rounds == {"fast": [0.25] * 4, "slow": [0.25] * 4}  # 3 rounds at least: 2 blocks
    assert host == {"fast": [0.75] * 4, "slow": [0.75] * 4}
    assert led == pytest.approx([12.0] * 8)  # 3 x the slow run's 4 ms, for the fast one too
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    monkeypatch.setattr(timing, "ahead_ms", lambda fn, lead_ms: pytest.fail("host ahead"))
    assert timing.interleaved_rounds(runs, 0.0, 4, settle_ms=10.0) == {"fast": [1.0] * 4,
                                                                       "slow": [1.0] * 4}


@pytest.mark.parametrize("host_s, lead_ms", [(0.0005, 5.0), (0.01, 30.0), (0.35, 60.0)])
def test_the_gemms_ahead_of_every_timed_call_are_as_long_for_every_run_within_5_and_60_ms(
        monkeypatch, host_s, lead_ms):
    """A run whose call synchronises (its host time its GPU time) had its own sleep 3x that, a
    second at 350 ms, against the others' few ms: Liger-Kernel then timed 10.7% faster than flce
    on an H100, and 1.0% with one sleep for both (their kernels 0.8% apart)."""
    clock, led = [0.0], []
    runs = {"short": lambda: clock.__setitem__(0, clock[0] + 0.0001),
            "long": lambda: clock.__setitem__(0, clock[0] + host_s)}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "ahead_ms", lambda fn, ms: (led.append(ms), fn(), (1.0, 0.1))[2])
    timing.interleaved_rounds(runs, 0.0, 4, settle_ms=0.0, host_ahead=True)
    assert led == pytest.approx([lead_ms] * 8)


@pytest.mark.parametrize("host_ahead", [False, True])
def test_a_run_out_of_memory_in_the_rounds_is_timed_alone_after_them(monkeypatch, host_ahead):
    """A run that does not fit beside the others' cached blocks is timed alone after the rounds,
    as the rounds time it: synchronised (timed_ms), or with the host ahead (three visits)."""
    clock, calls = [0.0], {"small": 0, "big": 0}

    def run_of(name):
        def run():
            calls[name] += 1
            if name == "big" and calls[name] <= 1 + host_ahead:  # with the lead's own call
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            clock[0] += 0.001
        return run
    runs = {name: run_of(name) for name in calls}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    monkeypatch.setattr(timing, "timed_ms", lambda fn, seconds, max_reps: (fn(), 7.0)[1])
    monkeypatch.setattr(timing, "ahead_ms", lambda fn, lead_ms: (fn(), (2.0, 0.5))[1])
    host = {}
    rounds = timing.interleaved_rounds(runs, 0.0, 4, settle_ms=0.0, host_ahead=host_ahead,
                                       host=host)
    assert rounds["big"] == ([2.0] if host_ahead else [7.0])
    assert rounds["small"] == [2.0 if host_ahead else 1.0] * 4
    assert host == ({"small": [0.5] * 4, "big": [0.5] * 3} if host_ahead else
                    {"small": [], "big": []})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GEMMs)")
def test_the_gemms_ahead_of_a_timed_call_keep_the_gpu_busy_about_as_long_as_asked():
    """The host-ahead timing's lead: GEMMs that last about the ms asked for, so that a call
    queued behind them is timed alone (the host's time to queue it not counted). scripts/test_gpu.sh
    shares the GPU among its workers: another's kernels can lengthen a lead, never shorten it,
    and a GEMM timed while they ran must not shorten the leads after (the calibration did, once:
    a 5 ms lead measured 2.08 ms). The timed call is settled first, as every benchmark settles its
    runs: a kernel's first launch loads its module, which waits for the lead to finish, and the
    add then timed 6.7 ms (an H100, 1 of 3 runs)."""
    timing.gpu_fill(1.0)  # the operands made and one GEMM timed
    for ms in (5.0, 30.0):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        timing.gpu_fill(ms)
        end.record()
        torch.cuda.synchronize()
        assert 0.5 * ms < start.elapsed_time(end) < 4.0 * ms  # longer: another worker's kernels
    x = torch.ones(8, device="cuda")
    x.add_(1)  # its kernel loaded first: CUDA's lazy loading waits for the GPU at a first call
    torch.cuda.synchronize()
    gpu, host = timing.ahead_ms(lambda: x.add_(1), 20.0)
    assert gpu < 5.0 and host < 20.0
