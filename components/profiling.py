"""Optional torch.profiler traces: one active step every `profile_freq` steps, per rank."""

from contextlib import contextmanager
from pathlib import Path

import torch

from components.config.schema import Profiling


@contextmanager
def maybe_profile(cfg: Profiling, dump_folder: Path, rank: int):
    """Yields an object with .step(); a Chrome trace per profiled step goes to
    <dump_folder>/<save_traces_folder>/step-<N>/rank-<r>.json (open in Perfetto)."""
    if not cfg.enable_profiling:
        yield None
        return
    folder = Path(dump_folder) / cfg.save_traces_folder

    def save(prof):
        out = folder / f"step-{prof.step_num}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank-{rank}.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    wait = max(0, cfg.profile_freq - 2)
    with torch.profiler.profile(activities=activities, on_trace_ready=save,
                                schedule=torch.profiler.schedule(wait=wait, warmup=1, active=1)) as prof:
        yield prof
