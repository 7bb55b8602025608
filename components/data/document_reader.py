"""Raw .jsonl/.json/.txt bytes read into documents, each with where it is and what is wrong
with it. Apart from checks.py, which counts and cleans whole files with these readers, because
scripts.prepare_data's workers read their units' documents with them too. What files hold
documents (document_suffix) is decided here for the trainer and prepare_data alike."""

import bz2
import contextlib
import gzip
import io
import json
import lzma
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

BOM = b"\xef\xbb\xbf"
DOCUMENT_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")
# Compressed text files (part-00000.jsonl.gz, as corpora are often published) hold documents too:
# `datasets` reads them, and they were left out of a source folder without a word. Parquet
# compresses inside the file.
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
COMPRESSED_SUFFIXES = (".jsonl", ".json", ".txt")
KINDS = (f"{'/'.join(DOCUMENT_SUFFIXES)} (the first three also as "
         f"{'/'.join(COMPRESSIONS)})")  # the files read, for messages


def document_suffix(path: Path) -> str | None:
    """What a file holds by its name: one of DOCUMENT_SUFFIXES (".jsonl" for a.jsonl and for
    a.jsonl.gz), or None for a file that holds no documents to read."""
    if path.suffix in COMPRESSIONS:
        inner = Path(path.stem).suffix
        return inner if inner in COMPRESSED_SUFFIXES else None
    return path.suffix if path.suffix in DOCUMENT_SUFFIXES else None


def refuse_compressed_twins(files: list[Path]) -> None:
    """A ValueError when a file and its compressed copy (x.jsonl and x.jsonl.gz: an archive
    kept beside what was extracted from it) are both among the files to read: every document
    would be read twice."""
    plain = {f for f in files if not is_compressed(f)}
    for f in files:
        if is_compressed(f) and f.with_suffix("") in plain:
            raise ValueError(f"{f.with_suffix('')} and {f} are both sources: the same documents "
                             "read twice if one is the other's copy; remove or move one")


def some_files(files: list[Path], folder: Path | None = None, shown: int = 5) -> str:
    """The first few files (relative to folder, if given), and how many there are in all: the
    files a message names."""
    names = ", ".join(str(p.relative_to(folder) if folder else p) for p in files[:shown])
    return names + (f", ... ({len(files)} in all)" if len(files) > shown else "")


def file_type(path: Path) -> str:
    """A file's type as messages name it: ".csv.gz" for data.csv.gz, not ".gz"."""
    return "".join(path.suffixes[-2:]) if is_compressed(path) else path.suffix


def is_compressed(path: Path) -> bool:
    return path.suffix in COMPRESSIONS


@contextlib.contextmanager
def opened(path: Path) -> Iterator[BinaryIO]:
    """The file's bytes, decompressed. A compressed file that cannot be decompressed (damaged,
    cut short) is a BadDocumentError naming it: nothing in it can be skipped."""
    if not is_compressed(path):
        with open(path, "rb") as f:
            yield f
        return
    try:
        with COMPRESSIONS[path.suffix](path, "rb") as f:
            yield f
    except (EOFError, zlib.error, lzma.LZMAError, OSError) as e:
        # errors of the system (a full disk under a copy being written) carry an errno; the
        # codecs' (BadGzipFile, bz2's "Invalid data stream") none
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise BadDocumentError(f"{path}: cannot be read as a {path.suffix[1:]} file ({e}): "
                               "fix or remove it") from None

# One document: its bytes as they go into a cleaned copy, where it is ("line 18"), and why it is
# bad (None: it is good).
Document = tuple[bytes, str, str | None]


class BadDocumentError(ValueError):
    user_error = True  # one line and exit status 2 from train.py, no traceback


class NoField(str):
    """The problem of a document without the text field, and the fields it does have."""
    fields: list[str]


def text_problem(text, text_field: str) -> str | None:
    """Why a document's text is none to train on (None: it is text): a null, another type, an
    empty text or one of only whitespace (tokenized to little more than bos/eos)."""
    if text is None:
        return f"field {text_field!r} holds null, not text"
    if not isinstance(text, str):
        return f"field {text_field!r} holds {type(text).__name__}, not text"
    if not text or text.isspace():
        return f"field {text_field!r} is {'empty' if not text else 'only whitespace'} (no text to train on)"
    return None


