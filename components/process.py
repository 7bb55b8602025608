"""The trainer process's distributed lifetime: its process group, started and torn down
(process_group), its collectives' timeouts ([comm]), a sum over its ranks (all_reduce_sum), its
exit (exit_process), and torch's deterministic mode put back when a run returns
(deterministic_mode_restored).

Leaving a process that used gloo with several ranks skips the interpreter's teardown. DTensor's
sharding caches (torch-internal, global) keep the device mesh, and through it its gloo process
groups, alive after destroy_process_group(). They are then destroyed during interpreter
finalization, where gloo intermittently aborts the process ("terminate called without an active
exception", SIGABRT): about one two-process CPU run in twenty with torch 2.13, after all the work
was done and written. Only such a process skips the teardown (os._exit), once its outputs are
flushed and closed; every other one exits normally, so atexit handlers (wandb's, a profiler's,
a user's) run.

Timeouts ([comm]): a rank that waits in a collective longer than the timeout in force raises an
error (gloo) or is aborted by NCCL's watchdog, instead of hanging. Until the first training step
is done that is init_timeout_seconds; then, with more than one rank, train_timeout_seconds
(start_train_timeout), except in the phases where ranks may wait long on one another without
anything being wrong (init_timeout_phase, back_to_init_timeout): see train.py's loop. Every
process group of the run has them: torch gives the groups a device mesh makes its backend's
default timeout (30 min on gloo, 10 on NCCL), not the default group's, so cover_new_groups sets
them after the mesh is built (parallelisms/mesh.py).

Flight recorder ([comm] trace_buf_size, save_traces_folder, save_traces_file_prefix): NCCL keeps
a record of each rank's recent collectives and, on a timeout, every rank writes its own
(record_collectives, make_traces_folder)."""

import logging
import os
import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from components.config.schema import Comm, ConfigError
from components.lock import FolderNotWritable
from components.rank_warnings import SameOnEveryRank

_several_gloo_ranks = False


@dataclass
class _Timeouts:
    """[comm]'s timeouts in this process's process groups: `current` names the key in force."""
    comm: Comm
    world: int
    device: torch.device
    current: str = "init_timeout_seconds"
    training: bool = False  # between the first step and the end of the loop
    own_timeout: set = field(default_factory=set)  # names of groups left at their own timeout


_timeouts: Optional[_Timeouts] = None


