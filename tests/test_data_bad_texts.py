"""Documents without text (null, empty, only whitespace) are bad documents everywhere the trainer
reads text: scripts.prepare_data named none of the empty ones (each became a bos/eos-only document
in the shards), and a dataset `datasets` loads by name was not checked at all (a null text stopped
the run mid-way with a TypeError naming no dataset or row; an empty one trained silently)."""

import json
import logging
import re

import datasets
import huggingface_hub.constants
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.data.checks import BadDocumentError
from components.data.shards import read_index
from components.data.sources import load_documents
from components.data.windows import TokenWindows
from components.tokenizer import ByteTokenizer
from shard_cases import framed, shard_documents

from scripts import prepare_data

BYTE = ByteTokenizer()
TEXTS = ["one", "", "two", " \n\t", "three"]  # rows 1 and 3 are bad
WHERE = {".jsonl": ("line 2", "line 4"), ".json": ("element [1] of the array", "element [3] of the array"),
         ".parquet": ("row 1", "row 3")}


def _write(path, texts):
    if path.suffix == ".parquet":
        pq.write_table(pa.table({"text": texts}), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps([{"text": t} for t in texts]))
    else:
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _prepare(*args) -> int:
    return prepare_data.main([str(a) for a in (*args, "--tokenizer", "byte", "--workers", 1,
                                               "--val-every", 0, "--no-progress")])


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_prepare_data_names_an_empty_text_or_skips_it_as_the_trainer_does(tmp_path, capsys, suffix):
    path = _write(tmp_path / f"docs{suffix}", TEXTS)
    assert _prepare("--source", path, "--out", tmp_path / "stop") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"prepare_data.py: error: {path}: {WHERE[suffix][0]}: field 'text' is empty (no text to train on). "
        "Pass --on-bad-document skip"), err

    assert _prepare("--source", path, "--out", tmp_path / "skip", "--on-bad-document", "skip") == 0
    out = capsys.readouterr().out
    assert "skipped 2 bad document(s), the first: " in out and "is only whitespace" in out
    assert read_index(tmp_path / "skip")["skipped_documents"] == 2
    assert shard_documents(tmp_path / "skip", "train") == [framed(BYTE, t) for t in ("one", "two", "three")]
    # The documents the trainer reads from the same file under "skip" (document 0 held out).
    trainer = load_documents(str(path), "train", val_every=2, cache_dir=tmp_path / "cache", on_bad_document="skip")
    assert list(trainer["text"]) == ["two"]


@pytest.mark.parametrize("streaming", [False, True])
def test_prepare_data_checks_hugging_face_rows_as_the_trainer_does(tmp_path, capsys, streaming):
    saved = tmp_path / "folder"  # --hf-dataset FOLDER of data files; --hf-streaming reads them file by file
    saved.mkdir()
    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(str(saved / "train-00000.parquet"))
    args = ["--hf-dataset", saved, *(["--hf-streaming"] if streaming else [])]
    assert _prepare(*args, "--out", tmp_path / "stop") == 1
    where = "shard 0, row 1" if streaming else "row 1"
    assert f"{where}: field 'text' is empty (no text to train on)" in capsys.readouterr().err
    assert _prepare(*args, "--out", tmp_path / "skip", "--on-bad-document", "skip") == 0
    assert shard_documents(tmp_path / "skip", "train") == [framed(BYTE, t) for t in ("one", "two", "three")]


