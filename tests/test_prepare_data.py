"""scripts/prepare_data.py: every document once, framed as the text loader frames it, split by its
hash; parallel and resumable after a kill with the same result; other tokenizers and settings
refused; bad documents named or skipped; Hugging Face datasets read whole or streamed."""

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.config.schema import Data, Training
from components.data.document_reader import KINDS
from components.data.sources import load_documents
from components.data.shard_batches import build_shard_batches
from components.data.shards import ShardFormatError, read_index
from components.tokenizer import ByteTokenizer
from shard_cases import framed, held_out, random_texts, shard_documents, train_tokenizer, write_jsonl

from scripts import prepare_data

ROOT = Path(__file__).resolve().parents[1]

SMALL_UNITS = ["--unit-mb", "0.001", "--no-progress"]  # ~1 KB of input per unit: many units


def prepare(*args) -> int:
    return prepare_data.main([str(a) for a in args])


def mixed_corpus(root: Path, rng) -> list[str]:
    """Files of every kind; returns the documents in the order prepare_data.py reads them."""
    texts = random_texts(rng, 81)
    jsonl, array, paragraphs, rows = texts[:40], texts[40:45], texts[45:51], texts[51:]
    write_jsonl(root / "a" / "one.jsonl", jsonl)
    (root / "a" / "two.json").write_text(json.dumps([{"text": t, "id": i} for i, t in enumerate(array)]))
    # Paragraphs: lines of a document wrap once, a blank line ends it.
    (root / "a" / "three.txt").write_text("\n\n".join(t.replace(" ", "\n", 1) for t in paragraphs))
    (root / "b").mkdir()
    pq.write_table(pa.table({"text": rows, "n": list(range(len(rows)))}), root / "b" / "four.parquet",
                   row_group_size=7)
    paragraphs = [t.replace(" ", "\n", 1) for t in paragraphs]
    return jsonl + paragraphs + array + rows  # a/one.jsonl, a/three.txt, a/two.json, b/four.parquet


def test_shards_hold_every_document_once_in_order_split_by_hash(tmp_path, rng):
    expected = mixed_corpus(tmp_path, rng)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", rng)
    out = tmp_path / "shards"
    assert prepare("--source", tmp_path / "a", tmp_path / "b" / "*.parquet", "--tokenizer",
                   tmp_path / "tokenizer.json", "--out", out, "--workers", 2, "--val-every", 3,
                   *SMALL_UNITS) == 0
    index = read_index(out)
    assert index["dtype"] == "uint16" and index["tokenizer"]["fingerprint"] == tokenizer.fingerprint()
    validation = [t for t in expected if held_out(t, 3)]
    assert 0 < len(validation) < len(expected)
    for split, texts in (("train", [t for t in expected if not held_out(t, 3)]), ("validation", validation)):
        documents = shard_documents(out, split)
        assert documents == [framed(tokenizer, t) for t in texts], split
        assert index["splits"][split]["documents"] == len(texts)
        assert index["splits"][split]["tokens"] == sum(map(len, documents))
    assert len(index["splits"]["train"]["shards"]) > 8, "small units make many shards"
    assert index["max_token_id"] == max(max(d) for d in shard_documents(out, "train")
                                        + shard_documents(out, "validation"))
    # The documents are the ones the trainer's text loader reads from the same files.
    loaded = [d["text"] for f in ("one.jsonl", "three.txt", "two.json") for split in ("validation", "train")
              for d in load_documents(str(tmp_path / "a" / f), split, val_every=10**9,  # 0 | 1, 2, ...
                                      cache_dir=tmp_path / "cache")]
    assert loaded == expected[:51]


