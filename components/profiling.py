"""Optional profiling, per rank: torch.profiler traces of one step every `profile_freq` steps
(`enable_profiling`), and CUDA memory snapshots (`enable_memory_snapshot`): the allocator's
history of allocations and frees with their Python stacks, dumped every `profile_freq` steps and
when the step runs out of memory (`scripts/bench/summarize_memory.py` reads them)."""

import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from components.config.schema import Profiling

# Recorded allocator events kept (a ring: the oldest go first), torchtitan's number. Each holds
# its Python stack, a few kB of host memory and of every dump, which holds them all.
MAX_MEMORY_EVENTS = 100_000


class MemorySnapshots:
    """Records the CUDA caching allocator's history from construction; `dump` writes it to
    <folder>/<name>/rank-<r>.pickle (torch.cuda.memory._dump_snapshot's format, which
    https://pytorch.org/memory_viz also opens)."""

    def __init__(self, folder: Path, rank: int):
        self.folder, self.rank = folder, rank
        torch.cuda.memory._record_memory_history(max_entries=MAX_MEMORY_EVENTS, stacks="python")

    def dump(self, name: str) -> Path:
        out = self.folder / name
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank-{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def close(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


def profiled(step: int, freq: int) -> bool:
    """Whether training step `step` is traced and its memory dumped: the multiples of freq,
    counted from the run's step 1, across resumes."""
    return step % freq == 0


class Profilers:
    """What the training loop calls once per step: `step(step)` after each optimizer step."""

    def __init__(self, trace: Optional[Callable[[int], None]],
                 memory: Optional[MemorySnapshots], freq: int):
        self.trace, self.memory, self.freq = trace, memory, freq
        self.last_step: Optional[int] = None

    def step(self, step: int) -> None:
        self.last_step = step
        if self.trace is not None:
            self.trace(step)
        if self.memory is not None and profiled(step, self.freq):
            self.memory.dump(f"step-{step}")


@contextmanager
def maybe_profile(cfg: Profiling, dump_folder: Path, rank: int, device: torch.device,
                  log: Callable[[str], None], first_step: int = 1,
                  last_step: Optional[int] = None):
    """Yields a `Profilers`, or None when nothing is asked for. A Chrome trace per profiled step
    goes to <dump_folder>/<save_traces_folder>/step-<N>/rank-<r>.json (open in Perfetto), memory
    snapshots to <dump_folder>/<save_memory_snapshot_folder>/step-<N>/ and, on running out of
    memory, oom-step-<N>/. first_step: the run's first step in this process (a resumed run's is
    the checkpoint's step + 1); last_step: its last, where known (a run none of whose steps is
    profiled says so)."""
    if not (cfg.enable_profiling or cfg.enable_memory_snapshot):
        yield None
        return
    first_profiled = -(-first_step // cfg.profile_freq) * cfg.profile_freq  # `profiled`'s steps
    if last_step is not None and first_step <= last_step < first_profiled:
        log(f"warning: [profiling] profile_freq = {cfg.profile_freq}: no step of this run "
            f"({first_step} to {last_step}) is a multiple of it, so nothing is profiled")
    with ExitStack() as stack:
        trace = memory = None
        if cfg.enable_profiling:
            trace = stack.enter_context(_trace_profiler(cfg, Path(dump_folder), rank, first_step))
        if cfg.enable_memory_snapshot and device.type != "cuda":
            log(f"warning: [profiling] enable_memory_snapshot records CUDA memory, and this run is "
                f"on the {device.type}: no snapshot is written")
        elif cfg.enable_memory_snapshot:
            memory = MemorySnapshots(Path(dump_folder) / cfg.save_memory_snapshot_folder, rank)
            stack.callback(memory.close)
        profilers = Profilers(trace, memory, cfg.profile_freq)
        try:
            yield profilers
        except torch.OutOfMemoryError:
            if memory is not None:
                step = first_step if profilers.last_step is None else profilers.last_step + 1
                log(f"out of memory: snapshot of step {step} in "
                    f"{memory.dump(f'oom-step-{step}').parent}")
            raise


@contextmanager
def _trace_profiler(cfg: Profiling, folder: Path, rank: int, first_step: int):
    """Yields the call that ends each training step, given its number: torch.profiler recording
    the steps that are multiples of profile_freq (after a warm-up step where profile_freq >= 2),
    each saved as step-<its training step>/. torch numbers steps from this process's first, 0,
    which after a resume is not the run's step 1: its count is set to the training step, at the
    start and as each step ends, so the schedule, the saved folders and the ProfilerStep#<N>
    marks go by the training step. Leaving the loop ends whatever it had begun: a warm-up
    (nothing of a step) or a step the run gave up in; no trace is written then."""
    out_folder = folder / cfg.save_traces_folder
    freq = cfg.profile_freq
    warmup = min(1, freq - 1)  # every step (profile_freq 1) leaves none to warm up
    leaving, ended, failed = False, 0, None
    action = torch.profiler.ProfilerAction

    def schedule(step: int):
        step = step or first_step  # torch asks about its step 0 before it is told the first
        if profiled(step, freq):
            return action.RECORD_AND_SAVE
        return action.WARMUP if step % freq >= freq - warmup else action.NONE

    def save(prof):
        nonlocal failed
        if leaving or not profiled(ended, freq):
            return
        # Raised out of prof.step(), an error leaves torch's profiler between two states, and
        # the profiler's exit then kills the process (SIGSEGV, no message): step() raises it.
        try:
            out = out_folder / f"step-{ended}"
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / f"rank-{rank}.json"))
        except Exception as e:
            failed = e

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities, on_trace_ready=save, schedule=schedule)
    prof.step_num = first_step  # the first ProfilerStep# mark
    with prof:
        def step(training_step: int) -> None:
            nonlocal ended
            ended = prof.step_num = training_step  # prof.step() asks the schedule about + 1
            # torch warns that a cycle's trace holds that cycle's steps only: the one step asked
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Warning: Profiler clears events")
                prof.step()
            if failed is not None:
                raise failed

        try:
            yield step
        finally:
            leaving = True
