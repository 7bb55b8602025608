"""CUDA memory snapshots: `[profiling] enable_memory_snapshot` and
scripts/bench/summarize_memory.py, which finds the peak of a recorded allocator history and what
was allocated where then."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.bench import summarize_memory
from scripts.bench.summarize_memory import BEFORE_HISTORY, GiB, peak

ROOT = Path(__file__).resolve().parents[1]
TORCH_FRAME = {"filename": "/usr/lib/python3.12/site-packages/torch/nn/modules/linear.py",
               "line": 125, "name": "forward"}


def frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


def event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def snapshot(events, live_at_end):
    blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated",
               "frames": []} for a, s in live_at_end.items()]
    blocks.append({"address": 1 << 40, "size": 1 << 20, "requested_size": 0, "state": "inactive",
                   "frames": []})
    return {"segments": [{"device": 0, "address": 0, "total_size": 1 << 41, "blocks": blocks}],
            "device_traces": [events]}


def test_hand_counted_peak_and_where_its_blocks_were_allocated():
    ops = frame("/root/work/flce/ops.py", 12, "chunk_loop")
    llama = frame("/root/work/models/llama.py", 97, "forward")
    events = [event("alloc", 1000, 64, [TORCH_FRAME, ops]),
              event("alloc", 2000, 256, [llama]),
              event("free_requested", 2000, 256),
              event("free_completed", 2000, 256),
              event("free_completed", 1000, 64),
              event("alloc", 3000, 100)]
    # 5000 (500 bytes) was allocated before the history began and is still live at the end
    summary = peak(snapshot(events, {3000: 100, 5000: 500}), 0)
    assert summary["peak_allocated_gib"] * GiB == 820 and summary["peak_at_event"] == 3
    assert summary["allocated_at_end_gib"] * GiB == 600
    assert [(s["site"], s["gib"] * GiB, s["blocks"]) for s in summary["sites"]] == [
        (BEFORE_HISTORY, 500, 1), ("work/models/llama.py:97 forward", 256, 1),
        ("work/flce/ops.py:12 chunk_loop", 64, 1)]


def test_a_site_is_the_innermost_frame_of_the_repository():
    generated = frame("/tmp/torchinductor_root/c4/cc4x.py", 210, "call")
    calls_block = frame("/root/work/models/llama.py", 218, "forward")
    assert summarize_memory.site([generated, TORCH_FRAME, calls_block]) == \
        "work/models/llama.py:218 forward"
    # nothing of the repository (a compiled backward on autograd's thread): the innermost frame
    assert (summarize_memory.site([generated, TORCH_FRAME])
            == "torchinductor_root/c4/cc4x.py:210 call")
    assert summarize_memory.site([]) == "no stack recorded"


def test_random_histories_against_a_forward_replay(rng):
    for _ in range(30):
        events, live, total, best = [], {}, 0, 0
        pending = []
        for _ in range(rng.randrange(1, 60)):
            if live and rng.random() < 0.45:
                addr = rng.choice(sorted(live))
                events.append(event("free_requested", addr, live[addr]))
                pending.append(addr)
                size = live.pop(addr)
                if rng.random() < 0.7:  # completed at once, or after other events
                    events.append(event("free_completed", addr, size))
                    pending.remove(addr)
                    total -= size
                continue
            for addr in list(pending)[:1]:
                size = next(e["size"] for e in reversed(events) if e["addr"] == addr)
                events.append(event("free_completed", addr, size))
                pending.remove(addr)
                total -= size
            addr = rng.randrange(1, 1 << 30) * 512
            while addr in live or addr in pending:
                addr += 512
            live[addr] = rng.randrange(1, 1 << 20)
            total += live[addr]
            best = max(best, total)
            events.append(event("alloc", addr, live[addr],
                                [frame(f"/w/models/m{addr % 3}.py", 1, "f")]))
        still = {a: next(e["size"] for e in reversed(events) if e["addr"] == a) for a in pending}
        summary = peak(snapshot(events, {**live, **still}), 0)
        assert summary["peak_allocated_gib"] * GiB == best
        assert sum(s["gib"] for s in summary["sites"]) * GiB == best
        assert all(s["site"] != BEFORE_HISTORY for s in summary["sites"])


class Planted:
    """Unpickled, it would create a file: any code a pickle names runs on load."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_naming_code_is_refused_not_run(tmp_path):
    path, marker = tmp_path / "rank-0.pickle", tmp_path / "ran"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "x": Planted(marker)}))
    with pytest.raises(SystemExit, match="cannot read a memory snapshot .*names pathlib"):
        summarize_memory.main([str(path)])
    assert not marker.exists()
    pickle.loads(path.read_bytes())  # what plain pickle.load would have done
    assert marker.exists()