def test_a_killed_run_resumes_to_the_same_shards(tmp_path, rng):
    texts = random_texts(rng, 120)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", texts[:70])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", texts[70:])
    train_tokenizer(tmp_path / "tokenizer.json", rng)
    args = ["--source", tmp_path / "corpus", "--tokenizer", tmp_path / "tokenizer.json", "--val-every", 4,
            *SMALL_UNITS]
    assert prepare(*args, "--out", tmp_path / "straight", "--workers", 2) == 0
    units = sorted(p.stem for p in (tmp_path / "straight" / "units").glob("*.json"))
    assert len(units) >= 6

    # One worker takes the units in order: the kill comes when the last of a.jsonl is half written.
    out = tmp_path / "killed"
    last_of_a = [u for u in units if u.startswith("00000-")][-1]
    killed = subprocess.run([sys.executable, "-m", "scripts.prepare_data",
                             *map(str, args), "--out", str(out), "--workers", "1"],
                            cwd=ROOT, env={**os.environ, "FLCE_TEST_PREPARE_KILL": last_of_a},
                            start_new_session=True, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = sorted(p.stem for p in (out / "units").glob("*.json"))
    assert done == [u for u in units if u < last_of_a]
    assert list((out / "train").glob(f"{last_of_a}*.tmp")), "the unit was half written"
    with pytest.raises(ShardFormatError, match="unfinished token shards"):
        read_index(out)

    assert prepare(*args, "--out", out, "--workers", 2) == 0
    files = lambda folder: sorted(p.relative_to(folder) for p in folder.rglob("*.npy"))  # noqa: E731
    assert files(out) == files(tmp_path / "straight")
    for name in files(out):
        assert (out / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name
    assert not list(out.rglob("*.tmp"))
    index = read_index(out)
    assert index["splits"] == read_index(tmp_path / "straight")["splits"]

    # Finished: the same command again changes nothing.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != "prepare.lock"}
    assert prepare(*args, "--out", out, "--workers", 2) == 0
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != "prepare.lock"}


def test_another_tokenizer_or_other_settings_are_refused(tmp_path, rng, capsys):
    write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 30))
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", rng)
    other = train_tokenizer(tmp_path / "other.json", rng, vocab_size=350)
    args = ["--source", tmp_path / "a.jsonl", "--out", tmp_path / "shards", "--workers", 1, *SMALL_UNITS]
    assert prepare(*args, "--tokenizer", tmp_path / "tokenizer.json") == 0
    capsys.readouterr()
    assert prepare(*args, "--tokenizer", tmp_path / "other.json") == 1
    assert "was begun with other settings (tokenizer: " in capsys.readouterr().err
    # the same tokenizer from another path (a copy, its folder) is the same setting, as the
    # trainer, comparing fingerprints, takes it: it was refused as "other settings"
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    assert prepare(*args, "--tokenizer", tmp_path / "copy") == 0
    assert "complete already" in capsys.readouterr().out
    assert prepare(*args, "--tokenizer", "byte") == 1
    assert prepare(*args, "--tokenizer", tmp_path / "tokenizer.json", "--val-every", 7) == 1
    assert "val_every: 100 -> 7" in capsys.readouterr().err
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "changed"}) + "\n")
    assert prepare(*args, "--tokenizer", tmp_path / "tokenizer.json") == 1
    assert "a.jsonl changed after some of its units were tokenized" in capsys.readouterr().err

    # The trainer refuses them with another tokenizer too.
    for wrong in (other, ByteTokenizer()):
        with pytest.raises(ShardFormatError, match="its shards were made with another tokenizer"):
            build_shard_batches(Data(source=str(tmp_path / "shards")),
                                Training(seq_len=8, local_batch_size=2, seed=0), split="train",
                                tokenizer=wrong)
    batches = build_shard_batches(Data(source=str(tmp_path / "shards")),
                                  Training(seq_len=8, local_batch_size=2, seed=0), split="train",
                                  tokenizer=tokenizer)
    assert next(batches)[0].shape == (2, 8)
    with pytest.raises(ShardFormatError, match=r"holds token id \d+, out of range for the model's vocab size 300"):
        build_shard_batches(Data(source=str(tmp_path / "shards")),
                            Training(seq_len=8, local_batch_size=2, seed=0), split="train",
                            tokenizer=tokenizer, max_token_id=300)