def init_distributed(device_type: str = "auto", comm: Optional[Comm] = None, dump_folder: str = ""
                     ) -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` is one process. On CUDA even one
    process gets a (single-rank) process group: FSDP then handles bf16 parameters uniformly.
    device_type is [training] device: "auto" takes CUDA when there is one. comm: [comm] (default:
    its defaults); the process group starts with init_timeout_seconds, and an NCCL one with its
    flight recorder, whose records go under dump_folder ([job] dump_folder)."""
    comm = Comm() if comm is None else comm
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[training] device = \"cuda\", but torch sees no CUDA device")
    cuda = device_type != "cpu" and torch.cuda.is_available()
    timeout = timedelta(seconds=comm.init_timeout_seconds)
    if cuda:  # NCCL's process group, made below (gloo writes no record)
        record_collectives(comm, dump_folder)
    if "RANK" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                                timeout=timeout)
        note_process_group(dist.get_backend(), dist.get_world_size())
        _start_timeouts(comm, dist.get_world_size(), device)
        return dist.get_rank(), dist.get_world_size(), device
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        _start_timeouts(comm, 1, torch.device("cuda", 0))
        return 0, 1, torch.device("cuda", 0)
    return 0, 1, torch.device("cpu")


@contextmanager
def deterministic_mode_restored() -> Iterator[None]:
    """torch's deterministic-algorithms mode as it was before the run, once the run returns: a
    caller that goes on in the same process (a notebook, a sweep calling train.main) after a
    deterministic run would otherwise have its next op without a deterministic kernel raise.
    Only this flag: the environment variables a run sets stay, since rewriting os.environ while
    gloo's threads still read it can abort the process."""
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


@contextmanager
def process_group(device_type: str = "auto", comm: Optional[Comm] = None, dump_folder: str = ""
                  ) -> Iterator[tuple[int, int, torch.device]]:
    """(rank, world size, device) of this process, in its process group (init_distributed), which
    is destroyed on the way out, after an error too: the next run in this process can start
    again. After a finished run the ranks first meet in a barrier, so that no rank tears gloo
    down while another still talks to it (seen to abort). A collective's timeout error gets a
    note naming the [comm] key that set it."""
    global _timeouts
    rank, world, device = init_distributed(device_type, comm, dump_folder)
    finished = False
    try:
        yield rank, world, device
        finished = True
    except Exception as e:
        _name_the_timeout(e)
        raise
    finally:
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
        _timeouts = None


def record_collectives(comm: Comm, dump_folder: str) -> None:
    """[comm]'s flight recorder, set as torchtitan's init_distributed sets it: environment
    variables an NCCL process group reads when it is created (so: before init_process_group).
    Its folder is made later (make_traces_folder), once the run holds its dump folder.
    trace_buf_size 0 also turns off torch's own recorder (2000 entries by default), and sets
    nothing else."""
    _set_env("TORCH_FR_BUFFER_SIZE", str(comm.trace_buf_size), older="TORCH_NCCL_TRACE_BUFFER_SIZE")
    if comm.trace_buf_size == 0:
        return
    # 1 (TearDown) aborts the communicators before the record is written (pytorch#121055); 3
    # (torch's default) ends the process all the same, without that abort.
    _set_env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    _set_env("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    _set_env("TORCH_FR_DUMP_TEMP_FILE", f"{traces_folder(comm, dump_folder)}/"
             f"{comm.save_traces_file_prefix}", older="TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # + rank


def traces_folder(comm: Comm, dump_folder: str) -> str:
    return os.path.join(dump_folder, comm.save_traces_folder)


def make_traces_folder(comm: Comm, dump_folder: str, device: torch.device) -> None:
    """The flight recorder's folder, made by every rank (nodes may not share a filesystem; NCCL
    makes none and writes no record without it) once the run holds its dump folder: a run
    refused there leaves nothing in it. Only where there is a recorder: NCCL's (CUDA)."""
    if device.type != "cuda" or comm.trace_buf_size == 0:
        return
    folder = traces_folder(comm, dump_folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise FolderNotWritable(f"[comm] save_traces_folder {folder} cannot be created "
                                f"({e.strerror}): set another --comm.save_traces_folder, or "
                                "--comm.trace_buf_size 0") from None


def _set_env(name: str, value: str, older: Optional[str] = None) -> None:
    """os.environ[name] = value. A different value the user set, under name or under the older
    name torch still reads (after name), is replaced with a warning, as torchtitan does."""
    for given in filter(None, (name, older)):
        if given in os.environ and os.environ[given] != value:
            warnings.warn(f"[comm] sets {name}={value}, replacing the environment's "
                          f"{given}={os.environ[given]}", SameOnEveryRank)
    os.environ[name] = value


def _start_timeouts(comm: Comm, world: int, device: torch.device) -> None:
    global _timeouts
    _timeouts = _Timeouts(comm, world, device)


def _groups() -> list:
    """Every process group this process belongs to (c10d's registry: the default group, the
    device mesh's, FSDP's flattened ones), less those that keep their own timeout."""
    return [group for group in list(c10d._world.pg_map)
            if group.group_name not in _timeouts.own_timeout]


# torch 2.14 made c10d's private _set_pg_timeout (gloo and NCCL; torchtitan v0.2's
# set_pg_timeouts uses it) public as dist.set_timeout, and 2.15 warns on the private name
_set_group_timeout = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout


def _set_timeout(key: str) -> None:
    """Every group's timeout to [comm] key's, on this rank (no collective): it holds for the
    collectives this rank starts from now on."""
    timeout = timedelta(seconds=getattr(_timeouts.comm, key))
    for group in _groups():
        _set_group_timeout(timeout, group)
    _timeouts.current = key


def cover_new_groups() -> None:
    """Give the process groups made since the last call the timeout in force: a device mesh's
    subgroups (new_group / split_group without a timeout get the backend's default, not the
    default group's). parallelisms/mesh.py calls it after building a mesh."""
    if _timeouts is not None:
        _set_timeout(_timeouts.current)


def keep_own_timeout(group) -> None:
    """Leave a group at the timeout it was made with: the asynchronous checkpoint's, whose
    collectives wait in the background on every rank's writes, which no phase of the training
    loop bounds (torchtitan leaves its async group at torch's default too)."""
    if _timeouts is not None:
        _timeouts.own_timeout.add(group.group_name)


def _meet() -> None:
    """A barrier under the timeout in force (torchtitan's order: no rank may start a collective
    under the shorter timeout while another is still in slow work allowed by the longer one);
    on CUDA the host then waits for it too (NCCL's barrier is a device op)."""
    dist.barrier()
    if _timeouts.device.type == "cuda":
        torch.cuda.synchronize(_timeouts.device)


def _switchable() -> bool:
    return _timeouts is not None and _timeouts.world > 1 and dist.is_initialized()


def start_train_timeout() -> None:
    """After the first training step (compilation and warm-up ran under init_timeout_seconds):
    the ranks meet, then every group takes train_timeout_seconds. Once; a single rank keeps
    the init timeout (no rank to wait for)."""
    if not _switchable() or _timeouts.training:
        return
    _meet()
    _set_timeout("train_timeout_seconds")
    _timeouts.training = True


@contextmanager
def init_timeout_phase() -> Iterator[None]:
    """The body runs under init_timeout_seconds: a phase where ranks may wait on one another
    longer than a training step's stall (a checkpoint save, an evaluation). Leaving it, the
    ranks meet under that timeout, so that none goes back to the train timeout while another is
    still in the phase's slow work. An error leaves the init timeout in place (the run ends);
    before start_train_timeout it does nothing."""
    if not (_switchable() and _timeouts.training):
        yield
        return
    _set_timeout("init_timeout_seconds")
    yield
    _meet()
    _set_timeout("train_timeout_seconds")


def back_to_init_timeout() -> None:
    """After the training loop: the end of the run (waiting for the last asynchronous save,
    rank 0 closing the metrics backends and writing the summary while the others wait in the
    final barrier) runs under init_timeout_seconds. Local: a longer timeout needs no meeting."""
    if _switchable() and _timeouts.training:
        _set_timeout("init_timeout_seconds")
        _timeouts.training = False


def _name_the_timeout(error: BaseException) -> None:
    """A note on a collective's timeout error (gloo: "Timed out waiting 2000ms for recv
    operation", NCCL: "... timeout ...") naming the [comm] key in force."""
    if not _switchable() or not isinstance(error, RuntimeError):  # DistError is one
        return
    if not re.search(r"timed out|timeout", str(error), re.IGNORECASE):
        return
    key = _timeouts.current
    seconds = getattr(_timeouts.comm, key)
    error.add_note(f"[comm] {key} = {seconds}: this rank waited that long for another in a "
                   "collective. That rank stalled or failed (its log says why); if it was only "
                   f"slow, raise [comm] {key}.")


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


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed over every rank, in place (itself with one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
