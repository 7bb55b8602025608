"""Local .jsonl/.json/.txt/.parquet files (the first three also compressed: .gz, .bz2, .xz) read
once, document by document, before `datasets` loads them.

What `datasets` does with a bad document otherwise: pyarrow's JSON reader stores a string that is not
UTF-8 as it is, and the run dies with a bare UnicodeDecodeError when that row is turned into Python
(mid-run, and again after every resume; streaming fails a whole batch of rows at once); a malformed
JSON line fails the whole file, an empty file is a bare StopIteration, and a .txt file that is not
UTF-8 is a DatasetGenerationError; a null text (parquet) is a TypeError naming no file, mid-run; an
empty text trains on bos/eos alone, silently. Here each bad document is named by file and line; with
`[data] on_bad_document = "skip"` the file is replaced by a copy without them (skipping is then
deterministic, so resuming finds the same documents). What a file holds is cached under cache_dir by
its path, size and modification time, so unchanged files are read once, not every run.

A paragraph of a .txt file that is only whitespace (spaces or tabs between blank lines, an odd run
of blank lines, whitespace at the end of the file; at the file's start, its byte-order mark too) is
layout, as a blank line of a .jsonl file is: not a document, and not a bad one either. `datasets`'
text builder makes one of each (trained on as bos, whitespace, eos), so a file with any is loaded
from a copy without them, whatever on_bad_document says, and read_documents (document_reader.py)
leaves them out. A .txt file's byte-order mark, which that builder keeps as the first document's
first character, is left out the same way (a .jsonl file's is dropped by `datasets` itself).

A dataset that `datasets` loads by name (check_dataset) and scripts.prepare_data's documents
(read_documents, text_problem) count the same documents bad: a null, non-text, empty or
whitespace-only text.
"""

import hashlib
import json
import logging
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from filelock import FileLock  # a dependency of datasets

from components.config.schema import OnBadDocument
from components.data.document_reader import (BLANK, BOM, BadDocumentError, NoField,
                                             document_suffix, json_documents, opened,
                                             paragraphs, text_problem)
from components.synced_files import atomic_open

logger = logging.getLogger(__name__)

ON_BAD_DOCUMENT = typing.get_args(OnBadDocument)
CHECKED_SUFFIXES = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
NAMED = 10  # bad documents named one by one (per file in the cache, per source in warnings)
# What counts as a document. Part of the cached reports' key, and recorded by scripts.prepare_data,
# which refuses to finish a folder begun under other rules (its units would split a source two
# ways). 1: before empty texts were refused (f81da14) and whitespace-only .txt paragraphs left
# out; 2: since.
DOCUMENT_RULES = 2
_CHECK_VERSION = 6  # the rest of the cache key's version: bump when what a report holds changes
# Distinct document shapes kept per file; a file of more never shares a `datasets` load.
SHAPES = 16
VARIED = "varied"
_warned: set[str] = set()  # files whose skipped documents this process has already reported


class MissingTextField(KeyError, ValueError):
    # A ValueError too: a data mistake, which the trainer's command line shows as one line.
    # KeyError would print its message in quotes, as if it were a key.
    user_error = True  # one line and exit status 2 from train.py, no traceback
    fix = "set [data] text_field"  # what names the field: a command of its own sets its option

    def __str__(self) -> str:
        return f"{self.args[0]}; {self.fix}"


@dataclass
class FileReport:
    documents: int = 0  # good ones
    bad: int = 0
    named: list[str] = field(default_factory=list)  # the first NAMED bad ones: "line 18: not UTF-8 ..."
    without_field: int = 0  # bad because they lack the text field
    blank: int = 0  # .txt paragraphs of only whitespace: layout, left out, neither documents nor bad
    bom: bool = False  # a .txt file that starts with a byte-order mark, left out as layout is
    fields: list[str] = field(default_factory=list)  # the fields of the first of those
    # The good documents' distinct shapes (their fields but the text, and their JSON types; a
    # parquet file's: its other columns): files of one shape can be loaded together by
    # `datasets`, which casts every file to the first's columns and fails on a field the first
    # lacks (per-file metadata: an id, a repo, a url).
    shapes: list[str] = field(default_factory=list)