def test_bad_documents_are_named_or_skipped(tmp_path, rng, capsys):
    texts = random_texts(rng, 40)
    lines = [json.dumps({"text": t}).encode() for t in texts]
    lines[30] = b'{"text": "caf\xe9"}'  # Latin-1: not UTF-8, far into the file (a later unit)
    lines[31] = b'{"body": "elsewhere"}'
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    offset = len(b"\n".join(lines[:30])) + 1
    train_tokenizer(tmp_path / "tokenizer.json", rng)
    args = ["--source", tmp_path / "a.jsonl", "--tokenizer", tmp_path / "tokenizer.json", "--workers", 2,
            "--val-every", 0, *SMALL_UNITS]
    assert prepare(*args, "--out", tmp_path / "stop") == 1
    err = capsys.readouterr().err
    assert f"a.jsonl: the line at byte {offset}: not UTF-8 (byte 0xe9 at column 14)" in err
    assert "--on-bad-document skip" in err

    assert prepare(*args, "--out", tmp_path / "skip", "--on-bad-document", "skip") == 0
    assert "skipped 2 bad document(s)" in capsys.readouterr().out
    index = read_index(tmp_path / "skip")
    assert index["skipped_documents"] == 2
    assert any("no field 'text' (its fields: body)" in n for n in index["skipped_named"])
    good = [t for i, t in enumerate(texts) if i not in (30, 31)]
    assert len(shard_documents(tmp_path / "skip", "train")) == len(good)
    assert not index["splits"]["validation"]["shards"]


def test_a_file_whose_documents_all_keep_their_text_under_another_field_names_text_field(
        tmp_path, rng, capsys):
    """The corpus keeps its text under "content": the trainer says `set [data] text_field`, and
    prepare_data said so for parquet (`set --text-field`), but for .jsonl it told the user to
    pass --on-bad-document skip, which then failed with "no training documents (5 bad ones were
    skipped)" (or, beside a good file, left the file out); neither named --text-field. A file
    none of whose documents has the field is now the error the trainer gives, under skip too."""
    texts = random_texts(rng, 40)
    write_jsonl(tmp_path / "a" / "content.jsonl", texts, field="content")
    args = ["--source", tmp_path / "a" / "content.jsonl", "--tokenizer", "byte", "--workers", 2,
            "--val-every", 0, *SMALL_UNITS]  # many units of the one file
    assert prepare(*args, "--out", tmp_path / "stop") == 1
    assert capsys.readouterr().err == (
        f"prepare_data.py: error: {tmp_path / 'a' / 'content.jsonl'}: line 1: no field 'text' (its "
        "fields: content). Set --text-field if the documents keep their text under another field, "
        "or pass --on-bad-document skip to skip such documents (each is then counted, the first "
        "named)\n")
    missing = (f"prepare_data.py: error: {tmp_path / 'a' / 'content.jsonl'}: the documents have no "
               "field 'text' (their fields: content); set --text-field\n")
    assert prepare(*args, "--out", tmp_path / "skip", "--on-bad-document", "skip") == 1
    assert capsys.readouterr().err == missing
    write_jsonl(tmp_path / "a" / "text.jsonl", texts)  # beside a good file: not left out unsaid
    both = ["--source", tmp_path / "a", *args[2:], "--on-bad-document", "skip"]
    assert prepare(*both, "--out", tmp_path / "both") == 1
    assert capsys.readouterr().err == missing
    with pytest.raises(ValueError, match=r"content\.jsonl: the documents have no field 'text' "
                                         r"\(their fields: content\); set \[data\] text_field"):
        load_documents(str(tmp_path / "a"), "train", cache_dir=tmp_path / "cache",
                       on_bad_document="skip")
    assert prepare(*args, "--out", tmp_path / "content", "--text-field", "content") == 0
    assert shard_documents(tmp_path / "content", "train") == [framed(ByteTokenizer(), t)
                                                              for t in texts]