# ---------------------------------------------------------------------------- [data] source = a Hub name

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """Offline, `datasets.load_dataset("owner/name")` loads the copy in its cache (as after a
    download): the trainer's Hub path, with no network. Returns a function that puts datasets
    (built here with Dataset.from_dict) in that cache under a name."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def cache_as_hub_dataset(repo_id: str, splits: dict[str, dict]) -> str:
        owner, name = repo_id.split("/")
        folder = cache / f"{owner}___{name}" / "default" / "0.0.0" / "0123456789abcdef"
        folder.mkdir(parents=True)
        info = datasets.DatasetInfo(config_name="default", dataset_name=name)
        info.splits = datasets.SplitDict()
        for split, columns in splits.items():
            dataset = datasets.Dataset.from_dict(columns)
            info.features = dataset.features
            info.splits.add(datasets.SplitInfo(split, num_examples=len(dataset), dataset_name=name))
            with pa.OSFile(str(folder / f"{name}-{split}.arrow"), "wb") as f, \
                    pa.ipc.new_stream(f, dataset.data.schema) as writer:
                writer.write_table(dataset.data.table)
        info.write_to_directory(str(folder))
        return repo_id

    return cache_as_hub_dataset


def _texts_with_bad_rows(count: int = 60) -> list:
    texts = [f"document {i} " + "word " * (i % 7) for i in range(count)]
    texts[7], texts[12], texts[30] = None, "", " \n"
    return texts


def _windows(documents, count: int = 40) -> list[list[int]]:
    windows = TokenWindows(documents, BYTE, seq_len=16)
    return [next(windows)[0].tolist() for _ in range(count)]  # past the bad rows, into epoch 2


def test_a_hub_dataset_row_without_text_is_named_before_training(hub_cache, tmp_path):
    source = hub_cache("tester/nulls", {"train": {"text": _texts_with_bad_rows()}})
    with pytest.raises(BadDocumentError) as error:
        load_documents(source, "train", val_every=1000, cache_dir=tmp_path / "cache")
    assert str(error.value) == (
        "tester/nulls, split 'train': row 7: field 'text' holds null, not text; 3 bad document(s) in this "
        "split. Set [data] on_bad_document = \"skip\" to skip them (each is then named in a warning)")
    source = hub_cache("tester/own-validation", {"train": {"text": ["a", "b"]},
                                                 "validation": {"text": ["c", "", "d"]}})
    load_documents(source, "train", cache_dir=tmp_path / "cache")
    with pytest.raises(BadDocumentError, match=r"^tester/own-validation, split 'validation': row 1: field "
                                               r"'text' is empty \(no text to train on\); 1 bad"):
        load_documents(source, "validation", cache_dir=tmp_path / "cache")
    source = hub_cache("tester/numbers", {"train": {"text": [1, 2, 3]}})
    with pytest.raises(BadDocumentError, match=r"^tester/numbers, split 'train': column 'text' holds int64, not text"):
        load_documents(source, "train", cache_dir=tmp_path / "cache", on_bad_document="skip")


def test_a_hub_dataset_row_without_text_is_skipped_and_counted(hub_cache, tmp_path, caplog):
    texts = _texts_with_bad_rows()
    source = hub_cache("tester/skips", {"train": {"text": texts, "id": list(range(len(texts)))}})
    with caplog.at_level(logging.WARNING):
        train = load_documents(source, "train", val_every=5, cache_dir=tmp_path / "cache", on_bad_document="skip")
        validation = load_documents(source, "validation", val_every=5, cache_dir=tmp_path / "cache",
                                    on_bad_document="skip")
    good = [t for t in texts if t and t.strip()]
    assert list(validation["text"]) == good[::5]  # held out of the documents left
    assert list(train["text"]) == [t for i, t in enumerate(good) if i % 5] and 7 not in train["id"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "components.data.checks"]
    assert "data: skipped a bad document: tester/skips, split 'train': row 30: field 'text' is only " \
           "whitespace (no text to train on)" in warnings
    assert warnings[-1] == "data: skipped 3 bad document(s) in tester/skips, split 'train' " \
                           "([data] on_bad_document = \"skip\")"  # once, not again for validation
    assert len(warnings) == 4
    expected = np.concatenate([framed(BYTE, t) for t in list(train["text"]) * 2])
    assert _windows(train, 10) == [expected[17 * i:17 * i + 16].tolist() for i in range(10)]


def test_a_streamed_hub_dataset_names_the_row_when_read_or_skips_it(hub_cache, tmp_path, caplog):
    """A stream is not read ahead: its rows are checked as training reads them."""
    texts = _texts_with_bad_rows()
    source = hub_cache("tester/stream", {"train": {"text": texts}})
    load = lambda **kwargs: load_documents(source, "train", val_every=5, streaming=True,  # noqa: E731
                                           cache_dir=tmp_path / "cache", **kwargs)
    with pytest.raises(BadDocumentError, match=re.escape(
            "tester/stream, split 'train': row 7: field 'text' holds null, not text. Set [data] "
            "on_bad_document = \"skip\" to skip such documents")):
        _windows(load())
    with caplog.at_level(logging.WARNING):
        streamed = _windows(load(on_bad_document="skip"))
    warnings = [r.getMessage() for r in caplog.records if r.name == "components.data.checks"]
    assert streamed == _windows(load_documents(source, "train", val_every=5, cache_dir=tmp_path / "cache",
                                               on_bad_document="skip"))
    assert len(warnings) == 3, warnings  # each counted once, though read again in epoch 2
    assert warnings[-1] == ("data: skipped a bad document: tester/stream, split 'train': row 30: field 'text' "
                            "is only whitespace (no text to train on) (3 skipped so far, [data] "
                            "on_bad_document = \"skip\")")


# ------------------------------------------------------------- .txt: paragraphs of only whitespace

# Paragraphs laid out with whitespace: a byte-order mark on a line of its own, spaces and tabs between
# blank lines, odd runs of blank lines (one leaves a "\n" paragraph at the end), a no-break space,
# CRLF. `datasets`' text builder made a document of each of the 7 whitespace pieces (bos, whitespace,
# eos); they are layout, as a blank line of a .jsonl file is, so they are left out without a word.
LAID_OUT = ("\ufeff\r\n\r\none\r\n\r\n  \t \r\n\r\ntwo\n  lines \n\n\n\n\n"
            "three\n\n\t\n  \n\n \n\n\nfour\n\n\u00a0\n\nfive \n\n   \n\n\n")
# The paragraphs as the builder gives them: leading and trailing whitespace is the text's own.
PARAGRAPHS = ["one", "two\n  lines ", "\nthree", "\nfour", "five "]


def _laid_out(path, raw=LAID_OUT.encode()):
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("streaming", [False, True])
def test_a_text_file_paragraph_of_only_whitespace_is_not_a_document(tmp_path, caplog, streaming):
    path = _laid_out(tmp_path / "notes.txt")
    load = lambda split, **kwargs: load_documents(str(path), split, streaming=streaming,  # noqa: E731
                                                  val_every=2, cache_dir=tmp_path / "cache", **kwargs)
    with caplog.at_level(logging.WARNING):
        validation, train = load("validation"), load("train")  # on_bad_document = "error"
        # Held out by their number among the documents, whitespace not counted.
        assert [d["text"] for d in validation] == PARAGRAPHS[::2]
        assert [d["text"] for d in train] == PARAGRAPHS[1::2]
        tokens = []
        windows = TokenWindows(train, BYTE, seq_len=8)
        while len(tokens) < 60:
            inputs, labels = next(windows)
            tokens += inputs.tolist() + labels[-1:].tolist()
    expected = np.concatenate([framed(BYTE, t) for t in PARAGRAPHS[1::2] * 3]).tolist()
    assert tokens == expected[:len(tokens)]
    assert not [r for r in caplog.records if r.name == "components.data.checks"]  # not bad documents

    # A bad paragraph among them is counted alone.
    bad = _laid_out(tmp_path / "bad.txt", LAID_OUT.encode().replace(b"\nfour", b"\nf\xffur"))
    with pytest.raises(BadDocumentError, match=r"bad\.txt: line 21 \(in the paragraph from line 20\): "
                                               r"not UTF-8 \(byte 0xff at column 2\); 1 bad document\(s\)"):
        load_documents(str(bad), "train", streaming=streaming, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        documents = load_documents(str(bad), "train", streaming=streaming, val_every=1000,
                                   cache_dir=tmp_path / "cache", on_bad_document="skip")
        assert [d["text"] for d in documents] == ["two\n  lines ", "\nthree", "five "]
    assert caplog.messages[-1] == "data: skipped 1 bad document(s) in 1 file(s) ([data] on_bad_document = \"skip\")"

    # A file of nothing but whitespace holds no documents (it was one document of spaces).
    empty = _laid_out(tmp_path / "blank.txt", b" \n\n\t \r\n  \n\n\n")
    with pytest.raises(ValueError, match=rf"^no documents in {re.escape(str(empty))} \(only blank lines\)$"):
        load_documents(str(empty), "train", streaming=streaming, cache_dir=tmp_path / "cache")


def test_prepare_data_leaves_out_a_text_file_paragraph_of_only_whitespace(tmp_path, capsys):
    path = _laid_out(tmp_path / "notes.txt")
    assert _prepare("--source", path, "--out", tmp_path / "shards") == 0  # --on-bad-document error
    assert "skipped" not in capsys.readouterr().out
    assert read_index(tmp_path / "shards")["skipped_documents"] == 0
    assert shard_documents(tmp_path / "shards", "train") == [framed(BYTE, t) for t in PARAGRAPHS]
    # The documents the trainer reads from the same file (document 0 held out).
    trainer = load_documents(str(path), "train", val_every=10**9, cache_dir=tmp_path / "cache")
    assert list(trainer["text"]) == PARAGRAPHS[1:]


# ---------------------------------------------------------------------- .txt: a byte-order mark

@pytest.mark.parametrize("streaming", [False, True])
def test_a_text_files_byte_order_mark_is_not_trained_on(tmp_path, capsys, streaming):
    """A .txt file saved with a UTF-8 byte-order mark (Windows editors): its first document
    started with U+FEFF, trained on as text (bytes ef bb bf) by the trainer (`datasets`' text
    builder keeps it) and by prepare_data, while the same mark at the start of a .jsonl file is
    dropped. It is dropped from a .txt file too, and both give the same tokens."""
    paragraphs = ["first paragraph", "second\nparagraph"]
    txt = _laid_out(tmp_path / "notes.txt", ("\ufeff" + "\n\n".join(paragraphs)).encode())
    jsonl = _laid_out(tmp_path / "notes.jsonl", b'\xef\xbb\xbf{"text": "first paragraph"}\n')

    def load(path, **kwargs):
        return load_documents(str(path), "train", streaming=streaming, val_every=0,
                              cache_dir=tmp_path / "cache", **kwargs)

    assert [d["text"] for d in load(jsonl)] == ["first paragraph"]
    assert [d["text"] for d in load(txt)] == paragraphs
    windows = TokenWindows(load(txt), BYTE, seq_len=len("".join(paragraphs)) + 3)
    inputs, labels = next(windows)
    expected = [framed(BYTE, t) for t in paragraphs]
    assert inputs.tolist() + labels[-1:].tolist() == expected[0] + expected[1]
    assert _prepare("--source", txt, "--out", tmp_path / "shards") == 0, capsys.readouterr().err
    assert shard_documents(tmp_path / "shards", "train") == expected

    # A file the trainer reads from a copy without its bad documents: no mark in the copy either.
    bad = _laid_out(tmp_path / "bad.txt", txt.read_bytes() + b"\n\nb\xffd\n")
    assert [d["text"] for d in load(bad, on_bad_document="skip")] == paragraphs
    assert _prepare("--source", bad, "--out", tmp_path / "skip", "--on-bad-document", "skip") == 0
    assert shard_documents(tmp_path / "skip", "train") == expected
