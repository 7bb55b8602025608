"""load_documents and build_data on text sources: the stdlib corpus, JSON lines, parquet, text
files, folders of them, a Hub name offline; sources that cannot be read are named."""

import bz2
import gzip
import json
import logging
import lzma
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from components.config.schema import Data, Training
from components.data.build import build_data
from components.data.checks import BadDocumentError, MissingTextField
from components.data.sources import STDLIB_CORPUS_BYTES, embedded_corpus, load_documents
from components.data.windows import TokenWindows
from shard_cases import shard_documents
from test_data_windows import BYTE, framed, random_texts, read_tokens, write_jsonl

from scripts import prepare_data


def test_stdlib_corpus_builds_offline_once_and_yields_windows(tmp_path):
    path = embedded_corpus(tmp_path / "a")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    paths = [r["path"] for r in rows]
    assert paths == sorted(paths)
    assert not any(set(p.split("/")) & {"site-packages", "test", "tests", "idlelib"} for p in paths)
    text_bytes = sum(len(r["text"].encode("utf-8")) for r in rows)
    assert 0.9 * STDLIB_CORPUS_BYTES < text_bytes <= STDLIB_CORPUS_BYTES

    modified = path.stat().st_mtime_ns
    assert embedded_corpus(tmp_path / "a") == path and path.stat().st_mtime_ns == modified
    assert embedded_corpus(tmp_path / "b").read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if p.is_file()) == [path.name]  # no temp file

    seq_len = 32
    stdlib = Data(source="stdlib", cache_dir=str(tmp_path / "a"), num_workers=0)
    batches = build_data(stdlib, Training(seq_len=seq_len, local_batch_size=3), split="train",
                         tokenizer=BYTE, max_token_id=BYTE.vocab_size)
    inputs, labels = next(batches)
    assert inputs.shape == labels.shape == (3, seq_len)
    expected = framed([r["text"] for i, r in enumerate(rows[:100]) if i % 100])[:3 * (seq_len + 1)]
    assert torch.cat([inputs, labels[:, -1:]], dim=1).flatten().tolist() == expected

    validation = build_data(stdlib, Training(seq_len=seq_len, local_batch_size=2),
                            split="validation", tokenizer=BYTE)
    assert next(validation)[0].tolist()[0][:seq_len] == framed([rows[0]["text"]])[:seq_len]