def test_the_first_bad_document_in_the_files_order_is_named():
    """Workers tokenize units in parallel: a later unit's bad document can be found first. The
    error names the earliest one (the same on every run), as one worker would have."""
    import threading
    from concurrent.futures import Future
    from components.data.checks import BadDocumentError
    from scripts.lib.prepare_shards import wait_in_order
    units = [Future() for _ in range(4)]
    for unit in units[:3]:
        unit.set_running_or_notify_cancel()
    units[2].set_exception(BadDocumentError("c.jsonl: line 9: not UTF-8"))  # found first
    threading.Timer(0.5, lambda: units[1].set_exception(
        BadDocumentError("b.jsonl: line 3: no field 'text'"))).start()
    threading.Timer(0.3, lambda: units[0].set_result({})).start()
    with pytest.raises(BadDocumentError, match="b.jsonl: line 3"):
        wait_in_order(units)
    assert units[3].cancelled()  # after the first bad one, not yet started: not run


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_tokenizer_workers_are_forked_with_the_inherited_objects_frozen(tmp_path, monkeypatch):
    """prepare_data's workers and the trainer's TokenizerPool fork while gc is frozen (see
    test_data_workers.py::test_forked_workers_do_not_finalize_what_they_inherit for why)."""
    import gc
    from components.data.document_tokens import TokenizerPool
    freezes = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real_freeze()))
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    args = ["--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--workers", 2,
            "--val-every", 0, "--no-progress"]
    assert prepare(*args, "--out", tmp_path / "out") == 0
    pool = TokenizerPool(ByteTokenizer(), 2)
    assert len(freezes) == 2 and len(multiprocessing.active_children()) >= 2
    del pool


def test_an_escaped_lone_surrogate_is_named_or_skipped(tmp_path, capsys):
    """It is valid JSON, so it reached the tokenizer: a bare 'surrogates not allowed' (byte) or
    TypeError traceback (tokenizers), naming no file or line."""
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": "cut \\ud83d emoji"}\n{"text": "b"}\n')
    args = ["--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--workers", 1, "--val-every", 0,
            "--no-progress"]
    assert prepare(*args, "--out", tmp_path / "stop") == 1
    err = capsys.readouterr().err
    assert "a.jsonl: line 2: field 'text' holds a lone surrogate (\\ud83d at character 4)" in err
    assert prepare(*args, "--out", tmp_path / "skip", "--on-bad-document", "skip") == 0
    byte = ByteTokenizer()
    assert shard_documents(tmp_path / "skip", "train") == [framed(byte, "a"), framed(byte, "b")]


@pytest.mark.parametrize("streaming", [False, True])
def test_hugging_face_dataset_gives_the_shards_of_its_files(tmp_path, rng, monkeypatch, streaming):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    texts = random_texts(rng, 50)
    folder = tmp_path / "hub-like"
    folder.mkdir()
    for i, part in enumerate((texts[:20], texts[20:])):  # two files: two shards of a stream
        pq.write_table(pa.table({"text": part}), folder / f"train-{i:05d}.parquet", row_group_size=8)
    train_tokenizer(tmp_path / "tokenizer.json", rng)
    common = ["--tokenizer", tmp_path / "tokenizer.json", "--workers", 2, "--val-every", 5, *SMALL_UNITS]
    assert prepare("--hf-dataset", folder, *(["--hf-streaming"] if streaming else []), "--out",
                   tmp_path / "hf", *common) == 0
    assert prepare("--source", folder, "--out", tmp_path / "files", *common) == 0
    for split in ("train", "validation"):
        assert shard_documents(tmp_path / "hf", split) == shard_documents(tmp_path / "files", split)
    assert len(read_index(tmp_path / "hf")["splits"]["train"]["shards"]) > (1 if streaming else 2)