def check_files(files: list[Path], text_field: str, on_bad_document: str, cache_dir: Path,
                origins: dict | None = None) -> list[Path]:
    """The files to hand to `datasets`: each checked file as it is, or its copy without the bad
    documents; files without any document are left out, and none at all is an error. origins,
    when given, gets {file to hand over: (the file it is of, its documents' shapes)}."""
    _check_choice(on_bad_document)
    checked, skipped, named = [], [], []
    for path in files:
        key = _cache_key(path, text_field)
        report = _report(path, text_field, cache_dir / "checked" / key)
        if report.without_field and report.without_field == report.bad and not report.documents:
            raise MissingTextField(f"{path}: the documents have no field {text_field!r} (their fields: "
                                   f"{', '.join(report.fields) or 'none'})")
        if report.bad and on_bad_document == "error":
            raise BadDocumentError(
                f"{path}: {report.named[0]}; {report.bad} bad document(s) in this file. Set [data] "
                f"on_bad_document = \"skip\" to skip them (each is then named in a warning)")
        if report.bad or report.blank or report.bom:  # the copy leaves out layout silently
            path_to_load = _cleaned_copy(path, text_field, cache_dir / "checked" / key)
            if report.bad and key not in _warned:
                _warned.add(key)
                skipped.append(report.bad)
                named += [f"{path}: {what}" for what in report.named]
        else:
            path_to_load = path
        if report.documents:
            checked.append(path_to_load)
            if origins is not None:
                origins[path_to_load] = (path, tuple(report.shapes))
        elif len(files) > 1:
            logger.warning("data: %s holds no documents%s", path, _why_empty(path, report))
    if skipped:
        _warn_skipped(sum(skipped), named, f"{len(skipped)} file(s)")
    if not checked:
        if len(files) == 1:
            raise ValueError(f"no documents in {files[0]}{_why_empty(files[0], report)}")
        raise ValueError(f"no documents in any of the {len(files)} files {files[0]} ... {files[-1]}")
    return checked


def _check_choice(on_bad_document: str) -> None:
    if on_bad_document not in ON_BAD_DOCUMENT:
        raise ValueError(f"[data] on_bad_document = {on_bad_document!r}: expected one of {ON_BAD_DOCUMENT}")


def _warn_skipped(count: int, named: list[str], place: str) -> None:
    for what in named[:NAMED]:
        logger.warning("data: skipped a bad document: %s", what)
    more = count - min(len(named), NAMED)
    logger.warning("data: skipped %d bad document(s) in %s ([data] on_bad_document = \"skip\")%s",
                   count, place, f"; {more} more not named above" if more > 0 else "")


def check_dataset(documents, where: str, text_field: str, on_bad_document: str):
    """A split of a dataset that `datasets` loaded by name (a Hub dataset, or one in its cache),
    with its bad documents (text_problem) named (error) or left out (skip); rows are numbered as
    the split numbers them. Unchecked, a null text stopped the run mid-way with a TypeError naming
    neither dataset nor row, and an empty one trained on bos/eos alone. A map-style split is
    checked whole here, by pyarrow over its memory-mapped column, before training starts; a stream
    cannot be read ahead, so its rows are checked as they are read. where: "NAME, split 'train'"."""
    import datasets
    import numpy as np
    import pyarrow as pa

    _check_choice(on_bad_document)
    if isinstance(documents, datasets.IterableDataset):
        check = _stream_checks.setdefault((where, text_field, on_bad_document),
                                          _StreamCheck(where, text_field, on_bad_document))
        return documents.filter(check, with_indices=True)
    if text_field not in documents.column_names:
        return documents  # load_documents names the missing field
    texts = documents.with_format("arrow")[text_field]
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        raise BadDocumentError(f"{where}: column {text_field!r} holds {texts.type}, not text; set [data] "
                               "text_field to the column of the documents' text")
    bad = np.asarray(_no_text(texts))
    rows = np.flatnonzero(bad)
    if not rows.size:
        return documents
    named = [f"{where}: row {i}: {text_problem(texts[i].as_py(), text_field)}" for i in rows[:NAMED].tolist()]
    if on_bad_document == "error":
        raise BadDocumentError(f"{named[0]}; {rows.size} bad document(s) in this split. Set [data] "
                               f"on_bad_document = \"skip\" to skip them (each is then named in a warning)")
    if rows.size == bad.size:
        raise ValueError(f"no documents in {where} (all {rows.size} were bad and skipped)")
    if where not in _warned:  # the train split is loaded for training and for validation
        _warned.add(where)
        _warn_skipped(int(rows.size), named, where)
    return documents.select(np.flatnonzero(~bad))


