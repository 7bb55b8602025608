"""Validation in bits per byte, and scripts/evaluate.py.

A short run on a corpus written here, with a byte-level BPE tokenizer trained here (so a token
is several bytes, and bits per byte differ from bits per token), label smoothing and z-loss
(training-only regularisers that validation leaves out): its val_bpb is its val_loss over the
UTF-8 bytes of the validation targets, its val_loss the plain cross-entropy recomputed here, and
evaluate.py reproduces both from the checkpoint and from its exported Hugging Face folder.
"""

import importlib
import json
import math
import os
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import forked_ranks  # the ranks of a launch forked: tests/forked_ranks.py
import train
from components.config.schema import Data, Training
from components.data.build import build_data
from components.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, BATCH, VAL_STEPS, STEPS = 64, 2, 3, 4
WORDS = ["def", "return", "class", "import", "naïve", "café", "日本語", "数据", "🙂", "Ωπ", "x",
         "(", ")", ":", "\n", "    ", "=", "+", "1", "2"]


def load_script(name: str):
    return importlib.import_module(f"scripts.{name}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpb")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120))) for _ in range(48)]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(root / "tokenizer.json"))
    dump = root / "run"
    data = ["--data.source", str(corpus), "--data.val_every", "4", "--data.cache_dir",
            str(root / "cache"), "--tokenizer.name", "hf", "--tokenizer.path",
            str(root / "tokenizer.json")]
    assert train.main(["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
                       "--loss.impl", "unfused", "--loss.label_smoothing", "0.1",
                       "--loss.z_loss", "1e-3", "--training.seq_len", str(SEQ_LEN),
                       "--training.local_batch_size", str(BATCH), "--training.steps", str(STEPS),
                       "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-2",
                       "--validation.enable", "true", "--validation.freq", str(STEPS),
                       "--validation.steps", str(VAL_STEPS), "--checkpoint.enable_checkpoint",
                       "true", "--checkpoint.interval", str(STEPS), "--job.print_config", "false",
                       "--job.dump_folder", str(dump), *data]) == 0
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val_loss" in r]
    assert len(val) == 1 and val[0]["step"] == STEPS
    return {"dump": dump, "corpus": corpus, "tokenizer": HFTokenizer(root / "tokenizer.json"),
            "val": val[0], "cache": root / "cache"}


def validation_batches(run):
    data = Data(source=str(run["corpus"]), val_every=4, cache_dir=str(run["cache"]))
    batches = build_data(data, Training(seq_len=SEQ_LEN, local_batch_size=BATCH),
                         split="validation", tokenizer=run["tokenizer"], max_token_id=512)
    return [next(batches) for _ in range(VAL_STEPS)]


def test_val_loss_is_the_plain_cross_entropy_and_val_bpb_its_bits_per_byte(run):
    checkpoints = load_script("generate").checkpoints
    model = checkpoints.load_model(run["dump"] / "checkpoint", torch.device("cpu")).model
    lengths = run["tokenizer"].byte_lengths()
    nats = smoothed = 0.0
    tokens = n_bytes = 0
    with torch.no_grad():
        for inputs, labels in validation_batches(run):
            logits = model.logits(model(inputs)).flatten(0, 1).double()
            nats += F.cross_entropy(logits, labels.flatten(), reduction="sum").item()
            smoothed += F.cross_entropy(logits, labels.flatten(), reduction="sum",
                                        label_smoothing=0.1).item()
            tokens += labels.numel()
            n_bytes += sum(lengths[i] for i in labels.flatten().tolist())
    assert n_bytes > 1.5 * tokens  # tokens of several bytes: bpb is not bits per token
    val = run["val"]
    assert val["val_loss"] == pytest.approx(nats / tokens, abs=1e-5)
    assert abs(val["val_loss"] - smoothed / tokens) > 0.05  # the smoothed loss would show
    assert val["val_bpb"] == pytest.approx(nats / (math.log(2) * n_bytes), abs=1e-5)