def test_byte_tokenizer_and_the_stored_arrays_load_with_plain_numpy(tmp_path, rng):
    texts = random_texts(rng, 10)
    write_jsonl(tmp_path / "a.jsonl", texts)
    assert prepare("--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--out", tmp_path / "s",
                   "--workers", 1, "--val-every", 0, "--no-progress") == 0
    tokens = np.load(tmp_path / "s" / "train" / "00000-00000.tokens.npy")
    offsets = np.load(tmp_path / "s" / "train" / "00000-00000.docs.npy")
    assert tokens.dtype == np.uint16 and offsets.dtype == np.int64 and offsets[0] == 0
    byte = ByteTokenizer()
    assert [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [framed(byte, t) for t in texts]


def test_sources_that_are_not_there_are_named(tmp_path, capsys):
    for source, message in ((tmp_path / "missing.jsonl", "missing.jsonl: no such file or folder"),
                            (tmp_path / "*.jsonl", "*.jsonl: no such file or folder"),
                            (tmp_path, f"no {KINDS} files there")):
        assert prepare("--source", source, "--tokenizer", "byte", "--out", tmp_path / "out",
                       "--no-progress") == 1
        assert message in capsys.readouterr().err


def test_an_out_folder_inside_a_source_folder_is_not_read_as_a_source(tmp_path, rng, capsys):
    """--out inside a --source folder: its own prepare.json, units/*.json and index.json are not
    sources on the next run (the re-run refused 'source files: 1 -> 10' before)."""
    write_jsonl(tmp_path / "corpus" / "a.jsonl", random_texts(rng, 40))
    args = ["--source", tmp_path / "corpus", "--tokenizer", "byte", "--out", tmp_path / "corpus" / "shards",
            "--workers", 1, *SMALL_UNITS]
    assert prepare(*args) == 0
    assert prepare(*args) == 0, capsys.readouterr().err
    assert "complete already, nothing to do" in capsys.readouterr().out
    assert list(read_index(tmp_path / "corpus" / "shards")["source"]["files"]) == [
        str((tmp_path / "corpus" / "a.jsonl").resolve())]


def test_the_progress_bar_counts_bytes_in_binary_units(tmp_path, rng, capsys):
    """The bar's unit_scale/unit_divisor once sat inside a comment: it counted raw bytes."""
    write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 80))
    assert prepare_data.main(["--source", str(tmp_path / "a.jsonl"), "--tokenizer", "byte",
                              "--out", str(tmp_path / "shards"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"tokenizing: 100%\|\S+\| \d+(\.\d+)?[kM]/\d+(\.\d+)?[kM] ", err), err


def test_spawned_workers_make_the_same_shards(tmp_path, rng, monkeypatch):
    """macOS (and Windows) start worker processes by spawning, not forking: the workers then get
    the job (output folder, settings, tokenizer) through the pool's initializer, not a global set
    before a fork (a KeyError in every worker before)."""
    import scripts.lib.prepare_shards.run as shard_prepare  # where _run looks worker_context up
    write_jsonl(tmp_path / "corpus" / "a.jsonl", random_texts(rng, 60))
    args = ["--source", tmp_path / "corpus", "--tokenizer", "byte", "--workers", 2, *SMALL_UNITS]
    assert prepare(*args, "--out", tmp_path / "forked") == 0
    spawns = []
    monkeypatch.setattr(shard_prepare, "worker_context",
                        lambda: spawns.append(1) or multiprocessing.get_context("spawn"))
    assert prepare(*args, "--out", tmp_path / "spawned") == 0
    assert spawns, "the run did not take its worker context from the patched lookup"
    files = sorted(p.relative_to(tmp_path / "forked") for p in (tmp_path / "forked").rglob("*.npy"))
    assert files and files == sorted(p.relative_to(tmp_path / "spawned")
                                     for p in (tmp_path / "spawned").rglob("*.npy"))
    for name in files:
        assert (tmp_path / "forked" / name).read_bytes() == (tmp_path / "spawned" / name).read_bytes()


def _alive_children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_kill_9_of_the_main_process_ends_its_workers_and_frees_the_folder(tmp_path, rng, capsys):
    """The workers of a run whose main process is killed with kill -9 die with it (they lived on
    under PID 1, holding prepare.lock: the same command failed for ever, naming no one). While
    the run lives a second one is refused naming its pid; once it is dead the same command takes
    the lock over, saying from whom, and finishes."""
    write_jsonl(tmp_path / "corpus" / "a.jsonl", random_texts(rng, 60))
    out = tmp_path / "shards"
    args = ["--source", tmp_path / "corpus", "--tokenizer", "byte", "--out", out, "--workers", 2,
            *SMALL_UNITS]
    run = subprocess.Popen([sys.executable, "-m", "scripts.prepare_data", *map(str, args)], cwd=ROOT,
                           env={**os.environ, "FLCE_TEST_PREPARE_STALL": "00000-00002"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.time() + 60
        while not list((out / "train").glob("00000-00002*.tmp")) and time.time() < deadline:
            time.sleep(0.05)
        workers = _alive_children(run.pid)
        assert len(workers) == 2, workers
        assert prepare(*args) == 1
        err = capsys.readouterr().err
        assert f"{out} is being written by another prepare_data.py run (pid {run.pid} on " in err
        run.kill()
        run.wait(timeout=30)
        deadline = time.time() + 10
        while any(map(_alive, workers)) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), "a worker outlived its killed main process"
    finally:
        for pid in [run.pid, *workers]:  # what the test started, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with pytest.warns(UserWarning, match=rf"taking over {out}/prepare.lock from pid {run.pid} on "):
        assert prepare(*args) == 0
    assert read_index(out)["splits"]["train"]["documents"] > 0


def test_a_damaged_index_is_named_and_written_again(tmp_path, rng, capsys):
    write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 30))
    args = ["--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--out", tmp_path / "shards",
            "--workers", 1, *SMALL_UNITS]
    assert prepare(*args) == 0
    index = tmp_path / "shards" / "index.json"
    whole = json.loads(index.read_text())
    index.write_text(index.read_text()[:50])
    with pytest.raises(ShardFormatError, match=rf"{index}: damaged, not a token shard index"):
        read_index(tmp_path / "shards")
    assert prepare(*args) == 0
    assert f"{index} is damaged: writing it again" in capsys.readouterr().out
    assert {k: v for k, v in read_index(tmp_path / "shards").items() if k != "created"} == \
        {k: v for k, v in whole.items() if k != "created"}


def test_a_folder_begun_under_older_document_rules_is_finished_only_if_done(tmp_path, rng, capsys):
    """prepare.json of a folder begun before empty texts and whitespace-only paragraphs stopped
    being documents has no "documents" key: unfinished, it is refused (its remaining units would
    count documents another way); finished, it is left as it is."""
    write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 60))
    args = ["--source", tmp_path / "a.jsonl", "--out", tmp_path / "shards", "--tokenizer", "byte",
            "--workers", 1, *SMALL_UNITS]
    assert prepare(*args) == 0
    plan_path = tmp_path / "shards" / "prepare.json"
    plan = json.loads(plan_path.read_text())
    del plan["documents"]
    plan_path.write_text(json.dumps(plan))
    capsys.readouterr()
    assert prepare(*args) == 0  # finished: nothing to redo, nothing refused
    assert "complete already" in capsys.readouterr().out

    units = sorted((tmp_path / "shards" / "units").glob("*.json"))
    assert len(units) >= 3
    units[-1].unlink()  # as if killed before its last unit
    plan_path.write_text(json.dumps(plan))
    assert prepare(*args) == 1
    error = capsys.readouterr().err
    assert "was begun by an older prepare_data, which counted other texts as documents" in error
    assert "(document rules 1, now 2" in error