class _StreamCheck:
    """check_dataset's filter for a stream. Every epoch (and the validation split, held out of the
    same stream) reads the rows again: a skipped row is counted (and the first NAMED named) once,
    when the stream is first read past it."""

    def __init__(self, where: str, text_field: str, on_bad_document: str):
        self.where, self.text_field, self.on_bad_document = where, text_field, on_bad_document
        self.skipped, self.last = 0, -1

    def __call__(self, example: dict, row: int) -> bool:
        if self.text_field not in example:
            return True  # TokenWindows names the missing field
        problem = text_problem(example[self.text_field], self.text_field)
        if problem is None:
            return True
        if self.on_bad_document == "error":
            raise BadDocumentError(f"{self.where}: row {row}: {problem}. Set [data] on_bad_document = "
                                   "\"skip\" to skip such documents (each is then counted in a warning)")
        if row > self.last:
            self.last, self.skipped = row, self.skipped + 1
            if self.skipped <= NAMED or str(self.skipped).rstrip("0") == "1":  # 1..10, 100, 1000, ...
                logger.warning("data: skipped a bad document: %s: row %d: %s (%d skipped so far, "
                               "[data] on_bad_document = \"skip\")", self.where, row, problem, self.skipped)
        return False


_stream_checks: dict[tuple, _StreamCheck] = {}


def _is_text_type(kind) -> bool:
    """An Arrow type of text: string, large_string, string_view, or a dictionary of strings (a
    pandas category column), which `datasets` reads as text."""
    import pyarrow as pa
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind))


def _no_text(texts):
    """For each text of an Arrow string array: whether text_problem finds it bad (null, empty or
    only whitespace; pyarrow's utf8_is_space and str.isspace agree on every code point)."""
    import pyarrow.compute as pc
    return pc.fill_null(pc.or_(pc.equal(pc.binary_length(texts), 0), pc.utf8_is_space(texts)), True)


def _why_empty(path: Path, report: FileReport) -> str:
    if report.bad:
        return f" (all {report.bad} were bad and skipped)"
    if document_suffix(path) == ".parquet":
        return " (no rows)"
    with opened(path) as f:  # decompressed: a compressed empty file is not 0 bytes
        head = f.read(4096)
    if not head:
        return " (the file is empty)"
    return " (an empty JSON array)" if head.lstrip(BOM).lstrip().startswith(b"[") else \
        " (only blank lines)"


def _cache_key(path: Path, text_field: str) -> str:
    stat = path.stat()
    what = [str(path.resolve()), stat.st_size, stat.st_mtime_ns, text_field, _CHECK_VERSION,
            DOCUMENT_RULES]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


def _report(path: Path, text_field: str, stem: Path) -> FileReport:
    """The file's report from the cache, or read the file (one process at a time per file: the
    others wait for its report rather than read the file too)."""
    report_path = stem.with_name(stem.name + ".report")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(stem) + ".lock"):
        if report_path.is_file():
            return FileReport(**json.loads(report_path.read_text()))
        report = _scan(path, text_field)
        with atomic_open(report_path, unique=True) as f:
            f.write(json.dumps(asdict(report)).encode())
    return report


def _cleaned_copy(path: Path, text_field: str, stem: Path) -> Path:
    copy = stem.with_suffix(document_suffix(path))  # written uncompressed
    with FileLock(str(stem) + ".lock"):
        if not copy.is_file():
            with atomic_open(copy, unique=True) as f:
                _scan(path, text_field, out=f)
    return copy