def test_evaluate_script_reproduces_the_runs_validation(run, tmp_path, capsys):
    evaluate = load_script("evaluate")
    out = tmp_path / "eval.json"
    # by default the run's source, split, seq_len, batch size and validation steps; on the run's
    # device (CPU, fp32): on a GPU machine the default (CUDA, bf16) rounds differently (5e-4)
    assert evaluate.main(["--checkpoint", str(run["dump"] / "checkpoint"), "--json",
                          str(out), "--device", "cpu"]) == 0
    line = capsys.readouterr().out
    assert "val_loss" in line and "val_bpb" in line
    record = json.loads(out.read_text())
    for key in ("val_loss", "val_bpb"):
        assert record[key] == pytest.approx(run["val"][key], abs=1e-6)
    assert (record["seq_len"], record["split"], record["tokens"]) == (SEQ_LEN, "validation",
                                                                      VAL_STEPS * BATCH * SEQ_LEN)

    # the exported folder, given the same source, gives the same numbers
    export_hf = load_script("export_hf")
    assert export_hf.main(["--checkpoint", str(run["dump"] / "checkpoint"), "--out",
                           str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert evaluate.main(["--checkpoint", str(tmp_path / "hf"), "--source", str(run["corpus"]),
                          "--seq-len", str(SEQ_LEN), "--steps", str(VAL_STEPS), "--batch-size",
                          str(BATCH), "--val-every", "4", "--cache-dir", str(run["cache"]),
                          "--json", str(out), "--device", "cpu"]) == 0
    from_hf = json.loads(out.read_text())
    for key in ("val_loss", "val_bpb"):
        assert from_hf[key] == pytest.approx(run["val"][key], abs=1e-5)
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(tmp_path / "hf")]) == 1
    assert "Hugging Face folder: pass --source" in capsys.readouterr().err