def read_documents(path: Path, text_field: str, start: int = 0,
                   stop: int | None = None) -> Iterator[tuple[str | None, str, int, str | None]]:
    """(text, where, bytes, problem) for each document of a .jsonl/.json/.txt file, the documents
    the trainer's reader sees: text is None when problem says why the document is bad. A JSON
    lines file can be read in byte ranges: the lines that begin in [start, stop); a compressed
    one only whole."""
    with opened(path) as f:
        if document_suffix(path) == ".txt":
            for raw, where, problem in paragraphs(f):
                if problem is not BLANK:
                    yield (None if problem else raw.decode("utf-8")), where, len(raw), problem
            return
        if start == 0 and stop is None:
            documents = json_documents(f, path, text_field)
        else:
            documents = _json_line_range(f, path, text_field, start, stop)
        for raw, where, problem in documents:
            text = None if problem else json.loads(raw.decode("utf-8"))[text_field]
            yield text, where, len(raw), problem


def _json_line_range(f: BinaryIO, path: Path, text_field: str, start: int,
                     stop: int | None) -> Iterator[Document]:
    if start:
        f.seek(start - 1)
        f.readline()  # to the first line that begins at or after start
    number = 1 if start == 0 else None  # line numbers are known only from the file's start
    first = start == 0  # the file's first document line: _refuse_one_object's
    while (stop is None or f.tell() < stop) and (line := f.readline()):
        where = f"line {number}" if number else f"the line at byte {f.tell() - len(line)}"
        if number == 1:
            line = line.removeprefix(BOM)
        if number:
            number += 1
        if line.strip():
            problem = _line_problem(line, text_field)
            if problem and first:
                _refuse_one_object(f, path, line)
            first = False
            yield line, where, problem


def _line_problem(line: bytes, text_field: str, seen=None) -> str | None:
    """seen, when given, is called with the line's document when it is a good one."""
    try:
        document = json.loads(line.rstrip(b"\r\n").decode("utf-8"))
    except UnicodeDecodeError as e:
        return _not_utf8(line, e)
    except json.JSONDecodeError as e:
        return _invalid_json(e)
    problem = _document_problem(document, text_field)
    if problem is None and seen is not None:
        seen(document)
    return problem


def json_documents(f: BinaryIO, path: Path, text_field: str, seen=None) -> Iterator[Document]:
    """JSON lines, as pyarrow reads them (blank lines are not documents), or, for a .json file
    that starts with '[', one JSON array of documents (which `datasets` also reads). seen: as
    _line_problem's."""
    head = f.read(4096).lstrip(BOM).lstrip()
    f.seek(0)
    if document_suffix(path) == ".json" and head.startswith(b"["):
        yield from _json_array(f.read(), path, text_field, seen)
        return
    first = True
    for number, line in enumerate(f, 1):
        if number == 1:
            line = line.removeprefix(BOM)
        if not line.strip():
            continue
        problem = _line_problem(line, text_field, seen)
        if first and problem:
            _refuse_one_object(f, path, line)
        first = False
        yield (line if line.endswith(b"\n") else line + b"\n", f"line {number}", problem)


def _refuse_one_object(f: BinaryIO, path: Path, first_line: bytes) -> None:
    """A file whose first document line is not JSON but which is, whole, one JSON object (a
    document pretty-printed, or a dict of them) was read as that many bad lines ("line 1:
    invalid JSON", every line bad): it is the file's layout that is wrong, said here."""
    if not first_line.lstrip().startswith(b"{"):
        return
    try:  # a whole JSON line (a document without the text field, say) is a document
        json.loads(first_line)
        return
    except (UnicodeDecodeError, ValueError):
        pass
    here = f.tell()
    f.seek(0)
    try:
        data = f.read().removeprefix(BOM)
        whole = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return
    finally:
        f.seek(here)
    if isinstance(whole, dict):
        lines = data.count(b"\n") + 1
        raise BadDocumentError(
            f"{path}: one JSON object over {lines} lines, not a document a line (JSON lines) nor "
            "a JSON array of documents: write each document on a line of its own")


