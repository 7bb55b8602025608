"""The trainer process's distributed lifetime: its process group, started and torn down
(process_group), and its exit (exit_process).

Leaving a process that used gloo with several ranks skips the interpreter's teardown. DTensor's
sharding caches (torch-internal, global) keep the device mesh, and through it its gloo process
groups, alive after destroy_process_group(). They are then destroyed during interpreter
finalization, where gloo intermittently aborts the process ("terminate called without an active
exception", SIGABRT): about one two-process CPU run in twenty with torch 2.13, after all the work
was done and written. Only such a process skips the teardown (os._exit), once its outputs are
flushed and closed; every other one exits normally, so atexit handlers (wandb's, a profiler's,
a user's) run."""

import logging
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from components.config.schema import ConfigError

_several_gloo_ranks = False


def init_distributed(device_type: str = "auto") -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` is one process. On CUDA even one
    process gets a (single-rank) process group: FSDP then handles bf16 parameters uniformly.
    device_type is [training] device: "auto" takes CUDA when there is one."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[training] device = \"cuda\", but torch sees no CUDA device")
    cuda = device_type != "cpu" and torch.cuda.is_available()
    if "RANK" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        note_process_group(dist.get_backend(), dist.get_world_size())
        return dist.get_rank(), dist.get_world_size(), device
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        return 0, 1, torch.device("cuda", 0)
    return 0, 1, torch.device("cpu")


@contextmanager
def process_group(device_type: str = "auto") -> Iterator[tuple[int, int, torch.device]]:
    """(rank, world size, device) of this process, in its process group (init_distributed), which
    is destroyed on the way out, after an error too: the next run in this process can start
    again. After a finished run the ranks first meet in a barrier, so that no rank tears gloo
    down while another still talks to it (seen to abort)."""
    rank, world, device = init_distributed(device_type)
    finished = False
    try:
        yield rank, world, device
        finished = True
    finally:
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def note_process_group(backend: str, world_size: int) -> None:
    """Record a process group this process created: a gloo group of more than one rank makes
    exit_process() skip the interpreter's teardown."""
    global _several_gloo_ranks
    _several_gloo_ranks |= backend == "gloo" and world_size > 1


def exit_process(code: int) -> None:
    """sys.exit(code), or os._exit(code) after the streams are flushed when this process used
    gloo with several ranks (see the module's docstring)."""
    if not _several_gloo_ranks:
        sys.exit(code)
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
