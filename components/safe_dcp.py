"""Reading DCP checkpoints without running code from them.

DCP (torch 2.11 to 2.13 at least) reads a checkpoint's `.metadata` with plain `pickle.load`, and
the non-tensor entries of a state dict (the optimizer's param_groups) with
`torch.load(weights_only=False)`: a planted file runs code on load. DCP offers no weights-only
path for either, so:

- SafeReader reads `.metadata` with an unpickler that admits only DCP's metadata classes (those
  of torch.distributed.checkpoint.metadata, the filesystem's _StorageInfo), torch.Size, dtypes,
  layouts and plain containers; any other global is refused before it is looked up;
- SafeLoadPlanner first reads each non-tensor entry with `torch.load(weights_only=True)`, which
  admits plain data only, and hands it on to DCP only when that succeeded.
Tensors are read by DCP itself with `weights_only=True` already.
"""

import inspect
import io
import pickle
import re
from pathlib import Path, PurePosixPath

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

METADATA = ".metadata"
# Globals that a DCP .metadata names besides the classes of torch.distributed.checkpoint.metadata.
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a dict lookup of torch's layouts by name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # Python 3.13's home
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names something other than plain data: not loaded."""


class DamagedCheckpointError(ValueError):
    """A checkpoint file cannot be read (cut short, emptied, overwritten): the message names it."""


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if inspect.isclass(found) and found.__module__ == module:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def read_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """A checkpoint folder's DCP metadata, read without running code; a clear error naming the
    file when it is missing, damaged or names anything but DCP's metadata classes."""
    file = Path(path) / METADATA
    try:
        data = file.read_bytes()
    except OSError as e:
        raise FileNotFoundError(f"{file}: cannot read it ({e.strerror})") from e
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsafeCheckpointError(
            f"{file} names {e}, which is not one of DCP's metadata classes: not loading it, since "
            "unpickling it could run code (DCP never writes such a file)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError) as e:
        raise DamagedCheckpointError(f"{file} is damaged ({type(e).__name__}: "
                                     f"{e or 'cut short'}): not a DCP metadata file") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise DamagedCheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    # DCP joins these to the folder as they are: an absolute or ../ path reads any file
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or PurePosixPath(where).is_absolute() \
                or ".." in PurePosixPath(where).parts:
            raise UnsafeCheckpointError(
                f"{file} points tensor reads at {where!r}, outside {Path(path)}: not loading it "
                "(DCP writes only names of files in the checkpoint folder)")
        # a data file replaced by a symbolic link leads out of the folder the same way (the
        # folder itself may be a link: a step folder moved and linked back)
        target = Path(path) / where
        if target.is_symlink() and Path(path).resolve() not in target.resolve().parents:
            raise UnsafeCheckpointError(
                f"{target} is a symbolic link to {target.resolve()}, outside {Path(path)}: not "
                "loading it (DCP writes the files of the checkpoint folder)")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's filesystem reader, reading `.metadata` through read_metadata() above."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # a per-rank metadata file: not what this trainer writes
            raise ValueError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def names_a_global(error: BaseException) -> bool:
    """Whether torch.load(weights_only=True) refused a pickle for what it names (a planted
    object), rather than for being damaged (cut short, garbled). torch 2.11-2.13 word it as
    "Unsupported global: GLOBAL x", "unsupported GLOBAL x whose module m is blocked" (os,
    subprocess, ...) or "... allowlisted via `add_safe_globals`"."""
    return isinstance(error, pickle.UnpicklingError) and bool(re.search(
        r"unsupported (global|class)|not an allowed global|unrecognized function|allowlisted",
        str(error), re.IGNORECASE))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing non-tensor entries that are not plain data."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            what = f"entry {read_item.dest_index.fqn} of the checkpoint"
            if not names_a_global(e):
                raise DamagedCheckpointError(f"{what} is damaged ({type(e).__name__})") from None
            raise UnsafeCheckpointError(
                f"{what} holds objects other than plain data: not loading it, since unpickling "
                "them could run code") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def load(state: dict, path: str | Path, no_dist: bool, planner=None) -> None:
    """dcp.load of `state` from the checkpoint folder `path`, running no code from it. DCP's
    errors (a CheckpointException of many lines per rank) become one naming what is wrong."""
    read_metadata(path)  # its refusals keep their type: DCP turns them into an AssertionError
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=planner or SafeLoadPlanner(),
                 no_dist=no_dist)
    except dcp.CheckpointException as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        for cause in causes:
            if isinstance(cause, (UnsafeCheckpointError, KeyboardInterrupt)):
                raise cause from None
        cause = causes[0] if causes else e
        raise DamagedCheckpointError(f"{path}: reading the checkpoint failed "
                                     f"({_why(path, cause)})") from e


def _why(path: str | Path, cause: BaseException) -> str:
    """The damaged files (shorter than .metadata says), else the error's last line."""
    try:
        metadata = read_metadata(path)
        short = sorted({info.relative_path for info in (metadata.storage_data or {}).values()
                        if not (Path(path) / info.relative_path).is_file()
                        or (Path(path) / info.relative_path).stat().st_size
                        < info.offset + info.length})
    except (OSError, ValueError, AttributeError, TypeError):
        short = []
    if short:
        return (f"{', '.join(str(Path(path) / s) for s in short)} missing or shorter than its "
                "metadata says: damaged")
    last = (str(cause).strip().splitlines() or [""])[-1]
    return f"{type(cause).__name__}: {last}" if last else type(cause).__name__