def _scan(path: Path, text_field: str, out: BinaryIO | None = None) -> FileReport:
    """Count (and name) the good and bad documents; write the good ones to `out` if given, in a
    form that `datasets` reads back as the same documents."""
    if document_suffix(path) == ".parquet":
        return _scan_parquet(path, text_field, out)
    report = FileReport()
    text = CHECKED_SUFFIXES[document_suffix(path)] == "text"
    shapes: set[str] = set()

    def seen(document: dict) -> None:
        if len(shapes) <= SHAPES:
            shapes.add(_shape({k: v for k, v in document.items() if k != text_field}))

    with opened(path) as f:
        report.bom = text and f.read(len(BOM)) == BOM
        f.seek(0)
        for raw, where, problem in (paragraphs(f) if text else
                                    json_documents(f, path, text_field, seen)):
            if problem is BLANK:
                report.blank += 1
                continue
            if problem is None:
                if out is not None:
                    out.write(b"\n\n" + raw if text and report.documents else raw)
                report.documents += 1
                continue
            report.bad += 1
            if len(report.named) < NAMED:
                report.named.append(f"{where}: {problem}")
            if isinstance(problem, NoField):
                report.without_field += 1
                report.fields = report.fields or problem.fields
    report.shapes = [VARIED] if len(shapes) > SHAPES else sorted(shapes)
    return report


def _shape(value) -> str:
    """A JSON value's shape as pyarrow's JSON reader types it: its fields and their types, nested
    ones included, not their values."""
    if isinstance(value, dict):
        fields = (f"{json.dumps(k)}:{_shape(v)}" for k, v in sorted(value.items()))
        return "{" + ",".join(fields) + "}"
    if isinstance(value, list):
        return "[" + ",".join(sorted({_shape(v) for v in value})) + "]"
    # int64 and double are two Arrow types, which `datasets` may fail to cast one to the other
    return {bool: "boolean", int: "integer", float: "float", str: "string"}.get(
        type(value), "null")


def _scan_parquet(path: Path, text_field: str, out: BinaryIO | None = None) -> FileReport:
    """_scan for a parquet file: its column is typed, so only a null or empty text is bad
    (found by pyarrow over whole batches, not row by row in Python)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    report, writer, row = FileReport(), None, 0
    try:
        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            raise MissingTextField(f"{path}: the documents have no field {text_field!r} (their fields: "
                                   f"{', '.join(parquet.schema_arrow.names)})")
        kind = parquet.schema_arrow.field(text_field).type
        if not _is_text_type(kind):
            raise BadDocumentError(f"{path}: column {text_field!r} holds {kind}, not text; set [data] "
                                   "text_field to the column of the documents' text")
        plain = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        schema = parquet.schema_arrow
        report.shapes = [",".join(sorted(f"{json.dumps(f.name)}:{f.type}" for f in schema
                                         if f.name != text_field))]
        if not plain:  # dictionary-encoded or string_view: read as plain text from here on
            schema = schema.set(schema.get_field_index(text_field),
                                pa.field(text_field, pa.large_string()))
        if out is not None:  # the copy keeps every column: a dataset may use the others
            writer = pq.ParquetWriter(out, schema)
        for batch in parquet.iter_batches(columns=None if out else [text_field]):
            if not plain:
                batch = pa.RecordBatch.from_arrays(
                    [c.cast(pa.large_string()) if name == text_field else c
                     for name, c in zip(batch.schema.names, batch.columns)],
                    names=batch.schema.names)
            texts = batch.column(text_field)
            bad = _no_text(texts)
            rows = np.flatnonzero(bad.to_numpy(zero_copy_only=False))
            for i in rows[:max(0, NAMED - len(report.named))].tolist():
                report.named.append(f"row {row + i}: " + text_problem(texts[i].as_py(), text_field))
            report.bad += rows.size
            report.documents += len(batch) - rows.size
            row += len(batch)
            if writer is not None:
                writer.write_batch(batch.filter(pc.invert(bad)))
    except pa.ArrowException as e:
        raise BadDocumentError(f"{path}: not a readable parquet file ({e})") from None
    finally:
        if writer is not None:
            writer.close()
    return report
