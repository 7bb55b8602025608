"""Where one GPU's time in a profiled step goes, on its timeline rather than summed per kernel.

Summed kernel times (`summarize_trace.py`) say what ran, not what the step waited on: kernels of
different streams overlap (FSDP's all-gathers and reduce-scatters run beside the compute), and
time in which no kernel runs at all (the host behind, a host sync) is in no kernel's total. From
a Chrome trace of torch.profiler this measures, between the first GPU activity's start and the
last one's end (the step as the GPU saw it):

- busy: time in which some kernel, copy or memset other than a collective runs;
- collectives alone: time in which only NCCL kernels run (communication the compute did not hide);
- idle: time in which nothing runs, and its gaps of at least `GAP_US`;
- host syncs: the CUDA runtime calls in which the host waits for the GPU (`SYNC_CALLS`) and the
  device-to-host copies, which wait for the work queued before them.
"""

import re

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
COLLECTIVE = re.compile(r"nccl", re.IGNORECASE)
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")
DEVICE_TO_HOST = re.compile(r"DtoH|Device -> (Pinned|Pageable)")
GAP_US = 50.0  # idle stretches shorter than this are launch latency, not a wait


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint ones, in order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def timeline(trace: dict, gap_us: float = GAP_US) -> dict:
    """The step's GPU timeline in ms (see the module's docstring); None without GPU activity."""
    events = [ev for ev in trace.get("traceEvents", []) if ev.get("ph") == "X"]
    gpu = [(float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), ev) for ev in events
           if ev.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return None
    compute = merged([(s, e) for s, e, ev in gpu if not COLLECTIVE.search(ev["name"])])
    everything = merged([(s, e) for s, e, _ in gpu])
    first, last = everything[0][0], everything[-1][1]
    gaps = [(e0, s1) for (_, e0), (s1, _) in zip(everything, everything[1:]) if s1 - e0 >= gap_us]
    syncs: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("cat") == "cuda_runtime" and ev["name"] in SYNC_CALLS:
            syncs.setdefault(ev["name"], []).append(float(ev.get("dur", 0.0)))
    d2h = [e - s for s, e, ev in gpu if ev.get("cat") == "gpu_memcpy"
           and DEVICE_TO_HOST.search(ev["name"])]
    ms = lambda us: us / 1e3  # noqa: E731
    return {"step_ms": ms(last - first),
            "busy_ms": ms(length(compute)),
            "collectives_alone_ms": ms(length(everything) - length(compute)),
            "idle_ms": ms(last - first - length(everything)),
            "gap_us": gap_us,
            "gaps": len(gaps), "gaps_ms": ms(sum(s1 - e0 for e0, s1 in gaps)),
            "longest_gaps_ms": sorted((ms(s1 - e0) for e0, s1 in gaps), reverse=True)[:5],
            "host_syncs": {name: {"calls": len(d), "ms": ms(sum(d))}
                           for name, d in sorted(syncs.items())},
            "device_to_host_copies": len(d2h)}


def markdown_lines(tl: dict) -> list[str]:
    """The timeline as a table and a line on the host syncs."""
    share = lambda v: f"{100 * v / tl['step_ms']:.1f}%" if tl["step_ms"] else "-"  # noqa: E731
    rows = [("the step on the GPU (first activity's start to last one's end)", tl["step_ms"]),
            ("busy: compute kernels, copies, memsets", tl["busy_ms"]),
            ("collectives alone (communication not hidden by compute)",
             tl["collectives_alone_ms"]),
            ("idle: no kernel running", tl["idle_ms"]),
            (f"  of which gaps of {tl['gap_us']:.0f} µs or more ({tl['gaps']}; longest "
             f"{', '.join(f'{g:.2f}' for g in tl['longest_gaps_ms']) or '-'} ms)", tl["gaps_ms"])]
    syncs = ", ".join(f"{name} x{s['calls']} ({s['ms']:.2f} ms)"
                      for name, s in tl["host_syncs"].items()) or "none"
    return ["| one GPU's timeline | ms | share |", "|---|---|---|",
            *(f"| {label} | {v:.2f} | {share(v)} |" for label, v in rows), "",
            f"Host waits on the GPU: {syncs}; device-to-host copies: "
            f"{tl['device_to_host_copies']}."]
