"""Where the inputs are cut into units of work (byte ranges, row groups, whole files, rows or
streamed files of a Hugging Face dataset) and which split a document goes to: what the main
process plans with before any worker starts, and all that worker.py and run.py build on."""

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from components.data.document_reader import (KINDS, document_suffix, file_type, is_compressed,
                                             refuse_compressed_twins)
from components.data.sources import splits_of


class PrepareError(ValueError):
    pass


@dataclass
class Unit:
    name: str  # "fffff-ppppp": part p of input f
    kind: str  # "jsonl" | "json" | "txt" (a whole file of paragraphs) | "parquet" | "rows" | "stream"
    #            (a compressed .jsonl/.json/.txt file is its kind, read whole)
    path: str  # the file, or the dataset's name
    start: int = 0  # jsonl: first byte; parquet: first row group; rows: first row; stream: its shard
    stop: int = 0
    size: int = 0  # bytes to read, as far as known before reading (the progress bar's)
    split: str = ""  # every document into this split (a source folder laid out in splits), or
    #                  "": each by the hash of its text (`held_out`)


def held_out(text: str, val_every: int) -> bool:
    """Validation takes the documents whose text hashes into 1/val_every of the range: copies of a
    document land in the same split, whichever units they are in."""
    if val_every < 1:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % val_every == 0


def local_files(sources: list[str], out: Path | None = None,
                left_out: list[Path] | None = None) -> list[Path]:
    """Files, folders (their files of KINDS, hidden ones left out) and globs; nothing inside
    `out`, the shard folder being written (its .json files are not sources, even when it sits in
    a source folder). left_out, when given, gets the files of other kinds in those folders and
    globs, for a note: they were left out without a word (a corpus of .jsonl.gz files too)."""
    files, others = [], []
    out = Path(out).expanduser().resolve() if out is not None else None
    for source in sources:
        expanded = os.path.expanduser(source)
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise PrepareError(f"--source {source}: no such file or folder")
        found = []
        for match in map(Path, matches):
            if match.is_dir():
                found += sorted(p for p in match.rglob("*") if p.is_file()
                                and not any(part.startswith(".") for part in p.relative_to(match).parts))
            elif document_suffix(match) or glob.has_magic(expanded):
                found.append(match)
            else:
                raise PrepareError(f"--source {source}: unsupported file type "
                                   f"{file_type(match)!r}; expected {KINDS}")
        found = [p for p in found if out is None or not p.resolve().is_relative_to(out)]
        others += [p for p in found if not document_suffix(p)]
        found = [p for p in found if document_suffix(p)]
        if not found:
            raise PrepareError(f"--source {source}: no {KINDS} files there"
                               + (f" (outside --out {out})" if out is not None else ""))
        files += found
    if left_out is not None:
        left_out += sorted(set(p.resolve() for p in others))
    files = sorted(set(p.resolve() for p in files))
    try:
        refuse_compressed_twins(files)
    except ValueError as e:
        raise PrepareError(f"--source: {e}") from None
    return files


def layout_splits(sources: list[str], files: list[Path]) -> tuple[dict[Path, str], list[Path]]:
    """({file: the split its units write}, the files left out) for the source folders laid out in
    splits as `datasets` reads them (train/, validation/, test/ or train.jsonl, ...;
    `components.data.sources.splits_of`): with a validation split, its files are the validation
    shards and the train split's are all training (nothing held out by hash); without one, the
    train split's documents are held out by hash as any source's. Other splits (test) are left
    out. A file of such a folder in none of its splits is an error. Files of other sources are
    not in the dict (split by hash)."""
    fixed, left_out = {}, []
    for source in sources:
        folder = Path(os.path.expanduser(source))
        if glob.has_magic(str(folder)) or not folder.is_dir():
            continue
        inside = [f for f in files if f.is_relative_to(folder.resolve())]
        by_split, unplaced = splits_of(folder.resolve(), inside)
        if not by_split:
            continue
        if unplaced:
            raise PrepareError(f"--source {source}: laid out in splits ({', '.join(by_split)}), but "
                               f"{unplaced[0]} is in none of them: move it into a split's folder, "
                               "or give --source one split")
        own_validation = "validation" in by_split
        for split, split_files in by_split.items():
            for f in split_files:
                if split == "train":
                    fixed[f] = "train" if own_validation else ""
                elif split == "validation":
                    fixed[f] = "validation"
                else:
                    left_out.append(f)
    return fixed, left_out


