"""scripts/lib/trace_timeline.py: a profiled step's GPU timeline (busy, communication not
hidden, idle, host syncs) against hand-counted traces, a per-microsecond count of random ones,
and a real CUDA trace."""

import json

import pytest
import torch

from scripts.lib.trace_timeline import merged, timeline


def kernel(name, ts, dur, cat="kernel", stream=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream}


def test_hand_counted_step():
    events = [kernel("nvjet_gemm", 1000, 300),               # 1000-1300
              kernel("triton_poi_fused_silu", 1250, 100),    # 1250-1350, overlaps the GEMM
              kernel("ncclDevKernel_AllGather", 1300, 200, stream=20),  # alone 1350-1500
              kernel("flce_rows_kernel", 1700, 100),         # after a 200 µs gap
              kernel("Memcpy DtoH (Device -> Pinned)", 1810, 5, cat="gpu_memcpy"),  # 10 µs gap
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1400,
               "dur": 420},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 990, "dur": 5},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]
    tl = timeline({"traceEvents": events})
    assert tl["step_ms"] == pytest.approx(0.815)           # 1000 to 1815
    assert tl["busy_ms"] == pytest.approx(0.455)           # 350 + 100 + 5
    assert tl["collectives_alone_ms"] == pytest.approx(0.15)
    assert tl["idle_ms"] == pytest.approx(0.21)            # 200 + 10
    assert (tl["gaps"], tl["gaps_ms"], tl["longest_gaps_ms"]) == (1, pytest.approx(0.2),
                                                                  [pytest.approx(0.2)])
    assert tl["host_syncs"] == {"cudaStreamSynchronize": {"calls": 1, "ms": pytest.approx(0.42)}}
    assert tl["device_to_host_copies"] == 1


def test_no_gpu_activity_gives_none():
    assert timeline({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0,
                                      "dur": 9}]}) is None


def test_random_traces_against_a_count_per_microsecond(rng):
    for _ in range(20):
        events = [kernel(rng.choice(["nvjet", "ncclKernel", "triton_red", "Memset"]),
                         rng.randrange(0, 3000), rng.randrange(1, 400),
                         cat=rng.choice(["kernel", "kernel", "gpu_memset"]),
                         stream=rng.choice([7, 20, 24]))
                  for _ in range(rng.randrange(1, 30))]
        state = {}  # µs -> "busy" or "comm"
        for ev in events:
            for t in range(ev["ts"], ev["ts"] + ev["dur"]):
                if "nccl" in ev["name"].lower():
                    state.setdefault(t, "comm")
                else:
                    state[t] = "busy"
        first = min(ev["ts"] for ev in events)
        last = max(ev["ts"] + ev["dur"] for ev in events)
        gap = rng.choice([1.0, 50.0, 200.0])
        tl = timeline({"traceEvents": events}, gap_us=gap)
        values = list(state.values())
        assert tl["step_ms"] * 1e3 == pytest.approx(last - first)
        assert tl["busy_ms"] * 1e3 == pytest.approx(values.count("busy"))
        assert tl["collectives_alone_ms"] * 1e3 == pytest.approx(values.count("comm"))
        assert tl["idle_ms"] * 1e3 == pytest.approx(last - first - len(state))
        runs, t = [], first  # the idle stretches, counted per µs
        while t < last:
            if t in state:
                t += 1
                continue
            start = t
            while t < last and t not in state:
                t += 1
            runs.append(t - start)
        long = [r for r in runs if r >= gap]
        assert (tl["gaps"], tl["gaps_ms"] * 1e3) == (len(long), pytest.approx(sum(long)))


def test_merged_unions_touching_and_nested_intervals():
    assert merged([(5, 6), (0, 2), (2, 3), (1, 1.5), (4, 4.5)]) == [(0, 3), (4, 4.5), (5, 6)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trace_shows_the_sleep_as_busy_and_the_sync(tmp_path):
    """A real trace: a GPU sleep (20M cycles, ~10 ms) is busy time, the host's .item() a device-to-host copy
    and a wait, and the step's parts add up."""
    x = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = x @ x
        torch.cuda._sleep(20_000_000)
        (y.sum() + 1).item()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    tl = timeline(json.loads(path.read_text()))
    assert tl["busy_ms"] >= 5 and tl["collectives_alone_ms"] == 0
    assert tl["busy_ms"] + tl["idle_ms"] == pytest.approx(tl["step_ms"])
    assert tl["device_to_host_copies"] >= 1


def test_summarize_trace_reads_gzip_and_names_a_bad_trace_in_one_line(tmp_path):
    """A missing, empty, truncated or non-object trace was a traceback, and a .json.gz one
    (torch.profiler writes them so where asked) could not be read at all."""
    import gzip
    import subprocess
    import sys
    from pathlib import Path

    trace = {"traceEvents": [kernel("nvjet_gemm", 0, 40), kernel("flce_rows", 40, 10)]}
    gz = tmp_path / "rank-0.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump(trace, f)
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "cut.json").write_text(json.dumps(trace)[:30])
    (tmp_path / "list.json").write_text("[1, 2]")

    def run(path):
        return subprocess.run([sys.executable, "-m", "scripts.bench.summarize_trace", str(path)],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True, timeout=60)
    ok = run(gz)
    assert ok.returncode == 0 and "nvjet_gemm" in ok.stdout, ok.stderr
    for name, said in (("missing.json", "cannot read it"), ("empty.json", "not a complete JSON"),
                       ("cut.json", "not a complete JSON"), ("list.json", "not a Chrome trace")):
        result = run(tmp_path / name)
        assert result.returncode == 2 and "Traceback" not in result.stderr, name
        assert f"error: {tmp_path / name}: {said}" in result.stderr.splitlines()[-1], name
