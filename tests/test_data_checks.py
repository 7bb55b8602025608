"""components/data/checks.py on documents without text: a null text in a parquet file, empty or
whitespace-only texts in JSON lines, and what is not a file of documents at all."""

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.data.checks import BadDocumentError
from components.data.sources import load_documents
from components.data.windows import TokenWindows
from components.tokenizer import ByteTokenizer


def _load(path, tmp_path, split="train", **kwargs):
    return load_documents(str(path), split, val_every=1000, cache_dir=tmp_path / "cache", **kwargs)


def test_a_null_text_in_parquet_is_named_before_training_or_skipped(tmp_path, caplog):
    """Parquet files went to `datasets` unchecked: a null text stopped the run when it was
    reached, with a TypeError naming neither file nor row, under on_bad_document = "skip" too."""
    texts = [f"document {i}" for i in range(200)]
    texts[150] = None
    path = tmp_path / "null150.parquet"
    pq.write_table(pa.table({"text": texts, "id": list(range(200))}), path)
    with pytest.raises(BadDocumentError, match=rf"^{re.escape(str(path))}: row 150: field 'text' holds "
                                               r"null, not text; 1 bad document\(s\) in this file\. Set"):
        _load(path, tmp_path)
    with caplog.at_level(logging.WARNING):
        documents = _load(path, tmp_path, on_bad_document="skip")
    assert f"data: skipped a bad document: {path}: row 150: field 'text' holds null, not text" in \
        [r.getMessage() for r in caplog.records]
    kept = [t for t in texts if t is not None][1:]  # document 0 is held out
    assert documents["text"] == kept and documents["id"][149] == 151  # the other columns follow
    windows = TokenWindows(documents, ByteTokenizer(), seq_len=64)
    for _ in range(60):  # past the null's place, into the second epoch
        next(windows)


def test_a_parquet_column_that_is_not_text_is_one_line(tmp_path):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    with pytest.raises(BadDocumentError, match=rf"^{re.escape(str(path))}: column 'text' holds int64, not text"):
        _load(path, tmp_path, on_bad_document="skip")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_empty_documents_are_bad_documents(tmp_path, caplog, suffix):
    """docs/data.md: a document that has no text is named and stops the run (or is skipped under
    "skip"); an empty text was taken, and trained on as bos + eos alone, silently."""
    texts = ["one", "", "two", " \n\t", "three"]
    path = tmp_path / f"docs{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"text": texts}), path)
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": t} for t in texts]))
    else:
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    where = {".jsonl": ("line 2", "line 4"), ".json": ("element [1] of the array", "element [3] of the array"),
             ".parquet": ("row 1", "row 3")}[suffix]
    with pytest.raises(BadDocumentError, match=rf"^{re.escape(str(path))}: {re.escape(where[0])}: field "
                                               r"'text' is empty \(no text to train on\); 2 bad document"):
        _load(path, tmp_path)
    with caplog.at_level(logging.WARNING):
        documents = _load(path, tmp_path, on_bad_document="skip")
    assert list(documents["text"]) == ["two", "three"]  # "one" is held out
    warnings = [r.getMessage() for r in caplog.records]
    assert f"data: skipped a bad document: {path}: {where[1]}: field 'text' is only whitespace " \
           "(no text to train on)" in warnings
    assert warnings[-1] == 'data: skipped 2 bad document(s) in 1 file(s) ([data] on_bad_document = "skip")'


def test_a_file_of_empty_documents_only_is_named(tmp_path):
    path = tmp_path / "allempty.jsonl"
    path.write_text('{"text": ""}\n' * 5)
    with pytest.raises(ValueError, match=rf"^no documents in {re.escape(str(path))} \(all 5 were bad and skipped\)"):
        _load(path, tmp_path, on_bad_document="skip")


@pytest.mark.parametrize("whole", [True, False], ids=["dataset_dict", "dataset"])
def test_a_save_to_disk_folder_says_to_prepare_it(tmp_path, whole):
    """Read as a folder of data files, its dataset_info.json was the first document: "line 1:
    invalid JSON ... set on_bad_document = skip", which skips the metadata and reads no text."""
    import datasets
    from scripts.prepare_data import parse_args

    dataset = datasets.Dataset.from_dict({"text": ["one", "two"]})
    path = tmp_path / "saved"
    (datasets.DatasetDict({"train": dataset}) if whole else dataset).save_to_disk(str(path))
    with pytest.raises(ValueError) as error:
        _load(path, tmp_path, on_bad_document="skip")
    message = str(error.value)
    assert message.startswith(f"{path}: a dataset saved with datasets' save_to_disk, not a folder of ")
    command = re.search(r"`python3 -m (scripts\.prepare_data) (.*)`", message)
    args = parse_args(command[2].split())  # the command it gives is one prepare_data takes
    assert command[1] == "scripts.prepare_data" and args.hf_dataset == str(path)


def test_cached_reports_are_redone_under_other_document_rules(tmp_path, monkeypatch):
    """A file's report is cached; new rules of what counts as a document (DOCUMENT_RULES, which
    prepare_data records too) must not reuse one made under the old ones."""
    import components.data.checks as checks
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)))
    _load(path, tmp_path)
    reports = lambda: sorted(p.name for p in (tmp_path / "cache").rglob("*.report"))  # noqa: E731
    first = reports()
    _load(path, tmp_path)
    assert reports() == first and len(first) == 1  # the same rules: the cached one
    monkeypatch.setattr(checks, "DOCUMENT_RULES", checks.DOCUMENT_RULES + 1)
    _load(path, tmp_path)
    assert len(reports()) == 2  # made again under the new rules


@pytest.mark.parametrize("stop_early", [False, True])
def test_reading_a_text_file_leaves_no_file_open(tmp_path, stop_early):
    """The paragraphs' text wrapper was left to the garbage collector: a ResourceWarning of an
    unclosed file for every .txt file read (an error under -W error)."""
    import gc
    import warnings
    from components.data.document_reader import read_documents
    path = tmp_path / "notes.txt"
    path.write_text("first paragraph\n\nsecond\n\n\nthird \xe9\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        documents = read_documents(path, "text")
        texts = [next(documents)[0]] if stop_early else [text for text, *_ in documents]
        del documents
        gc.collect()
    everything = ["first paragraph", "second", "\nthird \xe9\n"]
    assert texts == (everything[:1] if stop_early else everything)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught
