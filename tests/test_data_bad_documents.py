"""Unreadable documents (not UTF-8, invalid JSON, a lone surrogate, no text field) are named or
skipped by [data] on_bad_document, checked once per file version; files without documents are
named. Documents whose text is null or empty: test_data_bad_texts.py, test_data_checks.py."""

import functools
import json
import logging
import re
from pathlib import Path

import pytest

from components.data import checks as data_check
from components.data.checks import BadDocumentError, MissingTextField
from components.data.sources import load_documents
from components.data.windows import TokenWindows
from test_data_windows import BYTE, framed, random_texts, read_tokens, split_documents, write_jsonl


def documents_read(documents, count: int) -> list[str]:
    """The first `count` documents a TokenWindows reads, as text."""
    tokens = read_tokens(TokenWindows(documents, BYTE, 7), len(framed(["x"] * count)) * 50)
    return split_documents(tokens)


def bad_jsonl(tmp_path: Path, rng) -> tuple[Path, list[str], dict[int, str]]:
    """A .jsonl of good documents with bad ones in the middle: the path, the good texts in order and
    {line number: what is wrong with it}."""
    texts = random_texts(rng, 12)
    lines = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]
    bad = {4: (b'{"text": "caf\xe9 au lait"}', r"not UTF-8 \(byte 0xe9 at column 14\)"),  # Latin-1
           7: (b'{"text": "cut off', r"invalid JSON: Unterminated string starting \(column 10\)"),
           9: (b'["text", "an array"]', "a JSON array, not an object"),
           12: (b'{"text": null}', "field 'text' holds a JSON null, not text"),
           13: (b'{"body": "elsewhere"}', r"no field 'text' \(its fields: body\)")}
    for number in sorted(bad):
        lines.insert(number - 1, bad[number][0])
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, texts, {number: why for number, (_, why) in bad.items()}


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_documents_are_named_or_skipped(tmp_path, rng, caplog, streaming):
    """A non-UTF-8 document killed the run when it was reached (and after every resume) with a bare
    UnicodeDecodeError; a malformed line failed the whole file. Now "error" names the first bad one
    before anything is read, and "skip" reads exactly the good documents, naming each skipped one."""
    path, texts, bad = bad_jsonl(tmp_path, rng)
    def load(split="train", **kwargs):
        return load_documents(str(path), split, streaming=streaming, val_every=1000,
                              cache_dir=tmp_path / "cache", **kwargs)
    first = rf"^{re.escape(str(path))}: line 4: {bad[4]}; 5 bad document\(s\) in this file\. "
    with pytest.raises(BadDocumentError, match=first + r"Set \[data\] on_bad_document = \"skip\""):
        load()
    with caplog.at_level(logging.WARNING):
        documents = load(on_bad_document="skip")
    assert documents_read(documents, len(texts))[:len(texts) - 1] == texts[1:]  # 0 is held out
    warnings = [r.getMessage() for r in caplog.records]
    for number, why in bad.items():
        named = rf"data: skipped a bad document: {re.escape(str(path))}: line {number}: {why}"
        assert any(re.fullmatch(named, w) for w in warnings), (number, warnings)
    assert warnings[-1] == 'data: skipped 5 bad document(s) in 1 file(s) ([data] on_bad_document = "skip")'
    validation = load(split="validation", on_bad_document="skip")
    assert documents_read(validation, 1)[0] == texts[0]


def test_an_escaped_lone_surrogate_is_a_named_bad_document(tmp_path):
    """'\\ud83d' alone is valid JSON but no text: the check passed it, then pyarrow failed the whole
    file with a DatasetGenerationError naming neither file nor line."""
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "held out"}\n{"text": "a"}\n{"text": "cut \\ud83d emoji"}\n{"text": "b"}\n')
    load = functools.partial(load_documents, str(path), "train", val_every=1000,
                             cache_dir=tmp_path / "cache")
    with pytest.raises(BadDocumentError, match=rf"^{re.escape(str(path))}: line 3: field 'text' holds a lone "
                                               r"surrogate \(\\ud83d at character 4\), not UTF-8 text; 1 bad"):
        load()
    assert [d["text"] for d in load(on_bad_document="skip")] == ["a", "b"]
    array = tmp_path / "docs.json"  # a JSON array: a bare UnicodeEncodeError while checking it
    array.write_text('[{"text": "held out"}, {"text": "a"}, {"text": "cut \\ud83d emoji"}, {"text": "b"}]')
    with pytest.raises(BadDocumentError, match=r"docs\.json: element \[2\] of the array: field 'text' holds "
                                               r"a lone surrogate"):
        load_documents(str(array), "train", val_every=1000, cache_dir=tmp_path / "cache")
    skipped = load_documents(str(array), "train", val_every=1000, cache_dir=tmp_path / "cache",
                             on_bad_document="skip")
    assert [d["text"] for d in skipped] == ["a", "b"]


