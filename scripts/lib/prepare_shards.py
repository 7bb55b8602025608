"""Raw documents to token shards (the format: components/data/shards.py), in parallel worker
processes, resumably; scripts.prepare_data is the command line (scripts.bench.data times it).

The work is cut into units: a byte range of a .jsonl file, some row groups of a .parquet file, a
whole .json or .txt file, a range of rows of a Hugging Face dataset, a file of a streamed one.
Unit "fffff-ppppp" is part p of input file f; it becomes one shard per split, written under
temporary names and renamed, then marked done (units/<unit>.json). prepare.json, written first,
holds the settings and the units. So a killed run leaves its done units done and the same command
does the rest; a finished folder is left as it is; another tokenizer, other settings, or a source
file that changed after some of its units were done are refused, naming what differs, and so is an
unfinished folder begun under other document rules (checks.DOCUMENT_RULES).
"""

import contextlib
import glob
import hashlib
import json
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from components import lock
from components.data.checks import (DOCUMENT_RULES, NAMED, BadDocumentError, MissingTextField, read_documents,
                                    text_problem)
from components.data.document_tokens import (bind_to_parent, frame_texts, inherited_objects_frozen,
                                             worker_context)
from components.data import SPLITS
from components.data.sources import splits_of
from components.data.shards import (FORMAT, INDEX, PLAN, VERSION, ShardFormatError, ShardWriter,
                                    token_dtype)
from components.synced_files import write_json_synced

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
BATCH_BYTES = 1 << 20  # documents tokenized together
UNITS = "units"


class PrepareError(ValueError):
    pass


@dataclass
class Unit:
    name: str  # "fffff-ppppp": part p of input f
    kind: str  # "jsonl" | "json" | "txt" (a whole file of paragraphs) | "parquet" | "rows" | "stream"
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


# ----------------------------------------------------------------------------- planning

