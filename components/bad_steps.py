"""Non-finite steps: counted on the device without a host sync, and the [training] nan_policy
decision taken on log steps."""

from typing import Callable

import torch
import torch.distributed as dist

from components.config.schema import Training


class BadSteps:
    """Steps with a non-finite loss or gradient norm, counted on the device: update() runs every
    step without a host sync, read() only on log steps, where the loop syncs anyway. Counts since
    the last read(): bad steps, the longest run of consecutive ones (a run that goes on across a
    read counts whole) and the first one's step; and bad steps since the start of this process.
    The ranks' counts are combined (max), so every rank takes the same decision."""

    def __init__(self, device, start_step: int):
        zero = lambda: torch.zeros((), dtype=torch.long, device=device)  # noqa: E731
        self.run, self.longest_run, self.since_read, self.first, self.total = (
            zero(), zero(), zero(), zero(), zero())
        self.read_after = start_step - 1  # the host's step of the last read

    def update(self, bad: torch.Tensor, step: int) -> None:
        self.run = (self.run + 1) * bad
        self.longest_run = torch.maximum(self.longest_run, self.run)
        self.since_read = self.since_read + bad
        self.first = torch.where(bad & (self.first == 0), step, self.first)
        self.total = self.total + bad

    def read(self, step: int) -> dict:
        values = torch.stack([self.since_read, self.longest_run, self.first, self.total])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        values = values.tolist()
        self.since_read = torch.zeros_like(self.since_read)
        self.first = torch.zeros_like(self.first)
        self.longest_run = self.run.clone()
        counts = dict(zip(("since_read", "longest_run", "first", "total"), values))
        first_step = self.read_after + 1
        counts["steps"] = f"{first_step}-{step}" if step > first_step else str(step)
        self.read_after = step
        return counts


def too_many_bad_steps(bad: dict, step: int, training: Training,
                       log: Callable[[str], None]) -> bool:
    """[training] nan_policy: "stop" after any non-finite step, "skip" once max_bad_steps came in
    a row. Non-finite steps never update the weights, so no checkpoint holds a NaN; the run stops
    at the first log step after them (checkpoint steps are log steps) without saving there."""
    if not bad["since_read"]:
        return False
    policy, limit = training.nan_policy, training.max_bad_steps
    what = (f"{bad['since_read']} of steps {bad['steps']} had a non-finite loss or gradient norm "
            f"(the first: step {bad['first']})")
    if policy == "stop" or bad["longest_run"] >= limit:
        log(f"stopping at step {step} without saving: {what} ([training] nan_policy = {policy!r}"
            + (")" if policy == "stop" else f", {bad['longest_run']} in a row, max_bad_steps = "
               f"{limit})"))
        return True
    log(f"warning: {what}; their optimizer steps were skipped ({bad['total']} in this run)")
    return False