def test_checked_files_are_read_once_until_they_change(tmp_path, rng, monkeypatch):
    path, texts, _ = bad_jsonl(tmp_path, rng)
    load = functools.partial(load_documents, str(path), "train", val_every=1000, cache_dir=tmp_path / "cache",
                             on_bad_document="skip")
    load()

    def read_again(*args, **kwargs):
        raise AssertionError("read again")
    monkeypatch.setattr(data_check, "_scan", read_again)
    assert documents_read(load(), len(texts))[:len(texts) - 1] == texts[1:]  # from the cache
    path.write_bytes(path.read_bytes() + json.dumps({"text": "one more"}).encode() + b"\n")
    with pytest.raises(AssertionError, match="read again"):
        load()


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_paragraph_of_a_text_file(tmp_path, rng, streaming):
    paragraphs = [t.replace("\n", " ") for t in random_texts(rng, 6)]
    raw = [p.encode() for p in paragraphs]
    raw.insert(3, b"line one\nline tw\xff")  # the fourth paragraph, lines 7 and 8
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\r\n\r\n".join(raw) + b"\n")  # universal newlines, as datasets reads
    load = functools.partial(load_documents, str(path), "train", streaming=streaming, val_every=1000,
                             cache_dir=tmp_path / "cache")
    where = r"line 8 \(in the paragraph from line 7\): not UTF-8 \(byte 0xff at column 8\)"
    with pytest.raises(BadDocumentError, match=rf"^{re.escape(str(path))}: {where}; 1 bad document"):
        load()
    got = documents_read(load(on_bad_document="skip"), 5)
    assert got[:4] == paragraphs[1:5] and got[4] == paragraphs[5] + "\n"


def test_json_array_file(tmp_path):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}, 3, {"text": "d"}, {"text": "e"}]))
    with pytest.raises(BadDocumentError, match=r"docs\.json: element \[2\] of the array: a JSON number, not "
                                               r"an object; 1 bad document"):
        load_documents(str(path), "train", val_every=2, cache_dir=tmp_path / "cache")
    documents = load_documents(str(path), "train", val_every=2, cache_dir=tmp_path / "cache",
                               on_bad_document="skip")
    assert [d["text"] for d in documents] == ["b", "e"]  # a, b, d, e: every second one held out
    path.write_bytes(b'[{"text": "a"},\n {"text": "\xff"}]')
    with pytest.raises(BadDocumentError, match=r"line 2: not UTF-8 .*; a JSON array is read as one piece, so "
                                               r"nothing in it can be skipped"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache", on_bad_document="skip")


@pytest.mark.parametrize("name", ["doc.json", "doc.jsonl"])
def test_one_pretty_printed_object_is_named_as_such(tmp_path, capsys, name):
    """A document pretty-printed over several lines (or a dict of documents) was read as that
    many bad lines: "line 1: invalid JSON ... N bad documents", and under skip every line left
    out; the trainer and prepare_data now say what the file is."""
    path = tmp_path / name
    path.write_text(json.dumps({"text": "one document", "source": "x"}, indent=2) + "\n")
    message = (rf"{re.escape(str(path))}: one JSON object over 5 lines, not a document a line "
               r"\(JSON lines\) nor a JSON array of documents: write each document on a line of "
               r"its own")
    for on_bad_document in ("error", "skip"):
        with pytest.raises(BadDocumentError, match=message):
            load_documents(str(path), "train", cache_dir=tmp_path / "cache",
                           on_bad_document=on_bad_document)
    from scripts import prepare_data
    assert prepare_data.main(["--source", str(path), "--tokenizer", "byte", "--out",
                              str(tmp_path / "shards"), "--workers", "1",
                              "--on-bad-document", "skip"]) != 0
    assert re.search(message, capsys.readouterr().err)
    path.write_text('{"text": "a"}\n{"text": \n')  # JSON lines with a bad line: as before
    with pytest.raises(BadDocumentError, match=r"line 2: invalid JSON"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache")
    path.write_text('{"body": "a"}\n')  # one document a line, without the text field: as before
    with pytest.raises(KeyError, match=r"the documents have no field 'text' \(their fields: "
                                       r"body\)"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("name,content,why", [
    ("empty.jsonl", b"", "the file is empty"),  # was a bare StopIteration
    ("blank.jsonl", b"\n  \n\n", "only blank lines"),
    ("empty.txt", b"", "the file is empty"),  # was a DatasetGenerationError
    ("empty.json", b" [ ]", "an empty JSON array"),
    ("bad.jsonl", b"\xff\n", "all 1 were bad and skipped"),
])
def test_a_source_without_documents_is_named(tmp_path, name, content, why):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^no documents in {re.escape(str(path))} \({why}\)$"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache", on_bad_document="skip")


def test_an_empty_file_among_others_is_a_warning(tmp_path, caplog):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b"")
    write_jsonl(folder / "b.jsonl", ["x", "y", "z"])
    with caplog.at_level(logging.WARNING):
        documents = load_documents(str(folder), "train", val_every=2, cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == ["y"]
    assert f"data: {folder / 'a.jsonl'} holds no documents (the file is empty)" in caplog.messages
    with pytest.raises(MissingTextField, match=r"b\.jsonl: the documents have no field 'body' "
                                               r"\(their fields: text\); set \[data\] text_field"):
        load_documents(str(folder), "train", text_field="body", cache_dir=tmp_path / "cache")
