#!/usr/bin/env python3
"""What held a GPU's memory at its peak, from a CUDA memory snapshot (`[profiling]
enable_memory_snapshot`, or any `torch.cuda.memory._dump_snapshot` pickle, torchtitan's too).

    python3 -m scripts.bench.summarize_memory outputs/llama_8b/memory_snapshot/step-10/rank-0.pickle
    python3 -m scripts.bench.summarize_memory SNAPSHOT --top 20 --out benchmarks/memory_llama_8b_2xh200 \\
        --snapshot-command "torchrun ... train.py ... --profiling.enable_memory_snapshot true"

Replays the allocator's recorded history (allocations and completed frees) back from the state
the snapshot ends in, finds the moment most memory was allocated, and groups the blocks live
then by where they were allocated: the innermost stack frame outside PyTorch, other installed
packages and the code torch.compile generates (this repository's line, or torchtitan's: for a
compiled block, the line that calls it), else the innermost one. Blocks allocated
before the recorded history began count as such. With --out it also writes a report
(<out>.json and <out>.md).
"""

import argparse
import pickle
import re
import sys
from collections import defaultdict

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.summarize_memory ...")

from scripts.lib.report import probe_environment, provenance, warning_lines, write_report  # noqa: E402

BEFORE_HISTORY = "allocated before the recorded history"
# installed packages, the standard library, code torch.compile generated, frames without a file
INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python3\.\d+[/\\]"
                       r"|torchinductor|^<|^\?\?$")
GiB = 2**30


class _PlainData(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: a pickle that names any class or
    function is refused rather than run (a planted file would run code on load)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}; a memory snapshot holds plain "
                                     "data only")


def site(frames: list) -> str:
    """Where a block was allocated: 'path:line function' of the innermost frame outside the
    installed packages (paths shortened to their last three parts), else the innermost frame."""
    if not frames:
        return "no stack recorded"
    frame = next((f for f in frames if not INSTALLED.search(f["filename"])), frames[0])
    path = "/".join(re.split(r"[/\\]", frame["filename"])[-3:])
    return f"{path}:{frame['line']} {frame['name']}"


def busiest_device(snapshot: dict) -> int:
    traces = snapshot.get("device_traces", [])
    if not any(traces):
        raise SystemExit("the snapshot holds no allocator history (was it recorded with "
                         "torch.cuda.memory._record_memory_history?)")
    return max(range(len(traces)), key=lambda d: len(traces[d]))


def live_at_end(snapshot: dict, device: int) -> dict[int, int]:
    """{address: size} of the blocks allocated when the snapshot was taken."""
    return {b["address"]: b["size"] for seg in snapshot.get("segments", [])
            if seg.get("device", device) == device
            for b in seg["blocks"] if b["state"] in ("active_allocated", "active_awaiting_free")}


def peak(snapshot: dict, device: int) -> dict:
    """The moment of the most allocated memory in the recorded history, and what was live then."""
    events = snapshot["device_traces"][device]
    live = live_at_end(snapshot, device)
    total = end_total = sum(live.values())
    best, best_at = total, len(events)  # best_at: events before the peak moment
    for i in range(len(events) - 1, -1, -1):  # total: allocated after events[:i + 1]
        e = events[i]
        if e["action"] == "alloc":
            total -= e["size"]
        elif e["action"] == "free_completed":
            total += e["size"]
        else:
            continue
        if total >= best:  # ties: the earliest such moment
            best, best_at = total, i
    # live at the peak: replay back to it, then name each block by its latest allocation before it
    for e in reversed(events[best_at:]):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            live[e["addr"]] = e["size"]
    allocated_by = {}
    for e in events[:best_at]:
        if e["action"] == "alloc":
            allocated_by[e["addr"]] = e.get("frames", [])
    sites = defaultdict(lambda: [0, 0])
    for addr, size in live.items():
        key = site(allocated_by[addr]) if addr in allocated_by else BEFORE_HISTORY
        sites[key][0] += size
        sites[key][1] += 1
    reserved = sum(seg["total_size"] for seg in snapshot.get("segments", [])
                   if seg.get("device", device) == device)
    return {"device": device, "events": len(events), "peak_at_event": best_at,
            "peak_allocated_gib": best / GiB, "allocated_at_end_gib": end_total / GiB,
            "reserved_at_end_gib": reserved / GiB,
            "sites": [{"site": k, "gib": v[0] / GiB, "blocks": v[1]}
                      for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])]}


def text_table(summary: dict, top: int) -> str:
    lines = [f"peak allocated {summary['peak_allocated_gib']:.2f} GiB (after event "
             f"{summary['peak_at_event']} of {summary['events']}); at the snapshot: allocated "
             f"{summary['allocated_at_end_gib']:.2f} GiB, reserved "
             f"{summary['reserved_at_end_gib']:.2f} GiB", "",
             f"{'GiB':>8} {'blocks':>7}  allocated at (live at the peak)"]
    lines += [f"{s['gib']:8.3f} {s['blocks']:7d}  {s['site']}" for s in summary["sites"][:top]]
    return "\n".join(lines)


def markdown(meta: dict, summary: dict, top: int) -> str:
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731
    return "\n".join([
        *warning_lines(meta),
        f"GPU: {meta.get('gpu')} · torch {meta.get('torch')} · {meta['date']} · git {meta['git']}",
        f"Snapshot: `{meta['snapshot']}` (device {summary['device']}), made by "
        f"`{meta['snapshot_command'] or 'not recorded'}`", f"Command: `{meta['command']}`", "",
        f"Peak allocated **{summary['peak_allocated_gib']:.2f} GiB** (after event "
        f"{summary['peak_at_event']} of the {summary['events']} recorded); at the snapshot "
        f"{summary['allocated_at_end_gib']:.2f} GiB allocated, "
        f"{summary['reserved_at_end_gib']:.2f} GiB reserved.", "",
        "| GiB live at the peak | blocks | allocated at |", "|---|---|---|",
        *(f"| {s['gib']:.3f} | {s['blocks']} | `{cell(s['site'])}` |"
          for s in summary["sites"][:top])]) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.summarize_memory",
                                description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("snapshot", help="a pickle from torch.cuda.memory._dump_snapshot")
    p.add_argument("--device", type=int, default=None,
                   help="the device's history to read (default: the one with most events)")
    p.add_argument("--top", type=int, default=25, help="allocation sites listed")
    p.add_argument("--out", default=None, help="also write <out>.json and <out>.md")
    p.add_argument("--snapshot-command", default="",
                   help="the command that wrote the snapshot, recorded in the report")
    args = p.parse_args(argv)
    try:
        with open(args.snapshot, "rb") as f:
            snapshot = _PlainData(f).load()
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise SystemExit(f"{args.snapshot}: cannot read a memory snapshot ({e})")
    if not isinstance(snapshot, dict):
        p.error(f"{args.snapshot}: not a memory snapshot (a dict with device_traces)")
    traces = snapshot.get("device_traces", [])
    if args.device is not None and not 0 <= args.device < len(traces):
        p.error(f"--device {args.device}: {args.snapshot} has the history of "
                f"{len(traces)} device(s), 0-{len(traces) - 1}")
    device = busiest_device(snapshot) if args.device is None else args.device
    summary = peak(snapshot, device)
    print(text_table(summary, args.top))
    if args.out:
        meta = {**provenance(), **probe_environment(), "snapshot": args.snapshot,
                "snapshot_command": args.snapshot_command}
        write_report(args.out, {"meta": meta, **summary}, markdown(meta, summary, args.top))


if __name__ == "__main__":
    main()
