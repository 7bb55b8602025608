"""Files written to outlast a kill or a power loss: each is whole or absent, never half written.

- synced: flushed and fsynced before the call returns; a kill alone cannot lose bytes the OS
  already holds, but a power loss loses what is only in its page cache.
- atomic: written to a temporary sibling, synced, and renamed over the path (os.replace), so a
  reader sees the old file or the new one. A file written inside a folder that is itself renamed
  into place as a whole (a checkpoint's step-<N>.tmp/) needs no rename of its own.
- sync_dir: a rename or a new name is an entry of its folder, which has its own fsync.

Plain Python only: scripts/lib/report.py uses it and must start without torch.
"""

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


def sync(f: IO) -> None:
    """flush() hands Python's buffer to the OS only; fsync puts it on the disk."""
    f.flush()
    os.fsync(f.fileno())


def tmp_sibling(path: Path) -> Path:
    """<path>.tmp: a leftover of a killed write is overwritten by the next one, and a folder's
    leftovers are found by their ending."""
    return path.with_name(path.name + ".tmp")


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb", *, unique: bool = False,
                encoding: str | None = None) -> Iterator[IO]:
    """A file open for writing on a temporary sibling of path: synced and renamed over path when
    the block ends, deleted when it raises. unique: a name of its own (tempfile.mkstemp, mode
    0600, still ending in .tmp) for writers that may race for the same path; else tmp_sibling."""
    path, tmp = Path(path), None
    try:
        if unique:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            tmp, f = Path(name), os.fdopen(fd, mode, encoding=encoding)
        else:
            tmp = tmp_sibling(path)
            f = open(tmp, mode, encoding=encoding)
        with f:
            yield f
            sync(f)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise


def write_synced(path: str | Path, data: bytes | str, *, atomic: bool = False) -> None:
    """data (text as UTF-8) written and synced; atomic: through atomic_open."""
    if isinstance(data, str):
        data = data.encode()
    if atomic:
        with atomic_open(path) as f:
            f.write(data)
        return
    with open(path, "wb") as f:
        f.write(data)
        sync(f)


def write_json_synced(path: str | Path, what, *, atomic: bool = False, indent: int | None = 1,
                      sort_keys: bool = False) -> None:
    """json.dumps(what) (ASCII: ensure_ascii) by write_synced; indent and sort_keys as each file
    has always been written, so its bytes do not change."""
    write_synced(path, json.dumps(what, indent=indent, sort_keys=sort_keys), atomic=atomic)


def sync_dir(path: str | Path) -> None:
    """fsync a folder, so that the renames and new names in it outlast a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