def local_files(sources: list[str], out: Path | None = None) -> list[Path]:
    """Files, folders (their .jsonl/.json/.parquet/.txt files, hidden ones left out) and globs;
    nothing inside `out`, the shard folder being written (its .json files are not sources, even
    when it sits in a source folder)."""
    files = []
    out = Path(out).expanduser().resolve() if out is not None else None
    for source in sources:
        expanded = os.path.expanduser(source)
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise PrepareError(f"--source {source}: no such file or folder")
        found = []
        for match in map(Path, matches):
            if match.is_dir():
                found += sorted(p for p in match.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                                and not any(part.startswith(".") for part in p.relative_to(match).parts))
            elif match.suffix in SUFFIXES:
                found.append(match)
            elif not glob.has_magic(expanded):
                raise PrepareError(f"--source {source}: unsupported file type {match.suffix!r}; expected "
                                   f"one of {', '.join(SUFFIXES)}")
        found = [p for p in found if out is None or not p.resolve().is_relative_to(out)]
        if not found:
            raise PrepareError(f"--source {source}: no {'/'.join(SUFFIXES)} files there"
                               + (f" (outside --out {out})" if out is not None else ""))
        files += found
    return sorted(set(p.resolve() for p in files))


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
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        metadata = pq.ParquetFile(path).metadata
        units, first, gathered = [], 0, 0
        for group in range(metadata.num_row_groups):
            gathered += metadata.row_group(group).total_byte_size
            if gathered >= unit_bytes or group == metadata.num_row_groups - 1:
                units.append(Unit(name(len(units)), "parquet", str(path), first, group + 1, gathered))
                first, gathered = group + 1, 0
        return units or [Unit(name(0), "parquet", str(path), 0, 0, 0)]
    if path.suffix == ".jsonl":
        parts = max(1, -(-size // unit_bytes))
        bounds = [size * i // parts for i in range(parts + 1)]
        return [Unit(name(i), "jsonl", str(path), bounds[i], bounds[i + 1], bounds[i + 1] - bounds[i])
                for i in range(parts)]
    return [Unit(name(0), path.suffix[1:], str(path), 0, size, size)]


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


# ----------------------------------------------------------------------------- one unit (in a worker)

# What every unit needs, set in each worker by _start_job (forked or spawned, as macOS does).
_job: dict = {}


def _start_job(job: dict) -> None:
    bind_to_parent(job["parent"])  # prepare_unit also checks between batches
    _job.update(job)


def usable_cpus() -> int:
    """The CPUs this process may run on (os.sched_getaffinity is Linux-only)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _documents(unit: Unit, text_field: str) -> Iterator[tuple[str | None, str, int, str | None]]:
    """(text, where, bytes, problem) for each document of the unit."""
    if unit.kind in ("jsonl", "json", "txt"):
        yield from read_documents(Path(unit.path), text_field, unit.start if unit.kind == "jsonl" else 0,
                                  unit.stop if unit.kind == "jsonl" else None)
    elif unit.kind == "parquet":
        yield from _parquet_documents(Path(unit.path), text_field, unit.start, unit.stop)
    elif unit.kind == "rows":
        dataset = _job["dataset"][unit.split]
        _check_field(dataset.column_names, text_field, unit.path)
        for first in range(unit.start, unit.stop, 1000):
            texts = dataset[first:min(first + 1000, unit.stop)][text_field]
            for i, text in enumerate(texts):
                yield _checked(text, f"{unit.path}: row {first + i}", text_field)
    else:
        dataset = _job["dataset"][unit.split]
        stream = dataset.shard(num_shards=dataset.num_shards, index=unit.start)
        for i, example in enumerate(stream):
            if i == 0:
                _check_field(list(example), text_field, unit.path)
            yield _checked(example.get(text_field), f"{unit.path}: shard {unit.start}, row {i}", text_field)


def _check_field(fields: list[str], text_field: str, where: str) -> None:
    if text_field not in fields:
        missing = MissingTextField(f"{where}: the documents have no field {text_field!r} (their "
                                   f"fields: {', '.join(fields)})")
        missing.fix = "set --text-field"
        raise missing


def _checked(text, where: str, text_field: str) -> tuple[str | None, str, int, str | None]:
    """A text of a typed column (parquet, a Hugging Face dataset), checked as the trainer checks it:
    a null, empty or whitespace-only text is a bad document (it was framed as bos/eos alone)."""
    problem = text_problem(text, text_field)
    return (None, where, 0, problem) if problem else (text, where, len(text), None)


def _parquet_documents(path: Path, text_field: str, first_group: int, stop_group: int):
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    _check_field(parquet.schema_arrow.names, text_field, str(path))
    row = sum(parquet.metadata.row_group(g).num_rows for g in range(first_group))
    for group in range(first_group, stop_group):
        for batch in parquet.iter_batches(row_groups=[group], columns=[text_field]):
            for text in batch.column(0).to_pylist():
                yield _checked(text, f"row {row}", text_field)
                row += 1


def _fault_point(unit: str) -> None:
    """Test-only: FLCE_TEST_PREPARE_KILL=<unit> kills the whole run (its process group) while that
    unit is half written, as a kill -9 or a lost node would; FLCE_TEST_PREPARE_STALL=<unit> makes
    the worker hang there (for a test to kill the main process under it)."""
    if os.environ.get("FLCE_TEST_PREPARE_KILL") == unit:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    if os.environ.get("FLCE_TEST_PREPARE_STALL") == unit:
        time.sleep(120)
    if _job.get("parent") not in (None, os.getppid()):  # the main process died (no PDEATHSIG)
        os._exit(1)


def prepare_unit(unit: Unit) -> dict:
    """Tokenize one unit into its shards; returns (and writes, last) its report."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    out, settings, tokenizer = _job["out"], _job["settings"], _job["tokenizer"]
    dtype = np.dtype(settings["dtype"])
    writers = {split: ShardWriter(out / split / unit.name, dtype) for split in SPLITS}
    report = {"unit": unit.name, "bad": 0, "named": [], "max_token_id": -1, "bytes": 0}
    progress, progress_tokens = _job.get("progress"), _job.get("progress_tokens")
    try:
        batch, batch_bytes, counted = [], 0, 0
        for text, where, size, problem in _documents(unit, settings["text_field"]):
            if problem is not None:
                where = where if where.startswith(unit.path) else f"{unit.path}: {where}"
                if settings["on_bad_document"] == "error":
                    raise BadDocumentError(f"{where}: {problem}. Pass --on-bad-document skip to skip "
                                           f"such documents (each is then counted, the first named)")
                report["bad"] += 1
                if len(report["named"]) < NAMED:
                    report["named"].append(f"{where}: {problem}")
                continue
            batch.append(text)
            batch_bytes += size
            if batch_bytes >= BATCH_BYTES:
                tokens = _write_batch(batch, writers, tokenizer, settings["val_every"], report,
                                      unit.split)
                _fault_point(unit.name)
                if progress is not None:
                    with progress.get_lock():
                        progress.value += batch_bytes
                        progress_tokens.value += tokens
                counted += batch_bytes
                batch, batch_bytes = [], 0
        tokens = _write_batch(batch, writers, tokenizer, settings["val_every"], report, unit.split)
        _fault_point(unit.name)
        report["bytes"] = counted + batch_bytes
        if progress is not None:  # the unit's estimated size is what the bar counts in the end
            with progress.get_lock():
                progress.value += unit.size - counted
                progress_tokens.value += tokens
        report["splits"] = {split: writer.finish() for split, writer in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    (out / UNITS).mkdir(parents=True, exist_ok=True)
    write_json_synced(out / UNITS / f"{unit.name}.json", report, atomic=True)
    return report


def _write_batch(texts: list[str], writers: dict, tokenizer, val_every: int, report: dict,
                 fixed_split: str = "") -> int:
    """Returns the number of tokens written. fixed_split: every text into it, or "": each by its
    hash."""
    written = 0
    validation = ([fixed_split == "validation"] * len(texts) if fixed_split else
                  [held_out(t, val_every) for t in texts])
    for split, wanted in (("train", False), ("validation", True)):
        chosen = [t for t, v in zip(texts, validation) if v == wanted]
        if chosen:
            tokens, lengths = frame_texts(tokenizer, chosen)
            writers[split].add(tokens, lengths)
            report["max_token_id"] = max(report["max_token_id"], int(tokens.max()))
            written += tokens.size
    return written


# ----------------------------------------------------------------------------- the whole run

def tokenizer_record(tokenizer, name: str, path: str | None) -> dict:
    return {"fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "name": name,
            "path": str(Path(path).expanduser().resolve()) if path else None}


def settings_for(tokenizer: dict, text_field: str, val_every: int, on_bad_document: str,
                 unit_bytes: int, source: dict) -> dict:
    return {"format": FORMAT, "version": VERSION, "documents": DOCUMENT_RULES, "tokenizer": tokenizer,
            "text_field": text_field, "val_every": val_every, "on_bad_document": on_bad_document,
            "unit_bytes": unit_bytes, "dtype": token_dtype(tokenizer["vocab_size"]).name, "source": source}


def without_path(record: dict | None) -> dict | None:
    return None if record is None else {k: v for k, v in record.items() if k != "path"}


def _differences(old: dict, new: dict, keys=("tokenizer", "text_field", "val_every", "on_bad_document",
                                             "unit_bytes", "dtype")) -> list[str]:
    out = []
    # a tokenizer is its tokens and ids (the fingerprint), not where its file lies: the same
    # file copied elsewhere, or its folder given instead, was refused as other settings
    same = lambda key: (without_path(old.get(key)) == without_path(new.get(key))  # noqa: E731
                        if key == "tokenizer" else old.get(key) == new.get(key))
    for key in keys:
        if not same(key):
            if key == "tokenizer":
                what = lambda t: f"{t.get('path') or t.get('name')} (vocab {t.get('vocab_size')})"  # noqa: E731
                out.append(f"tokenizer: {what(old[key])} -> {what(new[key])}"
                           + (" with the same name but other tokens or bos/eos" if what(old[key]) == what(new[key])
                              else ""))
            else:
                out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return out


def _finished_units(out: Path) -> set[str]:
    """The units whose report is written, which happens once their shards are finished."""
    return {p.stem for p in (out / UNITS).glob("*.json")}


def reconcile(out: Path, settings: dict, units: list[Unit], files: dict | None) -> list[Unit]:
    """The units of this folder: those of prepare.json when the folder was begun with the same
    settings (a changed file whose units are all still to do is planned again), else these."""
    plan_path = out / PLAN
    if not plan_path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        write_json_synced(plan_path, {**settings, "units": [asdict(u) for u in units]},
                          atomic=True)
        return units
    plan = json.loads(plan_path.read_text())
    differences = _differences(plan, settings)
    old_files, new_files = plan["source"].get("files"), (files or {})
    if files is not None and old_files is not None and sorted(old_files) != sorted(new_files):
        differences.append(f"source files: {len(old_files)} -> {len(new_files)} (added: "
                           f"{sorted(set(new_files) - set(old_files))[:3]}, gone: "
                           f"{sorted(set(old_files) - set(new_files))[:3]})")
    elif files is None and plan["source"] != settings["source"]:
        differences.append(f"source: {plan['source']} -> {settings['source']}")
    done = _finished_units(out)
    begun_under = plan.get("documents", 1)  # a folder of before the key: rules 1
    if begun_under != settings["documents"] and any(u["name"] not in done for u in plan["units"]):
        raise PrepareError(f"{out} was begun by an older prepare_data, which counted other texts as "
                           f"documents (document rules {begun_under}, now {settings['documents']}: empty texts and "
                           f"whitespace-only .txt paragraphs are no documents now), and is unfinished: write to "
                           f"another --out (or delete {out}: it holds only this preparation's work)")
    if differences:
        raise PrepareError(f"{out} was begun with other settings ({'; '.join(differences)}): finish it with "
                           f"the arguments it was begun with, or write to another --out (or delete {out}: it holds only "
                           f"this preparation's work)")
    planned = [Unit(**u) for u in plan["units"]]
    if files is not None:
        for path, stat in new_files.items():
            if old_files[path] == stat:
                continue
            mine = [u for u in planned if u.path == path]
            if any(u.name in done for u in mine):
                raise PrepareError(f"{path} changed after some of its units were tokenized into {out}: "
                                   f"write to another --out (or remove {out})")
            fresh = [u for u in units if u.path == path]
            planned = [u for u in planned if u.path != path] + fresh
            planned.sort(key=lambda u: u.name)
        if planned != [Unit(**u) for u in plan["units"]] or old_files != new_files:
            write_json_synced(plan_path, {**settings, "units": [asdict(u) for u in planned]},
                              atomic=True)
    return planned


def _clean_leftovers(out: Path) -> None:
    """Temporary files of a killed run (their units are not done, so they are tokenized again)."""
    for folder in (*SPLITS, UNITS):
        for leftover in (out / folder).glob("*.tmp"):
            leftover.unlink()


def _check_ours(out: Path) -> None:
    """Refuse a folder of the user's (files, no prepare.json): they would mix with the shards,
    and a later run with other settings is refused with "delete it: it holds only this
    preparation's work". Empty, or holding only a killed run's lock, it is written."""
    if out.exists() and not out.is_dir():  # mkdir's FileExistsError was a traceback
        raise PrepareError(f"{out} is a file, not a folder: --out names the folder to write the "
                           "shards into; give a new or empty folder")
    if not out.is_dir() or (out / PLAN).is_file():
        return
    theirs = sorted(p.name for p in out.iterdir() if p.name != "prepare.lock")
    if theirs:
        shown = ", ".join(theirs[:5]) + (f", ... ({len(theirs)} in all)" if len(theirs) > 5 else "")
        raise PrepareError(f"{out} holds {shown} and no {PLAN}: not a folder prepare_data began; "
                           "write to a new or empty --out")


@contextlib.contextmanager
def _locked(out: Path):
    """One run per folder: prepare.lock names its holder; a killed holder's lock (its workers die
    with it and never hold it) is taken over with a warning naming it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission: a traceback before
        raise PrepareError(f"--out {out}: cannot make the folder ({e.strerror or e})") from None
    path = out / "prepare.lock"
    fd = lock.lock_file(path, lambda holder: PrepareError(
        f"{out} is being written by another prepare_data.py run ({holder}; lock file {path}): "
        "wait for it to end or write to another --out"))
    try:
        yield
    finally:
        lock.release(fd)


@dataclass
class Plan:
    """What a prepare run tokenizes: its units of work, the settings prepare.json records
    (settings_for) and what the units read: the local files (their listing), or the Hugging
    Face dataset (load_hf's {split: dataset})."""
    units: list[Unit]
    settings: dict
    files: dict | None = None
    dataset: object = None


def prepare(out: Path, plan: Plan, tokenizer, workers: int, progress_bar: bool = True,
            log=print) -> dict:
    """Tokenize what is not done yet and write index.json; returns the index."""
    settings = plan.settings
    _check_ours(out)
    with _locked(out):
        units = reconcile(out, settings, plan.units, plan.files)
        _clean_leftovers(out)
        done = _finished_units(out)
        todo = [u for u in units if u.name not in done]
        if not todo and (out / INDEX).is_file():
            try:
                index = json.loads((out / INDEX).read_text())
                log(f"{out}: complete already, nothing to do")
                return index
            except ValueError:  # damaged: written again from the units below
                log(f"{out / INDEX} is damaged: writing it again from the finished units")
        if todo:
            log(f"{out}: {len(todo)} of {len(units)} units to tokenize with {min(workers, len(todo))} "
                f"worker process(es)" + (f" ({len(units) - len(todo)} done before)" if done else ""))
            _run(out, todo, settings, tokenizer, workers, plan.dataset, progress_bar)
        index = write_index(out, units, settings)
        return index


def _run(out: Path, todo: list[Unit], settings: dict, tokenizer, workers: int, dataset,
         progress_bar: bool) -> None:
    context = worker_context()
    progress, tokens = context.Value("q", 0), context.Value("q", 0)
    job = dict(out=out, settings=settings, tokenizer=tokenizer, dataset=dataset, progress=progress,
               progress_tokens=tokens, parent=os.getpid())
    bar = None
    if progress_bar:
        from tqdm import tqdm

        # In a log file (not a terminal) a line every 30 s rather than a redraw every 0.1 s.
        bar = tqdm(total=sum(u.size for u in todo) or None,  # None: streamed, size unknown
                   unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing",
                   dynamic_ncols=True, mininterval=1 if sys.stderr.isatty() else 30)
    started = time.time()

    def show_progress():
        if bar is not None:
            bar.set_postfix_str(f"{tokens.value / max(time.time() - started, 1e-9):,.0f} tokens/s",
                                refresh=False)
            bar.update(progress.value - bar.n)

    with ProcessPoolExecutor(min(workers, len(todo)), mp_context=context, initializer=_start_job,
                             initargs=(job,)) as pool:
        try:
            with inherited_objects_frozen():  # the first submit forks every worker
                futures = [pool.submit(prepare_unit, u) for u in todo]
            wait_in_order(futures, show_progress)
        finally:
            if bar is not None:
                bar.close()


def wait_in_order(futures: list, show_progress=lambda: None) -> None:
    """Waits for the units' futures (listed in the files' order). A worker's error is raised
    here; a bad document's names the first bad document in the files' order, not whichever
    worker came upon one first: the units before it still run (one may hold an earlier one),
    the later ones that have not started are cancelled."""
    order = {future: i for i, future in enumerate(futures)}
    pending, first_bad = set(futures), None
    try:
        while pending:
            finished, pending = wait(pending, timeout=0.2)
            for future in finished:
                try:
                    future.result()
                except BrokenProcessPool as e:
                    raise PrepareError("a worker process died (killed, or out of memory?); the same "
                                       "command resumes (fewer --workers or a smaller --unit-mb need "
                                       "less memory)") from e
                except BadDocumentError as e:
                    if first_bad is None or order[future] < first_bad[0]:
                        first_bad = (order[future], e)
            if first_bad is not None:
                pending = {f for f in pending if order[f] < first_bad[0] or not f.cancel()}
            show_progress()
    finally:
        for future in pending:
            future.cancel()
    if first_bad is not None:
        raise first_bad[1]


def write_index(out: Path, units: list[Unit], settings: dict) -> dict:
    reports = [json.loads((out / UNITS / f"{u.name}.json").read_text()) for u in units]
    splits = {}
    for split in SPLITS:
        shards = [{"file": f"{split}/{r['unit']}.tokens.npy", **r["splits"][split]} for r in reports]
        for shard in shards:
            if not (out / shard["file"]).is_file():
                raise ShardFormatError(f"{out / shard['file']} is missing, though its unit is marked done: "
                                       f"remove {out / UNITS}/{Path(shard['file']).name.split('.')[0]}.json "
                                       f"and run again to redo it")
        splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                         "documents": sum(s["documents"] for s in shards),
                         "shards": [s for s in shards if s["tokens"]]}
    if not splits["train"]["tokens"]:
        raise PrepareError(f"{out}: no training documents in the source"
                           + (f" ({sum(r['bad'] for r in reports)} bad ones were skipped)"
                              if any(r["bad"] for r in reports) else ""))
    bad = sum(r["bad"] for r in reports)
    index = {**{k: settings[k] for k in ("format", "version", "dtype", "tokenizer", "val_every",
                                          "text_field", "source")},
             "max_token_id": max(r["max_token_id"] for r in reports),
             "splits": splits, "skipped_documents": bad,
             "skipped_named": [n for r in reports for n in r["named"]][:NAMED],
             "created": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    write_json_synced(out / INDEX, index, atomic=True)
    return index