def test_val_every_1_is_refused_before_reading(tmp_path, capsys):
    """It held out every document, then failed with "no training documents", and the run it
    began refused the corrected command as begun with other settings."""
    write_jsonl(tmp_path / "a.jsonl", ["some text"])
    with pytest.raises(SystemExit) as refused:
        prepare("--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--out", tmp_path / "out",
                "--val-every", 1)
    assert refused.value.code == 2
    assert "--val-every 1 would hold out every document" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_out_folder_of_the_users_is_refused(tmp_path, capsys):
    """Its files mixed with the shards, and a later run with other settings was refused with
    "delete it: it holds only this preparation's work", which would have deleted them."""
    write_jsonl(tmp_path / "a.jsonl", ["some text", "more text", "and more"])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert prepare("--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--out",
                   tmp_path / "mine", "--val-every", 0, "--no-progress") == 1
    assert (f"{tmp_path / 'mine'} holds notes.txt and no prepare.json: not a folder prepare_data "
            "began; write to a new or empty --out") in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    # an empty folder is the user's choice of place, and is written
    (tmp_path / "empty").mkdir()
    assert prepare("--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--out",
                   tmp_path / "empty", "--val-every", 0, "--no-progress") == 0


def test_a_source_folder_laid_out_in_splits_keeps_them_apart(tmp_path, capsys):
    """Its validation and test documents went into the one corpus prepare_data holds a split out
    of by hash: trained on, silently. Now the validation shards are the folder's validation split,
    the train shards its train split whole, and the test split is left out, said so."""
    texts = {split: [f"{split} text number {i}" for i in range(n)]
             for split, n in (("train", 9), ("validation", 4), ("test", 3))}
    for split, docs in texts.items():
        write_jsonl(tmp_path / "corpus" / split / "part.jsonl", docs)
    assert prepare("--source", tmp_path / "corpus", "--tokenizer", "byte", "--out",
                   tmp_path / "out", "--no-progress", "--workers", 1) == 0
    assert "leaving out 1 file(s) of a split other than train and validation" in \
        capsys.readouterr().err
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    framed_tokens = lambda docs: sum(len(t.encode()) + 2 for t in docs)  # noqa: E731
    assert index["splits"]["train"]["tokens"] == framed_tokens(texts["train"])
    assert index["splits"]["validation"]["tokens"] == framed_tokens(texts["validation"])
    # a file in none of the layout's splits is named
    write_jsonl(tmp_path / "corpus" / "stray.jsonl", ["stray"])
    assert prepare("--source", tmp_path / "corpus", "--tokenizer", "byte", "--out",
                   tmp_path / "out2", "--no-progress") == 1
    assert "stray.jsonl is in none of them" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["saved", "files", "files streamed"])
