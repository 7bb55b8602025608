"""Checksums of a checkpoint's files: written as it is saved, checked before it is loaded, so a
damaged file (a bad disk, a copy cut short, bytes overwritten) is found and named instead of
resuming into NaNs.

`checksums.json` in a step folder lists every file the save wrote (DCP's `.distcp` files and
`.metadata`, the rank files, train_state.json, config.toml) with its size and hash: xxh3-64
(xxhash, which `datasets` installs; about 10 GB/s) or else zlib's crc32 (about 2 GB/s). Each
rank hashes the files it wrote, right after writing them (DCP's write_data, so they are read
back from the page cache) into `checksums-rank-<r>.json`; DCP gathers every rank's write
results before it writes `.metadata`, so the coordinator finds them all there when it merges
them into checksums.json (DCP's finish), before the checkpoint is committed. The ranks check a
share of the files each when loading, in chunks, and agree on what they found. Its files are
synced but not renamed into place (components/synced_files.py): they are written inside
step-<N>.tmp/, which is renamed as a whole.
"""

import json
import zlib
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from components.synced_files import write_json_synced

MANIFEST = "checksums.json"
CHUNK = 16 << 20

try:
    import xxhash
except ImportError:  # crc32 then: slower, as good against damage
    xxhash = None


def _crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _xxh3(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


HASHES: dict[str, Callable[[Path], str]] = {"crc32": _crc32}
if xxhash is not None:
    HASHES["xxh3_64"] = _xxh3
ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"


def _entries(folder: Path, names: Iterable[str]) -> dict[str, list]:
    return {name: [(folder / name).stat().st_size, HASHES[ALGORITHM](folder / name)]
            for name in sorted(set(names))}


def write_manifest(folder: Path, names: Optional[Iterable[str]] = None) -> None:
    """checksums.json for `names` (default: every file in the folder but the manifest)."""
    folder = Path(folder)
    if names is None:
        names = [p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST]
    write_json_synced(folder / MANIFEST, {"algorithm": ALGORITHM,
                                          "files": _entries(folder, names)}, sort_keys=True)


class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's filesystem writer that leaves checksums.json beside what it wrote. own_files: the
    files this rank wrote into the folder before DCP's save (its rank file, ...). on_cpu: the
    state is on the CPU, so DCP's copy-ahead loader, which makes a CUDA stream wherever CUDA is
    present, stays off: a CPU run on a GPU host would otherwise put a CUDA context on GPU 0 in
    every rank at each save, and fail there when that GPU is full."""

    def __init__(self, path: Path, rank: int, own_files: Iterable[str], on_cpu: bool = False):
        super().__init__(str(path), **({"per_thread_copy_ahead": 0} if on_cpu else {}))
        self.folder = Path(path)
        self.checksum_rank = rank
        self.own_files = list(own_files)

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)  # a future DCP completed already
        results = written.wait()
        names = {result.storage_data.relative_path for result in results} | set(self.own_files)
        write_json_synced(self.folder / f"checksums-rank-{self.checksum_rank}.json",
                          _entries(self.folder, names), sort_keys=True)
        return written

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)  # writes .metadata
        files = _entries(self.folder, [".metadata"])
        for rank in range(len(results)):
            partial = self.folder / f"checksums-rank-{rank}.json"
            files.update(json.loads(partial.read_text()))
        write_json_synced(self.folder / MANIFEST, {"algorithm": ALGORITHM, "files": files},
                          sort_keys=True)
        for rank in range(len(results)):
            (self.folder / f"checksums-rank-{rank}.json").unlink()


def find_damage(folder: Path, rank: int = 0, world: int = 1,
                names: Optional[Iterable[str]] = None, ignore: Iterable[str] = ()) -> Optional[str]:
    """What is wrong with a checkpoint folder, naming the file, or None when every file listed
    in its checksums.json (or those of `names`, less those of `ignore`) is there, of its size
    and hash. A folder without one passes if it was written before checksums were. With
    world > 1 every rank calls it: each hashes a share of the files and they agree (one
    all_gather_object)."""
    problems = _problems(Path(folder), rank, world, names, set(ignore))
    if world > 1 and dist.is_initialized():
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = sorted({p for found in everyone for p in found})
    return problems[0] if problems else None


def _checksummed(folder: Path) -> bool:
    """Whether the save wrote checksums.json: the tokenizer record in train_state.json came with
    them (the same release), so without it a lost manifest would pass as an older checkpoint."""
    try:
        state = json.loads((folder / "train_state.json").read_text())
    except (OSError, ValueError):
        return False  # none (another trainer's weights), or damaged: the load names it
    return isinstance(state, dict) and "tokenizer" in state


def _problems(folder: Path, rank: int, world: int, names: Optional[Iterable[str]],
              ignore: set[str]) -> list[str]:
    path = folder / MANIFEST
    if not path.is_file():
        return [f"{path} is missing (the save wrote one: its train_state.json records the "
                "tokenizer, as only saves since checksums do)"] if _checksummed(folder) else []
    try:
        manifest = json.loads(path.read_text())
        listed = {name: (int(size), str(digest))
                  for name, (size, digest) in manifest["files"].items()}
        algorithm = manifest["algorithm"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{path} is damaged ({type(e).__name__}: {e})"]
    # the save lists the files of its own folder by name: a path ("../x", "/etc/x") would have
    # the check read, and its message tell the size of, a file outside the checkpoint
    outside = sorted(name for name in listed if Path(name).name != name or name in ("", ".", ".."))
    if outside:
        return [f"{path} is damaged (it names {outside[0]!r}, not a file of this folder)"]
    if algorithm not in HASHES:  # xxhash missing here: the sizes are checked still
        algorithm = None
    wanted = sorted((set(listed) if names is None else set(names) & set(listed)) - ignore)
    problems = []
    for i, name in enumerate(wanted):
        file, (size, digest) = folder / name, listed[name]
        if not file.is_file():
            problems.append(f"{file} is missing (the save wrote it)")
        elif file.stat().st_size != size:
            problems.append(f"{file} has {file.stat().st_size} bytes, {size} when it was written")
        elif algorithm is not None and i % world == rank and HASHES[algorithm](file) != digest:
            problems.append(f"{file} does not match its checksum: damaged since it was written")
    return problems
