"""What runs in a worker process: one unit's documents read, checked and tokenized into its
shards, its report (units/<unit>.json, which marks it done) written last. The job reaches each
worker through the pool's initializer (_start_job), so spawned workers get it as forked ones do."""

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from components.data import SPLITS
from components.data.checks import NAMED, MissingTextField
from components.data.document_reader import (BadDocumentError, NoField, is_compressed,
                                             read_documents, text_problem)
from components.data.document_tokens import bind_to_parent, frame_texts
from components.data.shards import ShardWriter
from components.synced_files import write_json_synced
from scripts.lib.prepare_shards.units import Unit, held_out

BATCH_BYTES = 1 << 20  # documents tokenized together
UNITS = "units"


# What every unit needs, set in each worker by _start_job (forked or spawned, as macOS does).
_job: dict = {}


def _start_job(job: dict) -> None:
    bind_to_parent(job["parent"])  # prepare_unit also checks between batches
    _job.update(job)


def _documents(unit: Unit, text_field: str) -> Iterator[tuple[str | None, str, int, str | None]]:
    """(text, where, bytes, problem) for each document of the unit."""
    if unit.kind in ("jsonl", "json", "txt"):
        path = Path(unit.path)
        ranged = unit.kind == "jsonl" and not is_compressed(path)
        yield from read_documents(path, text_field, unit.start if ranged else 0,
                                  unit.stop if ranged else None)
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
        raise missing_field(where, text_field, fields)


def missing_field(where: str, text_field: str, fields: list[str]) -> MissingTextField:
    missing = MissingTextField(f"{where}: the documents have no field {text_field!r} (their "
                               f"fields: {', '.join(fields) or 'none'})")
    missing.fix = "set --text-field"
    return missing


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
    # without_field, fields: the bad documents that lack the text field, and the first's fields
    # (run.py names a file whose documents all lack it, as the trainer does)
    report = {"unit": unit.name, "bad": 0, "named": [], "max_token_id": -1, "bytes": 0,
              "without_field": 0, "fields": []}
    progress, progress_tokens = _job.get("progress"), _job.get("progress_tokens")
    try:
        # shown: what the bar has counted of this unit, at most its size (a compressed file's
        # documents are more bytes than the file: the bar ran past its total, then back)
        batch, batch_bytes, counted, shown = [], 0, 0, 0
        for text, where, size, problem in _documents(unit, settings["text_field"]):
            if problem is not None:
                where = where if where.startswith(unit.path) else f"{unit.path}: {where}"
                if settings["on_bad_document"] == "error":
                    # stopped at the first, so whether the others lack the field is not known
                    other_field = ("Set --text-field if the documents keep their text under "
                                   "another field, or pass" if isinstance(problem, NoField) else
                                   "Pass")
                    raise BadDocumentError(f"{where}: {problem}. {other_field} --on-bad-document "
                                           "skip to skip such documents (each is then counted, "
                                           "the first named)")
                report["bad"] += 1
                if isinstance(problem, NoField):
                    report["without_field"] += 1
                    report["fields"] = report["fields"] or problem.fields
                if len(report["named"]) < NAMED:
                    report["named"].append(f"{where}: {problem}")
                continue
            batch.append(text)
            batch_bytes += size
            if batch_bytes >= BATCH_BYTES:
                tokens = _write_batch(batch, writers, tokenizer, settings["val_every"], report,
                                      unit.split)
                _fault_point(unit.name)
                counted += batch_bytes
                if progress is not None:
                    with progress.get_lock():
                        progress.value += min(counted, unit.size) - shown
                        progress_tokens.value += tokens
                    shown = min(counted, unit.size)
                batch, batch_bytes = [], 0
        tokens = _write_batch(batch, writers, tokenizer, settings["val_every"], report, unit.split)
        _fault_point(unit.name)
        report["bytes"] = counted + batch_bytes
        if progress is not None:  # the unit's estimated size is what the bar counts in the end
            with progress.get_lock():
                progress.value += unit.size - shown
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