def file_units(number: int, path: Path, unit_bytes: int, split: str = "") -> list[Unit]:
    units = _file_units(number, path, unit_bytes)
    for unit in units:
        unit.split = split
    return units


def _file_units(number: int, path: Path, unit_bytes: int) -> list[Unit]:
    size = path.stat().st_size
    name = lambda part: f"{number:05d}-{part:05d}"  # noqa: E731
    kind = document_suffix(path)[1:]
    if kind == "parquet":
        import pyarrow.parquet as pq

        metadata = pq.ParquetFile(path).metadata
        units, first, gathered = [], 0, 0
        for group in range(metadata.num_row_groups):
            gathered += metadata.row_group(group).total_byte_size
            if gathered >= unit_bytes or group == metadata.num_row_groups - 1:
                units.append(Unit(name(len(units)), "parquet", str(path), first, group + 1, gathered))
                first, gathered = group + 1, 0
        return units or [Unit(name(0), "parquet", str(path), 0, 0, 0)]
    if kind == "jsonl" and not is_compressed(path):  # a compressed stream has no byte ranges
        parts = max(1, -(-size // unit_bytes))
        bounds = [size * i // parts for i in range(parts + 1)]
        return [Unit(name(i), "jsonl", str(path), bounds[i], bounds[i + 1], bounds[i + 1] - bounds[i])
                for i in range(parts)]
    return [Unit(name(0), kind, str(path), 0, size, size)]


def listing(files: list[Path]) -> dict:
    return {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def load_hf(name: str, subset: str | None, split: str, streaming: bool) -> dict:
    """{"": the split, each document into the split its hash picks}, or, where the dataset has a
    validation split of its own (and split is another), {"train": the split, "validation": that
    one}: as the trainer reads a source with one (components.data.sources)."""
    import datasets

    path = Path(name).expanduser()
    where = str(path) if path.exists() else name  # "~/data" is a local folder, not a hub name
    try:
        saved = any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))
        if path.is_dir() and saved and not streaming:  # save_to_disk's Dataset or DatasetDict
            loaded = datasets.load_from_disk(where)
            if not isinstance(loaded, datasets.DatasetDict):
                return {"": loaded}
            splits, load = list(loaded), loaded.__getitem__
        else:
            try:
                splits = datasets.get_dataset_split_names(where, subset)
            except Exception:  # unknown before loading: the load below says why, if it fails
                splits = []
            def load(split_name: str):
                return datasets.load_dataset(where, subset, split=split_name, streaming=streaming)
        if "validation" in splits and split != "validation":
            return {"train": load(split), "validation": load("validation")}
        return {"": load(split)}
    except Exception as err:
        raise PrepareError(f"--hf-dataset {name}: could not load it ({type(err).__name__}: "
                           f"{' '.join(str(err).split())})") from err


def hf_rows_or_files(dataset) -> int:
    return getattr(dataset, "num_rows", None) or dataset.num_shards


def hf_units(loaded: dict, unit_bytes: int) -> list[Unit]:
    """The units of load_hf's splits; each of a split of the dataset's own writes that split."""
    units, streams = [], 0
    for number, (split, dataset) in enumerate(loaded.items()):
        name = dataset.info.dataset_name or "dataset"
        name = f"{name} ({split})" if split else name
        if hasattr(dataset, "num_rows"):  # a map-style Dataset: ranges of rows
            rows = dataset.num_rows
            per_unit = max(1, int(rows * unit_bytes / max(dataset.data.nbytes, 1)))
            row_bytes = dataset.data.nbytes / max(rows, 1)
            units += [Unit(f"{number:05d}-{i:05d}", "rows", name, first,
                           min(first + per_unit, rows),
                           int((min(first + per_unit, rows) - first) * row_bytes), split)
                      for i, first in enumerate(range(0, rows, per_unit))]
        else:
            units += [Unit(f"{streams + i:05d}-00000", "stream", name, i, i + 1, 0, split)
                      for i in range(dataset.num_shards)]
            streams += dataset.num_shards
    return units