def test_report_names_its_snapshot(tmp_path):
    path = tmp_path / "rank-0.pickle"
    events = [event("alloc", 512, 3 << 20, [frame("/a/b/train.py", 9, "main")])]
    path.write_bytes(pickle.dumps(snapshot(events, {512: 3 << 20})))
    summarize_memory.main([str(path), "--out", str(tmp_path / "memory"),
                           "--snapshot-command", "train.py --x"])
    report = json.loads((tmp_path / "memory.json").read_text())
    assert report["sites"] == [{"site": "a/b/train.py:9 main", "gib": 3 / 1024, "blocks": 1}]
    assert report["meta"]["snapshot_command"] == "train.py --x"
    assert "`a/b/train.py:9 main`" in (tmp_path / "memory.md").read_text()


def train_with_snapshots(dump: Path, device: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "--config", "configs/debug.toml",
                           "--training.device", device, "--profiling.enable_memory_snapshot",
                           "true", "--job.dump_folder", str(dump), *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_cpu_run_says_it_writes_no_snapshot(tmp_path):
    out = train_with_snapshots(tmp_path, "cpu", "--training.steps", "2",
                               "--profiling.profile_freq", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "enable_memory_snapshot records CUDA memory" in out.stdout + out.stderr
    assert not (tmp_path / "memory_snapshot").exists()


def _make_blocks():
    return [torch.empty(3 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_finds_the_blocks_and_their_line(tmp_path):
    torch.cuda.memory._record_memory_history(max_entries=10_000, stacks="python")
    try:
        blocks = _make_blocks()
        del blocks
        path = tmp_path / "rank-0.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    summary = peak(pickle.loads(path.read_bytes()), torch.cuda.current_device())
    ours = [s for s in summary["sites"] if "test_memory_snapshot.py" in s["site"]
            and "_make_blocks" in s["site"]]
    assert ours and ours[0]["blocks"] == 4 and ours[0]["gib"] * GiB >= 4 * (3 << 20)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_run_dumps_snapshots_the_summary_reads(tmp_path):
    out = train_with_snapshots(tmp_path, "cuda", "--training.steps", "4",
                               "--profiling.profile_freq", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    snapshots = sorted((tmp_path / "memory_snapshot").glob("step-*/rank-0.pickle"))
    assert [p.parent.name for p in snapshots] == ["step-2", "step-4"]
    summary = subprocess.run([sys.executable, "-m", "scripts.bench.summarize_memory",
                              str(snapshots[-1])], cwd=ROOT, capture_output=True, text=True)
    assert summary.returncode == 0 and "peak allocated" in summary.stdout


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_out_of_memory_leaves_a_snapshot(tmp_path):
    """A batch far beyond the GPU's memory: the run fails, and says where the snapshot of the
    step that ran out is."""
    out = train_with_snapshots(tmp_path, "cuda", "--training.steps", "2", "--data.synthetic",
                               "true", "--training.seq_len", "2048",
                               "--training.local_batch_size", "65536")
    assert out.returncode != 0 and "OutOfMemoryError" in out.stderr
    assert "out of memory: snapshot of step 1" in out.stdout + out.stderr
    (path,) = (tmp_path / "memory_snapshot").glob("oom-step-1/rank-0.pickle")
    summarize_memory.main([str(path)])


def test_a_device_the_snapshot_lacks_or_a_pickle_of_another_kind_is_one_line(tmp_path, capsys):
    """--device 3 on a one-device snapshot was an IndexError's traceback; a pickled list an
    AttributeError's."""
    path = tmp_path / "rank-0.pickle"
    path.write_bytes(pickle.dumps(snapshot([event("alloc", 512, 1 << 20, [])], {512: 1 << 20})))
    with pytest.raises(SystemExit) as e:
        summarize_memory.main([str(path), "--device", "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --device 3: {path} has the history of 1 device(s), 0-0")
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(SystemExit) as e:
        summarize_memory.main([str(path)])
    assert e.value.code == 2
    assert "not a memory snapshot" in capsys.readouterr().err
