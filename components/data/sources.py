"""Text documents: from the embedded stdlib corpus, local files (checked by checks.py) or a
Hugging Face Hub dataset, loaded with Hugging Face `datasets`, and split into train and
validation.

Document i of the source is held out for validation when i % val_every == 0 (unless the source
has a real validation split), with and without streaming, so a run reads the same documents
either way. windows.py frames and cuts them into windows.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from components.data import SPLITS
from components.data.checks import VARIED, MissingTextField, check_dataset, check_files
from components.data.document_reader import (KINDS, document_suffix, file_type,
                                             refuse_compressed_twins, some_files)
from components.synced_files import atomic_open

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/flce-recipes"
BUILDER_BY_SUFFIX = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}

STDLIB_CORPUS_BYTES = 6 * 2**20
# Tests and test data are skipped because they are full of deliberately odd code and binary-ish fixtures;
# idlelib, turtledemo and lib2to3 are applications or legacy tools rather than library code.
STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                                 "turtledemo", "lib2to3", "__pycache__"})

if TYPE_CHECKING:
    import datasets

    Documents = datasets.Dataset | datasets.IterableDataset


def embedded_corpus(cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """A JSON-lines corpus of this Python's standard library sources: every machine with the same Python
    version builds the same file without a download."""
    cache_dir = Path(cache_dir).expanduser()
    path = cache_dir / f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}.jsonl"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Several ranks may build it at once: each writes its own temporary file and the rename is atomic,
    # so no reader ever sees half a corpus.
    with atomic_open(path, "w", unique=True, encoding="utf-8") as f:
        for relative_path, text in _stdlib_sources():
            f.write(json.dumps({"text": text, "path": relative_path}, ensure_ascii=False) + "\n")
    return path


def _stdlib_sources() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # os.walk rather than rglob, so the skipped directories (site-packages is huge) are never entered.
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in STDLIB_SKIPPED_DIRS]
        for name in names:
            if name.endswith(".py"):
                file = Path(directory, name)
                files.append((file.relative_to(root).as_posix(), file))
    total_bytes = 0
    for relative_path, file in sorted(files):
        try:
            data = file.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():  # empty __init__.py files would only add bos/eos pairs
            continue
        if total_bytes + len(data) > STDLIB_CORPUS_BYTES:
            return
        total_bytes += len(data)
        yield relative_path, text


def load_documents(source: str, split: str, text_field: str = "text", streaming: bool = False,
                   val_every: int = 100, cache_dir: str | Path = DEFAULT_CACHE_DIR,
                   on_bad_document: str = "error") -> Documents:
    """source: "stdlib", a local .txt/.jsonl/.json/.parquet file (the first three also compressed:
    .gz, .bz2, .xz) or a directory of them (its other files are named in a warning and left
    out), or a Hugging Face Hub dataset name (needs network access). A .txt file gives one
    document per paragraph (blank-line separated, as it is); a paragraph of only whitespace is
    layout, not a document (checks.py leaves it out). split: "train" or "validation", or another
    split the source really has.
    on_bad_document: what a document of a local .jsonl/.json/.txt/.parquet file that is not UTF-8,
    not JSON or without text, or a row of a Hub dataset without text, does: "error" names it,
    "skip" leaves it out with a warning."""
    if val_every < 0 or val_every == 1:
        raise ValueError(f"val_every={val_every}: must be 0 (none held out) or >= 2 (1 would "
                         "hold out every document)")
    cache_dir = Path(cache_dir).expanduser()
    splits, by_name = _load_splits(source, streaming, cache_dir, text_field, on_bad_document)

    def pick(name: str) -> Documents:
        # Local files were checked by check_files; a dataset loaded by name is checked here, the
        # split it has (validation is held out after), so that rows are named as it numbers them.
        if not by_name:
            return splits[name]
        return check_dataset(splits[name], f"{source}, split {name!r}", text_field, on_bad_document)

    documents = _pick_split(splits, split, val_every, source, pick)
    columns = documents.column_names  # None for some streams; then TokenWindows checks the first document
    if columns is not None and text_field not in columns:
        raise MissingTextField(f"{source}: the documents have no field {text_field!r} (their fields: "
                               f"{', '.join(columns)})")
    return documents


def _load_splits(source: str, streaming: bool, cache_dir: Path, text_field: str, on_bad_document: str):
    """The source's splits, and whether `datasets` loaded it by name (unchecked so far)."""
    if source == "stdlib":
        return _load_local([embedded_corpus(cache_dir)], streaming, cache_dir), False
    path = Path(source).expanduser()
    if path.exists():
        origins = {}
        by_split = {split: check_files(files, text_field, on_bad_document, cache_dir, origins)
                    for split, files in split_files(path).items()}
        return _load_local(by_split, streaming, cache_dir, text_field, origins), False
    if source.startswith(("/", "./", "../", "~")) or document_suffix(path):
        raise FileNotFoundError(f"data source not found: {path}")
    import datasets
    try:
        return datasets.load_dataset(source, streaming=streaming), True
    except Exception as err:
        raise ValueError(
            f"could not load data source {source!r}: it is not a local path, and loading it as a Hugging "
            f"Face Hub dataset failed ({type(err).__name__}: {err}). Hub names need network access (or the "
            f"dataset already in the local HF cache); offline, use a local .jsonl/.json/.txt/.parquet file "
            f"or directory, or \"stdlib\"") from err


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        if not document_suffix(path):
            raise ValueError(f"{path}: unsupported file type {file_type(path)!r}; expected "
                             f"{KINDS}")
        return [path]
    _refuse_saved_dataset(path)
    # Hidden directories hold caches and VCS data, not documents.
    found = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    files = [p for p in found if document_suffix(p)]
    _refuse_shard_folders(path, files)
    others = [p for p in found if not document_suffix(p)]
    if not files:
        raise FileNotFoundError(f"{path}: no {KINDS} files in this directory"
                                + (f" (it holds {some_files(others, path)})" if others else ""))
    if others and path not in _noted:  # each split of the source is loaded apart
        _noted.add(path)
        logger.warning("data: %s: leaving out %d file(s) of other kinds than %s: %s", path,
                       len(others), KINDS, some_files(others, path))
    refuse_compressed_twins(files)
    first_of = {}  # builder: its first file
    for p in files:
        first_of.setdefault(BUILDER_BY_SUFFIX[document_suffix(p)], p)
    if len(first_of) > 1:
        suffixes = sorted({file_type(p) for p in files})
        raise ValueError(f"{path}: mixes file types {', '.join(suffixes)} "
                         f"({', '.join(str(p) for p in first_of.values())}); one directory must "
                         "hold one kind")
    return files