def test_parquet_with_another_text_field(tmp_path, rng):
    texts = random_texts(rng, 10)
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), path)
    documents = load_documents(str(path), "train", text_field="content", val_every=2,
                               cache_dir=tmp_path / "cache")
    assert [d["content"] for d in documents] == texts[1::2]
    assert read_tokens(TokenWindows(documents, BYTE, 5, text_field="content"), 3) == framed(texts[1::2])[:18]

    with pytest.raises(MissingTextField, match=r"no field 'text' \(their fields: id, content\)"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache")


def test_text_file_gives_one_document_per_paragraph(tmp_path, rng):
    paragraphs = ["\n".join(random_texts(rng, rng.randint(1, 3))) for _ in range(8)]
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(paragraphs), encoding="utf-8")
    documents = load_documents(str(path), "train", val_every=4, cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == [p for i, p in enumerate(paragraphs) if i % 4]


def test_directory_of_files_in_name_order(tmp_path, rng):
    texts = random_texts(rng, 9)
    folder = tmp_path / "corpus"
    (folder / "part").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    write_jsonl(folder / "b.jsonl", texts[5:])
    write_jsonl(folder / "part" / "a.jsonl", texts[:5])  # "b.jsonl" < "part/a.jsonl"
    write_jsonl(folder / ".hidden" / "stale.jsonl", ["never read"])
    documents = load_documents(str(folder), "train", val_every=1000, cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == (texts[5:] + texts[:5])[1:]

    (folder / "notes.txt").write_text("a paragraph", encoding="utf-8")
    with pytest.raises(ValueError, match=r"corpus: mixes file types \.jsonl, \.txt"):
        load_documents(str(folder), "train", cache_dir=tmp_path / "cache")


def test_bad_sources_and_fields_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing/docs.jsonl"):
        load_documents(str(tmp_path / "missing" / "docs.jsonl"), "train", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="val_every=1"):
        load_documents("stdlib", "train", val_every=1, cache_dir=tmp_path)
    path = write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    with pytest.raises(ValueError, match=r"no split 'test' \(it has train\)"):
        load_documents(str(path), "test", cache_dir=tmp_path)

    documents = datasets.Dataset.from_dict({"body": ["x", "y"]})
    with pytest.raises(MissingTextField, match=r"document 0 has no field 'text' \(its fields: body\)"):
        next(TokenWindows(documents, BYTE, 4))
    with pytest.raises(ValueError, match="rank 2 of 3 gets no documents: there are only 2"):
        TokenWindows(documents, BYTE, 4, dp_rank=2, dp_world=3, text_field="body")


def test_hub_name_offline_says_what_to_use_instead(tmp_path):
    # The Hub client reads its offline switch at import, so this runs in a fresh interpreter; offline it
    # fails at once instead of retrying the network.
    code = ("from components.data.sources import load_documents\n"
            "try:\n"
            "    load_documents('nobody/no-such-dataset', 'train')\n"
            "except ValueError as err:\n"
            "    print(err)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert "could not load data source 'nobody/no-such-dataset'" in result.stdout, result.stderr
    assert "network access" in result.stdout and '"stdlib"' in result.stdout


@pytest.mark.parametrize("bars_were_off", [False, True])
def test_local_files_load_without_datasets_progress_bar(tmp_path, capfd, bars_were_off):
    """datasets drew "Generating train split" into the training log when a file first went
    into its Arrow cache; the bars are off for that call only, as they were before it."""
    before = datasets.are_progress_bars_disabled()
    (datasets.disable_progress_bars if bars_were_off else datasets.enable_progress_bars)()
    try:
        corpus = write_jsonl(tmp_path / "corpus.jsonl", ["one", "two", "three"])
        documents = load_documents(str(corpus), "train", val_every=2,
                                   cache_dir=tmp_path / "cache")
        assert documents["text"] == ["two"]
        assert "Generating" not in capfd.readouterr().err
        assert datasets.are_progress_bars_disabled() == bars_were_off
    finally:
        (datasets.disable_progress_bars if before else datasets.enable_progress_bars)()


@pytest.mark.parametrize("encoding", ["dictionary", "string_view"])
def test_a_parquet_text_column_dictionary_encoded_or_a_view_is_text(tmp_path, encoding):
    """A pandas category column (dictionary<string>) or a string_view one: `datasets` and
    prepare_data read them as text, the trainer refused them ("holds dictionary<...>, not text").
    Their empty texts are still found."""
    texts = ["alpha beta", "gamma", "", "delta epsilon", "alpha beta"]
    column = pa.array(texts)
    column = column.dictionary_encode() if encoding == "dictionary" else column.cast(pa.string_view())
    pq.write_table(pa.table({"text": column}), tmp_path / "c.parquet")
    with pytest.raises(BadDocumentError, match=r"row 2: field 'text' is empty"):
        load_documents(str(tmp_path / "c.parquet"), "train", cache_dir=tmp_path / "cache")
    documents = load_documents(str(tmp_path / "c.parquet"), "train", cache_dir=tmp_path / "cache",
                               on_bad_document="skip")
    assert [d["text"] for d in documents] == ["gamma", "delta epsilon", "alpha beta"]


def _jsonl_with(path: Path, texts: list[str], fields) -> None:
    path.write_text("".join(json.dumps({"text": t, **fields(i)}) + "\n"
                            for i, t in enumerate(texts)))


@pytest.mark.parametrize("streaming", [False, True])
def test_files_whose_other_fields_differ_are_read_for_their_text(tmp_path, rng, streaming):
    """Per-file metadata (an id in one file, a repo in another): `datasets` loads files together
    only when their fields agree, and the trainer died with a CastError traceback."""
    texts = random_texts(rng, 30)
    folder = tmp_path / "mixed"
    folder.mkdir()
    _jsonl_with(folder / "a_web.jsonl", texts[:10], lambda i: {"id": i})
    _jsonl_with(folder / "b_code.jsonl", texts[10:20],
                lambda i: {"repo": "x/y", "meta": {"stars": i}})
    _jsonl_with(folder / "c_web.jsonl", texts[20:], lambda i: {"id": i})
    for split, expected in (("validation", texts[::4]),
                            ("train", [t for i, t in enumerate(texts) if i % 4])):
        documents = load_documents(str(folder), split, streaming=streaming, val_every=4,
                                   cache_dir=tmp_path / "cache")
        assert [d["text"] for d in documents] == expected, split
    count = len(framed(expected)) // 9
    assert read_tokens(TokenWindows(documents, BYTE, 8), count) == framed(expected)[:count * 9]

    parquet = tmp_path / "parquet"
    parquet.mkdir()
    pq.write_table(pa.table({"text": texts[:10], "id": list(range(10))}), parquet / "a.parquet")
    pq.write_table(pa.table({"text": texts[10:], "repo": ["x/y"] * 20}), parquet / "b.parquet")
    documents = load_documents(str(parquet), "train", streaming=streaming, val_every=0,
                               cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == texts


def test_a_file_datasets_cannot_load_is_one_line_naming_it(tmp_path):
    """What check_files lets through and `datasets` still fails on (a field given twice) was a
    DatasetGenerationError traceback, naming no file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ["one document", "another"])
    (folder / "b.jsonl").write_text('{"text": "a document", "text": "twice"}\n')
    with pytest.raises(ValueError) as error:
        load_documents(str(folder), "train", val_every=0, cache_dir=tmp_path / "cache")
    message = str(error.value)
    assert message.startswith(f"{folder / 'b.jsonl'}: `datasets` could not load it (ArrowInvalid:")
    assert "\n" not in message and error.value.user_error


def test_a_folder_of_token_shard_folders_says_to_name_one_or_mix_them(tmp_path):
    """It was read as text: "sh_a/index.json: line 1: invalid JSON ... Set [data]
    on_bad_document = "skip"", which leads nowhere."""
    from shard_cases import write_token_shards
    import numpy as np
    parent = tmp_path / "allshards"
    for name in ("sh_a", "sh_b"):
        write_token_shards(parent / name, [np.arange(40) % 250], BYTE.vocab_size, BYTE)
    data = Data(source=str(parent), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as error:
        build_data(data, Training(seq_len=8, local_batch_size=1), split="train", tokenizer=BYTE)
    assert str(error.value) == (
        f"{parent}: holds token shard folders made by scripts.prepare_data ({parent / 'sh_a'}, "
        f"{parent / 'sh_b'}), which are not text to read: set [data] source to one of them, or "
        "mix them by weight with [[data.mixture]] tables (source = ..., weight = ...) or "
        f"--data.mixture \"{parent / 'sh_a'}:1,{parent / 'sh_b'}:1\"")
    # one of them as the source is read as shards
    batches = build_data(Data(source=str(parent / "sh_a")), Training(seq_len=8, local_batch_size=1),
                         split="train", tokenizer=BYTE)
    assert next(iter(batches))[0].shape == (1, 8)
    batches.close()


COMPRESS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def _compressed(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with COMPRESS[path.suffix](path, "wb") as f:
        f.write(data)
    return path


def _jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def _prepared(tmp_path, source: Path, out: str, *extra) -> list[list[int]]:
    """The train documents prepare_data makes of source (all of them: --val-every 0)."""
    assert prepare_data.main([str(a) for a in ("--source", source, "--tokenizer", "byte", "--out",
                                               tmp_path / out, "--val-every", 0, "--workers", 1,
                                               "--no-progress", *extra)]) == 0
    return shard_documents(tmp_path / out, "train")


def test_a_compressed_corpus_file_in_a_source_folder_is_read_or_named_not_left_out(tmp_path):
    """A folder holding the corpus as .jsonl.gz (which `datasets` reads natively) and a small
    .txt note: the trainer trained on the note alone and prepare_data sharded the note alone, and
    neither said a word about the compressed file that holds the data. Both read it now; the
    trainer, which reads one kind of file per folder, names both files in its refusal."""
    folder = tmp_path / "corpus"
    texts = [f"compressed document {i}" for i in range(100)]
    _compressed(folder / "part-00000.jsonl.gz", _jsonl_bytes(texts))
    (folder / "notes.txt").write_text("downloaded on Monday\n")
    with pytest.raises(ValueError) as error:
        load_documents(str(folder), "train", val_every=0, cache_dir=tmp_path / "cache")
    assert str(error.value) == (
        f"{folder}: mixes file types .jsonl.gz, .txt ({folder / 'notes.txt'}, "
        f"{folder / 'part-00000.jsonl.gz'}); one directory must hold one kind")
    assert len(_prepared(tmp_path, folder, "shards")) == 101


@pytest.mark.parametrize("codec", [".gz", ".bz2", ".xz"])
def test_compressed_files_are_read_and_other_files_named_by_the_trainer_and_prepare_data(
        tmp_path, rng, capsys, caplog, codec):
    """.jsonl.gz/.bz2/.xz files were left out of a source folder without a word (the trainer
    read the plain .jsonl beside them, or said the folder held no .jsonl files; prepare_data
    likewise); so were files of any other kind. Compressed .jsonl/.json/.txt files are read now,
    whole (one unit of prepare_data's), and both give the same documents; other files are named
    in one line."""
    texts = random_texts(rng, 30)
    folder = tmp_path / "corpus"
    _compressed(folder / f"part-00000.jsonl{codec}", _jsonl_bytes(texts[:20]))
    write_jsonl(folder / "part-00001.jsonl", texts[20:])  # beside a plain one
    (folder / "README.md").write_text("how this corpus was made\n")
    (folder / "part-00002.jsonl.zst").write_bytes(b"(zstd: not read)")
    with caplog.at_level(logging.WARNING):
        for streaming in (False, True):
            documents = load_documents(str(folder), "train", streaming=streaming, val_every=0,
                                       cache_dir=tmp_path / "cache")
            assert [d["text"] for d in documents] == texts
    from components.data.document_reader import KINDS  # what the note says is read

    # once, though each split and each load reads the folder
    assert caplog.messages == [f"data: {folder}: leaving out 2 file(s) of other kinds than "
                               f"{KINDS}: README.md, part-00002.jsonl.zst"]
    assert _prepared(tmp_path, folder, "shards", "--unit-mb", 0.0001) == [framed([t])
                                                                          for t in texts]
    note = (f"prepare_data: leaving out 2 file(s) of other kinds than {KINDS}: "
            f"{folder / 'README.md'}, {folder / 'part-00002.jsonl.zst'}\n")
    assert note in capsys.readouterr().err
    units = json.loads((tmp_path / "shards" / "prepare.json").read_text())["units"]
    compressed = [u for u in units if u["path"].endswith(codec)]
    assert len(compressed) == 1 and compressed[0]["kind"] == "jsonl"  # whole: no byte ranges
    assert len(units) > 2


def test_compressed_text_json_and_damaged_files(tmp_path, rng, capsys):
    """A .txt.gz file (paragraphs; a byte-order mark and a blank paragraph, which the trainer
    reads from a copy without them) and a .json.bz2 array read as their plain files are, a bad
    document of a .jsonl.xz file skipped, by the trainer and prepare_data alike; a compressed
    file that cannot be decompressed is one line naming it."""
    texts = random_texts(rng, 12)
    txt = _compressed(tmp_path / "txt" / "book.txt.gz",
                      ("\ufeff" + "\n\n".join(texts[:4]) + "\n\n  \n\n" + texts[4]).encode())
    array = _compressed(tmp_path / "json" / "docs.json.bz2",
                        json.dumps([{"text": t} for t in texts[5:8]]).encode())
    bad = _compressed(tmp_path / "xz" / "docs.jsonl.xz",
                      _jsonl_bytes(texts[8:10]) + b'{"text": ""}\n' + _jsonl_bytes(texts[10:]))
    for source, expected, extra in ((txt, texts[:5], []), (array, texts[5:8], []),
                                    (bad, texts[8:], ["--on-bad-document", "skip"])):
        skip = {"on_bad_document": "skip"} if extra else {}
        for folder_or_file in (source.parent, source):
            documents = load_documents(str(folder_or_file), "train", val_every=0,
                                       cache_dir=tmp_path / "cache", **skip)
            assert [d["text"] for d in documents] == expected
        assert _prepared(tmp_path, source, f"shards-{source.name}", *extra) == [
            framed([t]) for t in expected]
    capsys.readouterr()

    damaged = tmp_path / "damaged" / "docs.jsonl.gz"
    damaged.parent.mkdir()
    damaged.write_bytes(gzip.compress(_jsonl_bytes(texts))[:-30])  # cut short
    with pytest.raises(ValueError) as error:
        load_documents(str(damaged), "train", val_every=0, cache_dir=tmp_path / "cache")
    assert str(error.value).startswith(f"{damaged}: cannot be read as a gz file (")
    assert str(error.value).endswith("): fix or remove it") and "\n" not in str(error.value)
    assert prepare_data.main([str(a) for a in ("--source", damaged, "--tokenizer", "byte", "--out",
                                               tmp_path / "out", "--workers", 1,
                                               "--no-progress")]) == 1
    assert capsys.readouterr().err == f"prepare_data.py: error: {error.value}\n"


def test_an_unsupported_compressed_file_is_named_by_its_whole_type(tmp_path, capsys):
    """data.csv.gz was refused as "unsupported file type '.gz'" while the same message listed
    .gz among the types read."""
    from scripts import prepare_data
    path = tmp_path / "data.csv.gz"
    path.write_bytes(gzip.compress(b"text\nhello\n"))
    with pytest.raises(ValueError, match=r"data\.csv\.gz: unsupported file type '\.csv\.gz'"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache")
    assert prepare_data.main(["--source", str(path), "--tokenizer", "byte", "--out",
                              str(tmp_path / "out")]) != 0
    assert "unsupported file type '.csv.gz'" in capsys.readouterr().err


def test_a_file_beside_its_compressed_copy_is_refused(tmp_path, capsys):
    """x.jsonl beside x.jsonl.gz (an archive kept next to what was extracted from it): since
    compressed files are read, both were, every document twice, without a word."""
    from scripts import prepare_data
    source = tmp_path / "src"
    source.mkdir()
    lines = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)).encode()
    (source / "x.jsonl").write_bytes(lines)
    (source / "x.jsonl.gz").write_bytes(gzip.compress(lines))
    message = (f"{source / 'x.jsonl'} and {source / 'x.jsonl.gz'} are both sources: the same "
               "documents read twice if one is the other's copy; remove or move one")
    with pytest.raises(ValueError) as refused:
        load_documents(str(source), "train", cache_dir=tmp_path / "cache")
    assert str(refused.value) == message
    assert prepare_data.main(["--source", str(source), "--tokenizer", "byte", "--out",
                              str(tmp_path / "out")]) != 0
    assert message in capsys.readouterr().err
    (source / "x.jsonl.gz").rename(source / "y.jsonl.gz")  # two files: both read
    assert len(load_documents(str(source), "train", cache_dir=tmp_path / "cache",
                              val_every=0)) == 40