def test_a_hugging_face_dataset_with_a_validation_split_keeps_it(tmp_path, monkeypatch, capsys,
                                                                  kind):
    """Its validation split was left out and 1/100 of train hashed out instead, where --source
    on the same folder (and the trainer) take the dataset's own."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    texts = {"train": [f"train text number {i}" for i in range(300)],
             "validation": [f"validation text number {i}" for i in range(40)]}
    folder = tmp_path / "dataset"
    if kind == "saved":
        datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": docs})
                              for split, docs in texts.items()}).save_to_disk(str(folder))
        # read with load_from_disk: load_dataset took it for a folder of json files (its
        # dataset_dict.json ...), which datasets 4 could not parse and 5 reads by a guess
        monkeypatch.setattr(datasets, "load_dataset", None)
    else:
        for split, docs in texts.items():
            write_jsonl(folder / f"{split}.jsonl", docs)
    args = ["--tokenizer", "byte", "--workers", 1, "--no-progress"]
    assert prepare("--hf-dataset", folder, *(["--hf-streaming"] if "streamed" in kind else []),
                   "--out", tmp_path / "hf", *args) == 0
    assert f"the validation shards are {folder}'s own validation split" in capsys.readouterr().err
    byte = ByteTokenizer()
    for split, docs in texts.items():
        assert shard_documents(tmp_path / "hf", split) == [framed(byte, t) for t in docs], split
    if kind != "saved":
        assert prepare("--source", folder, "--out", tmp_path / "files", *args) == 0
        for split in texts:
            assert shard_documents(tmp_path / "files", split) == \
                shard_documents(tmp_path / "hf", split)
    # without one, the split is held out by hash, and said so
    assert prepare("--hf-dataset", folder, "--hf-split", "validation", "--out", tmp_path / "v",
                   "--val-every", 4, *args) == 0
    assert f"the validation shards are 1 in 4 documents of {folder}'s validation split, by a " \
        "hash" in capsys.readouterr().err
    held = [t for t in texts["validation"] if held_out(t, 4)]
    assert shard_documents(tmp_path / "v", "validation") == [framed(byte, t) for t in held]


def test_out_and_hf_dataset_expand_a_home_folder(tmp_path, monkeypatch, capsys):
    """--out "~/x" (quoted, so no shell expands it) wrote into a folder named "~" in the current
    folder; --source, --tokenizer and the trainer expand it."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    write_jsonl(home / "corpus" / "train.jsonl", ["one text", "two texts", "three texts"])
    args = ["--tokenizer", "byte", "--workers", 1, "--no-progress", "--val-every", 0]
    assert prepare("--source", "~/corpus", "--out", "~/shards", *args) == 0
    assert prepare("--hf-dataset", "~/corpus", "--out", "~/hf", *args) == 0, capsys.readouterr().err
    assert not (tmp_path / "~").exists()
    assert shard_documents(home / "hf", "train") == shard_documents(home / "shards", "train")
    assert read_index(home / "shards")["splits"]["train"]["documents"] == 3


