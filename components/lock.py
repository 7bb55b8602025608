"""One run per dump folder: rank 0 holds an exclusive lock on <dump_folder>/run.lock, and on
<checkpoint folder>/run.lock when [checkpoint] folder leads out of the dump folder.

Two runs in one folder would trip over each other's `step-<N>.tmp`, interleave metrics.jsonl,
or the second would resume from the first's checkpoints. So rank 0 takes the lock before
anything is written there and holds it for the whole run; a second run stops with one line
naming the folder and the holder, on every rank.

The lock is flock(2) on the file, held by an open file: the kernel drops it when the process
ends, however it ends, so a run killed with kill -9 leaves no lock behind. The file's text
(pid, host, start time) only names the holder in the message; it is emptied when a run ends
cleanly, so text found by a run that got the lock belongs to one that was killed.

What is guaranteed where: on one host, always. Across hosts only where the filesystem passes
flock on to a lock server: NFS does (Linux clients turn it into a whole-file POSIX lock, NFSv4
natively, v3 through lockd; the lock of a client that died is freed when the server's lease runs
out, about 90 s on NFSv4), Lustre only when mounted with `-o flock` (`localflock` locks per
node). Where flock is not supported the run goes on after a warning saying it is unprotected.
"""

import json
import os
import socket
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch.distributed as dist

LOCK_FILE = "run.lock"
_held: set[int] = set()  # the descriptors of the locks this process holds


class DumpFolderInUse(RuntimeError):
    user_error = True  # one line and exit status 2 from train.py, no traceback


class FolderNotWritable(RuntimeError):
    user_error = True


def _holder(fd: int) -> str:
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet" if not text else repr(text[:200])


def acquire(folder: Path, what: str = "dump folder", key: str = "--job.dump_folder"
            ) -> Optional[int]:
    """Lock `folder` (the run's `what`, set by `key`) for this process; returns the lock's file
    descriptor (None where the filesystem cannot lock). Raises DumpFolderInUse when another
    process holds it, FolderNotWritable when it cannot be created or written (read-only)."""
    path = folder / LOCK_FILE
    if path.is_symlink():  # its holder's text would be written into, then truncate, its target
        raise FolderNotWritable(f"{what} {folder} holds {LOCK_FILE} as a symbolic link (to "
                                f"{os.readlink(path)}): remove it, or set another {key}")
    if folder.is_symlink() and not folder.exists():
        raise FolderNotWritable(f"{what} {folder} is a symbolic link to {os.readlink(folder)}, "
                                f"which does not exist: create it, or set another {key}")
    if folder.exists() and not folder.is_dir():
        raise FolderNotWritable(f"{what} {folder} is a file, not a folder: set another {key}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return lock_file(path, lambda holder: DumpFolderInUse(
            f"{what} {folder} is in use by another run ({holder}; lock file {path}): wait for "
            f"it to end or set another {key}"))
    except OSError as e:
        raise FolderNotWritable(f"{what} {folder} cannot be written ({e.strerror}: {path}): a "
                                f"run writes there; set another {key}") from None


def lock_file(path: Path, in_use: Callable[[str], Exception]) -> Optional[int]:
    """flock `path` (created if need be) for this process and write this process's pid, host
    and start time into it; returns its file descriptor (None where the filesystem cannot lock).
    Raises in_use(the holder's description) when another process holds it; warns when taking
    it over from one that ended without releasing it. Processes forked while it is held share
    the lock: they must close the descriptor (or it outlives this process)."""
    import fcntl  # POSIX only, like the rest of the trainer

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        time.sleep(0.2)  # a holder that has just started may not have written its details yet
        holder = _holder(fd)
        os.close(fd)
        raise in_use(holder) from None
    except OSError as e:
        os.close(fd)
        warnings.warn(f"cannot lock {path} ({e.strerror}): this filesystem does not support "
                      "flock, so nothing stops a second process from using the same folder")
        return None
    if os.fstat(fd).st_size:
        warnings.warn(f"taking over {path} from {_holder(fd)}, which ended without releasing it")
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _held.add(fd)
    return fd