def _json_array(data: bytes, path: Path, text_field: str, seen=None) -> Iterator[Document]:
    """A JSON array is parsed whole: an error in its syntax or encoding cannot be skipped."""
    data = data.removeprefix(BOM)
    try:
        documents = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        where, why = f"line {_line_of(data, e.start)}", _not_utf8(data, e)
    except json.JSONDecodeError as e:
        where, why = f"line {e.lineno}", _invalid_json(e)
    else:
        for i, document in enumerate(documents):
            # surrogatepass: a lone surrogate is a bad document, named below, not an encoding error here
            line = (json.dumps(document, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")
            problem = _document_problem(document, text_field)
            if problem is None and seen is not None:
                seen(document)
            yield line, f"element [{i}] of the array", problem
        return
    raise BadDocumentError(f"{path}: {where}: {why}; a JSON array is read as one piece, so nothing "
                           f"in it can be skipped: fix the file or write it as JSON lines (.jsonl)")


def _document_problem(document, text_field: str) -> str | None:
    if not isinstance(document, dict):
        return f"a JSON {_json_type(document)}, not an object"
    if text_field not in document:
        problem = NoField(f"no field {text_field!r} (its fields: {', '.join(document) or 'none'})")
        problem.fields = list(document)
        return problem
    if not isinstance(document[text_field], str):
        return f"field {text_field!r} holds a JSON {_json_type(document[text_field])}, not text"
    try:  # valid JSON may escape half a surrogate pair, which no UTF-8 reader or tokenizer takes
        document[text_field].encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"field {text_field!r} holds a lone surrogate (\\u{ord(e.object[e.start]):04x} at "
                f"character {e.start}), not UTF-8 text")
    return text_problem(document[text_field], text_field)  # an empty text


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _invalid_json(error: json.JSONDecodeError) -> str:
    return f"invalid JSON: {error.msg.removesuffix(' at')} (column {error.colno})"


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _not_utf8(data: bytes, error: UnicodeDecodeError) -> str:
    column = error.start - data.rfind(b"\n", 0, error.start)
    return f"not UTF-8 (byte 0x{data[error.start]:02x} at column {column})"


# The "problem" of a .txt paragraph of only whitespace: layout, neither a document nor a bad one.
BLANK = "only whitespace (layout, not a document)"


def paragraphs(f: BinaryIO, chunk_chars: int = 1 << 20) -> Iterator[Document]:
    """Paragraphs split as `datasets`' text builder splits them (sample_by="paragraph": universal
    newlines, split on a blank line, empty pieces dropped), as raw bytes. Latin-1 maps each byte
    to one character, so the bytes come back exactly and a paragraph can be checked for UTF-8.
    The builder keeps a paragraph of only whitespace (spaces, tabs, the newline that an odd run of
    blank lines leaves at the end): its problem is BLANK."""
    # The wrapper closes f with it (the caller's `with` closing f again is harmless): a wrapper
    # left to the garbage collector is a ResourceWarning of an unclosed file.
    with io.TextIOWrapper(f, encoding="latin-1", newline=None) as text:
        line, carry = 1, ""
        while block := text.read(chunk_chars):
            pieces = (carry + block + text.readline()).split("\n\n")
            for piece in pieces[:-1]:
                if piece:
                    yield _paragraph(piece, line)
                line += piece.count("\n") + 2
            carry = pieces[-1]
        if carry:
            yield _paragraph(carry, line)


def _paragraph(piece: str, line: int) -> Document:
    raw = piece.encode("latin-1")
    if line == 1:
        # The file's byte-order mark (Windows editors write one) is not text, as in a .jsonl
        # file; `datasets`' text builder keeps it, and it was trained on as the first
        # document's first character (checks.py hands `datasets` a copy without it).
        raw = raw.removeprefix(BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"line {line + _line_of(raw, e.start) - 1} (in the paragraph from line {line})"
        return raw, where, _not_utf8(raw, e)
    if not text.strip():  # str.strip and text_problem's str.isspace agree on what is whitespace
        return raw, f"the paragraph from line {line}", BLANK
    return raw, f"the paragraph from line {line}", None