def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    """A non-empty folder was refused in one line, a file was mkdir's FileExistsError traceback."""
    write_jsonl(tmp_path / "a.jsonl", ["some text"])
    (tmp_path / "taken").write_text("mine")
    for out, message in ((tmp_path / "taken", f"{tmp_path / 'taken'} is a file, not a folder: "
                          "--out names the folder to write the shards into"),
                         (tmp_path / "taken" / "below", f"--out {tmp_path / 'taken' / 'below'}: "
                          "cannot make the folder (Not a directory)")):
        assert prepare("--source", tmp_path / "a.jsonl", "--tokenizer", "byte", "--out", out,
                       "--no-progress") == 1
        error = capsys.readouterr().err
        assert error.startswith(f"prepare_data.py: error: {message}") and error.count("\n") == 1
    assert (tmp_path / "taken").read_text() == "mine"


def test_tokenizer_errors_name_prepare_datas_own_options(tmp_path, rng, capsys):
    """They named the trainer's --tokenizer.bos_token and [tokenizer] bos_token; and --bos-token
    with the byte tokenizer was ignored unsaid."""
    write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 10))
    train_tokenizer(tmp_path / "tokenizer.json", rng)
    common = ["--source", tmp_path / "a.jsonl", "--out", tmp_path / "out", "--no-progress"]
    assert prepare(*common, "--tokenizer", tmp_path / "tokenizer.json", "--bos-token",
                   "<nonexistent>") == 1
    error = capsys.readouterr().err
    assert error.startswith("prepare_data.py: error: --bos-token '<nonexistent>': ")
    assert "has no such token" in error and "[tokenizer]" not in error
    assert prepare(*common, "--tokenizer", "byte", "--eos-token", "</s>") == 1
    assert capsys.readouterr().err.startswith(
        "prepare_data.py: error: --eos-token '</s>' is set, but --tokenizer 'byte' has no tokens "
        "to name (its bos and eos are ids 256 and 257): leave --eos-token out")
    assert not (tmp_path / "out").exists()


def test_an_empty_file_among_others_is_noted(tmp_path, capsys):
    """The trainer warns of a file that holds no documents among others; prepare_data said
    nothing (a file emptied by a failed export went unnoticed)."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.jsonl").write_text('{"text": "hello world"}\n')
    (source / "b.jsonl").write_text("")
    (source / "c.jsonl").write_text("\n\n")
    assert prepare("--source", source, "--tokenizer", "byte", "--out", tmp_path / "out",
                   "--workers", "1") == 0
    out = capsys.readouterr().out
    assert f"note: {source / 'b.jsonl'} holds no documents (the file is empty)\n" in out
    assert f"note: {source / 'c.jsonl'} holds no documents\n" in out
    assert "a.jsonl holds" not in out