def _other_tokenizer(path, vocab_size: int) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["other words " * 20, "entirely different text"],
                                  trainers.BpeTrainer(vocab_size=vocab_size,
                                                      special_tokens=["<s>", "</s>"],
                                                      show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
    return path


def test_another_vocabulary_than_the_runs_is_refused(run, tmp_path, capsys):
    """generate/evaluate --tokenizer with another vocabulary gave garbage without a word: the
    checkpoint records its run's tokenizer, and another one is refused with the two sizes (or,
    of the same size, as other tokens); the run's own tokenizer file is accepted."""
    generate, evaluate = load_script("generate"), load_script("evaluate")
    checkpoint = str(run["dump"] / "checkpoint")
    smaller = _other_tokenizer(tmp_path / "smaller.json", 300)
    same_size = tmp_path / "same.json"  # the run's with two tokens' ids swapped
    spec = json.loads(run["tokenizer"].path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    same_size.write_text(json.dumps(spec))
    assert HFTokenizer(same_size).vocab_size == run["tokenizer"].vocab_size
    for script, extra in ((generate, ["--prompt", "def", "--max-new-tokens", "2"]), (evaluate, [])):
        assert script.main(["--checkpoint", checkpoint, "--tokenizer", str(smaller), *extra]) == 1
        err = capsys.readouterr().err
        assert (f"the tokenizer {smaller} has {HFTokenizer(smaller).vocab_size} ids, the run's "
                f"tokenizer had {run['tokenizer'].vocab_size}: the model's ids would mean other "
                "tokens") in err, err
    assert generate.main(["--checkpoint", checkpoint, "--tokenizer", str(same_size), "--prompt",
                          "def", "--max-new-tokens", "2"]) == 1
    assert "but other tokens or bos/eos ids" in capsys.readouterr().err
    assert generate.main(["--checkpoint", checkpoint, "--tokenizer", str(run["tokenizer"].path),
                          "--prompt", "def", "--max-new-tokens", "2"]) == 0


def test_a_source_with_another_text_field_is_scored_with_text_field(run, tmp_path, capsys):
    """The error said "set [data] text_field", an option evaluate does not have: a source whose
    text is in another field than the run's could not be scored at all."""
    corpus = tmp_path / "body.jsonl"
    corpus.write_text("".join(json.dumps({"body": json.loads(line)["text"]}, ensure_ascii=False)
                              + "\n" for line in run["corpus"].read_text().splitlines()))
    argv = ["--checkpoint", str(run["dump"] / "checkpoint"), "--source", str(corpus),
            "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]
    assert load_script("evaluate").main(argv) == 1
    err = capsys.readouterr().err
    assert "no field 'text'" in err and err.endswith("; pass --text-field\n"), err
    out = tmp_path / "eval.json"
    assert load_script("evaluate").main(argv + ["--text-field", "body", "--json", str(out)]) == 0
    record = json.loads(out.read_text())  # the run's documents, so the run's numbers
    for key in ("val_loss", "val_bpb"):
        assert record[key] == pytest.approx(run["val"][key], abs=1e-6)


def test_a_float8_run_is_said_to_be_scored_without_float8(run, tmp_path, capsys):
    """evaluate turns float8 off, so its numbers differ slightly from such a run's val_loss,
    which the docs said they were."""
    dump = tmp_path / "run"
    assert train.main(["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
                       "--loss.impl", "unfused", "--training.seq_len", str(SEQ_LEN),
                       "--training.local_batch_size", str(BATCH), "--training.steps", "1",
                       "--lr_scheduler.warmup_steps", "1", "--validation.enable", "false",
                       "--model.converters", "quantize.linear.float8",
                       "--quantize.linear.float8.emulate", "true", "--checkpoint.enable", "true",
                       "--job.print_config", "false", "--job.dump_folder", str(dump),
                       "--data.source", str(run["corpus"]), "--data.val_every", "4",
                       "--data.cache_dir", str(run["cache"]), "--tokenizer.name", "hf",
                       "--tokenizer.path", str(run["tokenizer"].path)]) == 0
    capsys.readouterr()
    assert load_script("evaluate").main(["--checkpoint", str(dump / "checkpoint"), "--steps", "1",
                                         "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert ("evaluate: note: the run trained with [model] converters = "
            "['quantize.linear.float8']: this scores the weights without float8 GEMMs, so the "
            "numbers differ slightly from the run's val_loss and val_bpb\n") in err


def test_a_garbled_train_state_is_named(run, tmp_path, capsys):
    """Garbled, train_state.json (which records the run's tokenizer) was read as absent."""
    step = tmp_path / f"step-{STEPS}"
    shutil.copytree(run["dump"] / "checkpoint" / f"step-{STEPS}", step)
    (step / "checksums.json").unlink()  # as saved before checksums; else the checksum names it
    (step / "train_state.json").write_text("[]")
    assert load_script("evaluate").main(["--checkpoint", str(step), "--device", "cpu"]) == 1
    assert capsys.readouterr().err == (f"evaluate: error: {step / 'train_state.json'} is damaged "
                                       "(TypeError: a JSON list, expected an object)\n")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_weights_with_a_nan_are_refused_not_scored(run, tmp_path, capsys):
    """A checkpoint whose weights hold a NaN (saved before checksums, so no checksum names the
    damage) was scored: "val_loss nan | val_bpb nan", exit status 0. It is refused when loaded,
    one line naming the tensor, as generate refuses it."""
    import torch.distributed.checkpoint as dcp
    evaluate = load_script("evaluate")
    source = run["dump"] / "checkpoint" / f"step-{STEPS}"
    state = evaluate.checkpoints.load_model_state(source)
    state["norm.weight"][0] = float("nan")
    step = tmp_path / f"step-{STEPS}"
    dcp.save({"model": state}, checkpoint_id=step, no_dist=True)
    shutil.copy(source / "config.toml", step / "config.toml")
    assert evaluate.main(["--checkpoint", str(step), "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == (f"evaluate: error: {step}: norm.weight holds non-finite values "
                                 "(NaN or inf): the model's outputs would be NaN; a run that "
                                 "diverged, or a damaged file\n")


@pytest.mark.parametrize("option, value, least", [("--steps", "0", 1), ("--batch-size", "0", 1),
                                                  ("--seq-len", "0", 1), ("--val-every", "1", 2)])
def test_options_below_their_least_value_are_refused(run, capsys, option, value, least):
    """--steps 0 (and the other sizes at 0) quietly meant the run's own value."""
    assert load_script("evaluate").main(["--checkpoint", str(run["dump"] / "checkpoint"),
                                         option, value]) == 1
    assert f"{option} {value}: expected >= {least}" in capsys.readouterr().err


def test_a_json_path_that_cannot_be_written_is_refused_before_evaluating(run, tmp_path, capsys):
    """It failed with a traceback when writing, after the evaluation had run."""
    (tmp_path / "a_file").write_text("")
    for path in (tmp_path / "no_folder" / "x.json", tmp_path / "a_file" / "x.json", tmp_path):
        assert load_script("evaluate").main(["--checkpoint", str(run["dump"] / "checkpoint"),
                                             "--json", str(path)]) == 1
        out, err = capsys.readouterr()
        assert err == f"evaluate: error: --json {path}: not a file in an existing folder\n"
        assert out == ""  # nothing evaluated


def test_json_replaces_an_earlier_record_but_no_other_file(run, tmp_path, capsys):
    """Given a run's metrics.jsonl or a checkpoint's train_state.json by mistake, --json
    replaced it (the checkpoint then read as damaged; a resume fell back a step)."""
    step = max((run["dump"] / "checkpoint").glob("step-*"), key=lambda p: int(p.name[5:]))
    theirs = []
    for source in (run["dump"] / "metrics.jsonl", step / "train_state.json"):
        copy = tmp_path / source.name  # a copy: a failing test must not damage the shared run
        copy.write_bytes(source.read_bytes())
        theirs.append(copy)
    for path in theirs:
        before = path.read_bytes()
        assert load_script("evaluate").main(["--checkpoint", str(step), "--json", str(path)]) == 1
        out, err = capsys.readouterr()
        assert err == (f"evaluate: error: --json {path}: exists and is not an earlier evaluate "
                       "record; pick another file\n")
        assert out == "" and path.read_bytes() == before
    record = tmp_path / "eval.json"
    for _ in range(2):  # the second run replaces the first one's record
        assert load_script("evaluate").main(["--checkpoint", str(step), "--json",
                                             str(record), "--steps", "1"]) == 0
    assert json.loads(record.read_text())["checkpoint"] == str(step)
    empty = tmp_path / "empty.json"  # as mktemp makes it: nothing in it to lose
    empty.write_text("")
    assert load_script("evaluate").main(["--checkpoint", str(step), "--json", str(empty),
                                         "--steps", "1"]) == 0
    assert json.loads(empty.read_text())["checkpoint"] == str(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.json", "eval.json",
                                                          "metrics.jsonl", "train_state.json"]
    # not a regular file: written to, never read (reading /dev/stdout waited for input) nor
    # replaced by a renamed file
    assert load_script("evaluate").main(["--checkpoint", str(step), "--json", os.devnull,
                                         "--steps", "1"]) == 0
    assert Path(os.devnull).is_char_device()


@pytest.mark.slow
def test_evaluate_reproduces_a_two_rank_runs_validation(tmp_path, capsys):
    """Each data-parallel rank validates its own share of the documents: evaluating rank 0's
    share alone gave other numbers than the run logged."""
    dump = tmp_path / "run"
    forked_ranks.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", str(ROOT / "train.py"), "--config",
                      str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
                      "--training.seq_len", "64", "--training.local_batch_size", "2",
                      "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
                      "--loss.impl", "unfused", "--data.num_workers", "0",
                      "--validation.enable", "true", "--validation.freq", "2",
                      "--validation.steps", "2", "--checkpoint.enable", "true",
                      "--checkpoint.interval", "2", "--job.print_config", "false",
                      "--job.dump_folder", str(dump)],
                     check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    (val,) = [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
              if "val_loss" in r]
    out = tmp_path / "eval.json"
    assert load_script("evaluate").main(["--checkpoint", str(dump / "checkpoint"), "--json",
                                         str(out), "--device", "cpu"]) == 0
    record = json.loads(out.read_text())
    for key in ("val_loss", "val_bpb"):
        assert record[key] == pytest.approx(val[key], abs=1e-6)
    assert record["tokens"] == 2 * 2 * 2 * 64


def test_a_mixture_run_names_its_mixture_and_a_repeated_validation_split(tmp_path, capsys):
    """Evaluating a mixture run scores the mixture and says so (it printed "stdlib"); a
    validation split shorter than the batches asked is reported, by the trainer at its first
    evaluation and by evaluate.py (which said read_more_than_once: false on shards)."""
    import random as random_module

    from shard_cases import random_texts, write_jsonl
    from scripts import prepare_data

    rng = random_module.Random(0)
    # validation splits of 99 (web) and 9 (code) windows of 64: 10 steps x 4 read 20 of each
    for name, count in (("web", 150), ("code", 20)):
        write_jsonl(tmp_path / f"{name}.jsonl", random_texts(rng, count))
        assert prepare_data.main(["--source", str(tmp_path / f"{name}.jsonl"), "--tokenizer",
                                  "byte", "--out", str(tmp_path / name), "--workers", "1",
                                  "--no-progress", "--val-every", "4"]) == 0
    mixture = f"{tmp_path / 'web'}:0.5,{tmp_path / 'code'}:0.5"
    dump = tmp_path / "run"
    capsys.readouterr()
    assert train.main(["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
                       "--loss.impl", "unfused", "--training.seq_len", "64",
                       "--training.local_batch_size", "4", "--training.steps", "2",
                       "--lr_scheduler.warmup_steps", "1", "--data.mixture", mixture,
                       "--validation.enable", "true", "--validation.freq", "1",
                       "--validation.steps", "10", "--checkpoint.enable", "true",
                       "--job.print_config", "false", "--job.dump_folder", str(dump)]) == 0
    logged = capsys.readouterr().out
    code = f"{tmp_path / 'code'} (validation)"
    assert logged.count("warning: [validation] steps = 10") == 1  # once, not every evaluation
    assert code in logged and f"{tmp_path / 'web'} (validation)" not in logged

    out = tmp_path / "eval.json"
    assert load_script("evaluate").main(["--checkpoint", str(dump / "checkpoint"),
                                         "--json", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert f"of mixture {mixture} (validation)" in printed.out and "stdlib" not in printed.out
    assert f"note: {code}: fewer tokens than the 2,560 scored" in printed.err
    record = json.loads(out.read_text())
    assert (record["source"], record["read_more_than_once"]) == (mixture, True)
    assert record["mixture"] == [{"source": str(tmp_path / "web"), "weight": 0.5},
                                 {"source": str(tmp_path / "code"), "weight": 0.5}]
    (val,) = [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
              if "val_loss" in r and r["step"] == 2]
    assert record["val_loss"] == pytest.approx(val["val_loss"], abs=1e-6)
    # fewer steps read each window once
    assert load_script("evaluate").main(["--checkpoint", str(dump / "checkpoint"), "--steps", "1",
                                         "--json", str(out), "--device", "cpu"]) == 0
    assert not json.loads(out.read_text())["read_more_than_once"]
    assert "note:" not in capsys.readouterr().err