_noted: set[Path] = set()  # folders whose other files this process has named


def splits_of(folder: Path, files: list[Path]) -> tuple[dict[str, list[Path]], list[Path]]:
    """({split: its files}, the files in none) of files under folder, by the splits the folder's
    layout names as `datasets` finds them (train/, validation/, test/ folders, or train.jsonl,
    validation.jsonl, ... files, and their other names: `datasets.data_files.get_data_patterns`);
    ({}, files) where it names none that holds one of them."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
    try:
        patterns = get_data_patterns(str(folder))
    except EmptyDatasetError:
        return {}, list(files)
    if {str(k): v for k, v in patterns.items()} == {"train": ["**"]}:
        return {}, list(files)
    resolved = DataFilesDict.from_patterns(patterns, base_path=str(folder))
    ours = {f.resolve(): f for f in files}
    by_split = {str(split): [ours[f] for f in sorted({Path(u).resolve() for u in found} & set(ours))]
                for split, found in resolved.items()}
    by_split = {split: found for split, found in by_split.items() if found}
    placed = {f for found in by_split.values() for f in found}
    return by_split, [f for f in files if f not in placed]


def split_files(path: Path) -> dict[str, list[Path]]:
    """A local source's files by split. A folder laid out in splits (`splits_of`) keeps them
    apart: its validation split is the validation documents, and its test split is never
    trained on (they went into one training corpus before). Any other source is one "train"
    split. A file such a layout leaves in no split is an error, not left out unsaid."""
    files = _data_files(path)
    if path.is_file():
        return {"train": files}
    by_split, unplaced = splits_of(path, files)
    if not by_split:
        return {"train": files}
    if unplaced:
        more = f" (and {len(unplaced) - 1} more)" if len(unplaced) > 1 else ""
        raise ValueError(f"{path}: laid out in splits ({', '.join(by_split)}), but {unplaced[0]} "
                         f"is in none of them{more}: move it into a split's folder, or point "
                         "[data] source at one split")
    return by_split


def _refuse_saved_dataset(path: Path) -> None:
    """A save_to_disk folder holds Arrow files and JSON metadata: read as a folder of data files,
    its dataset_info.json was the first "document", and invalid."""
    saved = (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file() and (
        (path / "state.json").is_file() or any(path.glob("data-*.arrow")))
    if saved:
        raise ValueError(f"{path}: a dataset saved with datasets' save_to_disk, not a folder of "
                         f"{KINDS} files; tokenize it into token shards with "
                         f"`python3 -m scripts.prepare_data --hf-dataset {path} --tokenizer TOKENIZER "
                         "--out SHARDS` and set [data] source = SHARDS")


class UnreadableFiles(ValueError):
    user_error = True  # one line and exit status 2 from train.py, no traceback


def _refuse_shard_folders(path: Path, files: list[Path]) -> None:
    """Token shard folders (scripts.prepare_data's) inside a folder read as text: their
    index.json was read as a document, and named as invalid JSON to skip."""
    from components.data.shards import INDEX, PLAN
    shards = sorted({f.parent for f in files if f.name in (INDEX, PLAN) and _written_by_prepare(f)})
    if not shards:
        return
    text = [f for f in files if not any(f.is_relative_to(folder) for folder in shards)]
    shown = [str(folder) for folder in shards[:4]]
    weights = ",".join(f"{folder}:1" for folder in shown)
    more = ", ..." if len(shards) > 4 else ""
    raise ValueError(f"{path}: holds token shard folders made by scripts.prepare_data "
                     f"({', '.join(shown)}{more}), which are not text to read: set [data] source "
                     "to one of them, or mix them by weight with "
                     f"[[data.mixture]] tables (source = ..., weight = ...) or --data.mixture "
                     f"\"{weights}\""
                     + (f"; or move them out of this folder of text files ({text[0]}, ...)"
                        if text else ""))


def _written_by_prepare(path: Path) -> bool:
    from components.data.shards import FORMAT
    try:
        return json.loads(path.read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _load_local(files: list[Path] | dict[str, list[Path]], streaming: bool, cache_dir: Path,
                text_field: str = "text", origins: dict | None = None):
    """files: one "train" split's, or {split: its files}. origins: check_files' {file: (the file
    it is of, its documents' shapes)}; files of other shapes are loaded apart and only their text
    kept, because `datasets` loads files together only when their fields agree."""
    import datasets
    by_split = files if isinstance(files, dict) else {"train": files}
    builder = BUILDER_BY_SUFFIX[document_suffix(next(iter(by_split.values()))[0])]
    # The text builder makes a paragraph of only whitespace a document too: a .txt file that has
    # any comes here as check_files' copy without them.
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    origins = origins or {}
    runs = {split: _runs_of_one_shape(found, origins) for split, found in by_split.items()}
    with _no_progress_bars():
        if all(len(split_runs) == 1 for split_runs in runs.values()):
            return _load_files(builder, by_split, streaming, cache_dir, options, origins)
        if builder == "parquet":  # its builder reads the text column alone, whatever the others are
            return _load_files(builder, by_split, streaming, cache_dir, {"columns": [text_field]},
                               origins)
        loaded = {split: datasets.concatenate_datasets([
            _load_files(builder, {split: run}, streaming, cache_dir, options, origins)[split]
            .select_columns([text_field]) for run in split_runs])
            for split, split_runs in runs.items()}
    return (datasets.IterableDatasetDict if streaming else datasets.DatasetDict)(loaded)


def _runs_of_one_shape(files: list[Path], origins: dict) -> list[list[Path]]:
    """The files in order, cut where the documents' shape changes (a file of many is alone)."""
    runs = []
    shape_of = lambda f: origins.get(f, (f, ()))[1]  # noqa: E731
    for f in files:
        shape = shape_of(f)
        if runs and shape == shape_of(runs[-1][-1]) and VARIED not in shape:
            runs[-1].append(f)
        else:
            runs.append([f])
    return runs


def _load_files(builder: str, by_split: dict[str, list[Path]], streaming: bool, cache_dir: Path,
                options: dict, origins: dict):
    """datasets.load_dataset of these files; its failure is one line naming the file (the
    user's, not check_files' copy of it)."""
    import datasets

    def load(found: dict[str, list[Path]]):
        # Arrow caches of local files go next to the corpus, not into the shared Hugging Face cache.
        return datasets.load_dataset(builder, data_files={split: [str(f) for f in files]
                                                          for split, files in found.items()},
                                     streaming=streaming, cache_dir=str(cache_dir / "datasets"),
                                     **options)
    try:
        return load(by_split)
    except Exception as err:  # DatasetGenerationError, CastError, ArrowInvalid, ...: a traceback
        cause = err
    files = [(split, f) for split, found in by_split.items() for f in found]
    named = lambda f: origins.get(f, (f,))[0]  # noqa: E731
    where = f"{named(files[0][1])}: `datasets` could not load it"
    if len(files) > 1:  # which file: the first that fails alone, if one does
        where = (f"{named(files[0][1])} ... {named(files[-1][1])} ({len(files)} files): "
                 "`datasets` could not load them together")
        for split, f in files:
            try:
                load({split: [f]})
            except Exception as err:
                where, cause = f"{named(f)}: `datasets` could not load it", err
                break
    raise UnreadableFiles(f"{where} ({_reason(cause)})") from cause


def _reason(error: BaseException, limit: int = 300) -> str:
    """The innermost cause of a `datasets` error (DatasetGenerationError says only "An error
    occurred while generating the dataset"), in one line."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


@contextlib.contextmanager
def _no_progress_bars():
    """datasets' "Generating train split" bar, drawn when local files first go into its Arrow
    cache, lands in the training log between the config and step 1, where it reads as trouble
    (and check_files has just read the files without one). Off for these calls only."""
    import datasets
    already_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not already_off:
            datasets.enable_progress_bars()


def _pick_split(splits, split: str, val_every: int, source: str, pick) -> Documents:
    """pick(name): the split of that name, checked."""
    if split in splits and (split != "train" or "validation" in splits):
        return pick(split)
    if split not in SPLITS:
        raise ValueError(f"{source}: no split {split!r} (it has {', '.join(splits)}); use one of "
                         f"{', '.join(SPLITS)}")
    if "train" not in splits:
        raise ValueError(f"{source}: no 'train' split to hold validation documents out of "
                         f"(it has {', '.join(splits)})")
    if val_every == 0:  # nothing held out
        if split == "validation":
            raise ValueError(f"{source}: no validation split, and [data] val_every = 0 holds no "
                             "document out for one: set [validation] enable = false, or val_every "
                             ">= 2")
        return pick("train")
    documents = _hold_out(pick("train"), val_every, validation=(split == "validation"))
    if split == "train" and not is_stream(documents) and not len(documents):
        raise ValueError(f"{source}: no training documents: it has one, and document 0 always goes to "
                         f"the held-out validation split (so does every [data] val_every-th; 0 "
                         "holds none out)")
    return documents


def _is_held_out(_example: dict, index: int, val_every: int, validation: bool) -> bool:
    return (index % val_every == 0) == validation


def is_stream(documents: Documents) -> bool:
    """Whether documents are a stream (datasets.IterableDataset), not rows read by number."""
    import datasets  # imported by whatever made the documents
    return isinstance(documents, datasets.IterableDataset)


def _hold_out(documents: Documents, val_every: int, validation: bool) -> Documents:
    if is_stream(documents):
        # The index counts the whole stream, because TokenWindows splits streams by example (not by
        # file shard) after this filter.
        keep = functools.partial(_is_held_out, val_every=val_every, validation=validation)
        return documents.filter(keep, with_indices=True)
    held_out = np.arange(len(documents)) % val_every == 0
    return documents.select(np.flatnonzero(held_out if validation else ~held_out))