def close_inherited() -> None:
    """In a process forked while locks were held: close its copies of their descriptors. An
    flock belongs to the open file, which a fork shares: without this a worker left alive by a
    killed parent would keep the lock, and the same command would find it held for ever."""
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


def release(fd: Optional[int]) -> None:
    if fd is not None:
        _held.discard(fd)
        os.ftruncate(fd, 0)  # emptied before unlocking: the next holder finds no stale text
        os.close(fd)


def _refuse_a_live_runs_folder(checkpoints: Path, own: Optional[Path] = None) -> None:
    """A checkpoint folder inside another run's dump folder (its default <dump>/checkpoint, say)
    is that run's, whose lock covers its dump folder only: while it runs, this one would commit
    into its folder and prune its steps. Probed with a shared lock, which writes nothing (a
    finished run's folder may be read, e.g. to resume its checkpoints from a new dump folder).
    own: this run's dump folder, where the checkpoint folder lies inside it: the folders from
    the checkpoint folder up to it (itself left out) are probed, those above are not this
    run's concern (runs may be nested in a parent run's dump folder, their checkpoints apart)."""
    import fcntl

    resolved = checkpoints.resolve()
    if own is None:
        probed = list(resolved.parents)
    else:
        own = own.resolve()
        probed = [p for p in (resolved, *resolved.parents) if p.is_relative_to(own) and p != own]
    for parent in probed:
        try:
            fd = os.open(parent / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DumpFolderInUse(f"checkpoint folder {checkpoints} lies in the dump folder "
                                  f"{parent} of a run in progress ({_holder(fd)}): wait for it to "
                                  "end or set another --checkpoint.folder") from None
        except OSError:
            pass  # a filesystem without flock: acquire() warns about it
        finally:
            os.close(fd)


def _refuse_a_file_on_the_way(checkpoints: Path, own: Path) -> None:
    """The checkpoint folder inside the dump folder is made at the first save, hours in: a file
    at its path (or above it) is a config error now, not a traceback then."""
    checkpoints, own = checkpoints.resolve(), own.resolve()
    for part in (checkpoints, *checkpoints.parents):
        if part == own or not part.is_relative_to(own):
            break
        if part.exists() and not part.is_dir():
            raise FolderNotWritable(f"checkpoint folder {checkpoints} cannot be made: {part} is a "
                                    "file; set another --checkpoint.folder")


@contextmanager
def dump_folder_lock(folder: str | Path, rank: int, checkpoint_folder: str | Path | None = None
                     ) -> Iterator[None]:
    """Held by rank 0 for the body; every rank raises if rank 0 could not take it (one
    broadcast, so no rank is left waiting in a collective). checkpoint_folder ([checkpoint]
    folder; None: the run saves none) is locked too where it resolves outside the dump folder
    (another filesystem): two runs with their own dump folders would otherwise commit into
    one and move each other's steps aside."""
    locks = {Path(folder): ("dump folder", "--job.dump_folder")}
    checkpoints = own = None
    if checkpoint_folder is not None:
        checkpoints = Path(folder) / checkpoint_folder
        if checkpoints.resolve().is_relative_to(Path(folder).resolve()):
            own = Path(folder)  # a run nested inside this one's dump folder may hold part of it
        else:
            locks[checkpoints] = ("checkpoint folder", "--checkpoint.folder")
    fds, error = [], None
    if rank == 0:
        try:
            if own is not None:
                _refuse_a_file_on_the_way(checkpoints, own)
            if checkpoints is not None:
                _refuse_a_live_runs_folder(checkpoints, own)
            for path, (what, key) in locks.items():
                fds.append(acquire(path, what, key))
        except Exception as e:  # in use, or the folder cannot be created
            error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        message = [str(error) if error else None]
        dist.broadcast_object_list(message, src=0)
        if message[0] and error is None:
            raise DumpFolderInUse(message[0])
    try:
        if error is not None:
            raise error
        yield
    finally:
        for fd in fds:
            release(fd)
