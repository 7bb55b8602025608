"""Config parsing: TOML, overrides in both spellings, types, and errors that name the key."""

import re
from pathlib import Path

import pytest

from components.config.schema import ConfigError
from components.config.parse import check_config_not_overwritten, load_config
from components.config.toml_out import config_changes, to_toml

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(["--config", str(path)])
    assert cfg.model.flavor in ("debug", "llama_1b", "llama_8b")


def test_overrides_both_spellings_and_types(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = 5\nmax_norm = 2\n[loss]\nimpl = "unfused"\n')
    cfg = load_config(["--config", str(toml), "--training.steps", "9", "--loss.impl=flce",
                       "--optimizer.lr=1e-3", "--data.synthetic", "true",
                       "--compile.components", "model,loss", "--lr_scheduler.decay_ratio", "0.2"])
    assert cfg.training.steps == 9 and cfg.loss.impl == "flce"
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.optimizer.lr == 1e-3 and cfg.data.synthetic is True
    assert cfg.compile.components == ["model", "loss"] and cfg.lr_scheduler.decay_ratio == 0.2


def test_float8_loss_needs_the_fused_loss():
    from components.config.schema import Loss
    from components.loss import TrainingLoss
    with pytest.raises(ValueError, match=r"\[loss\] float8 = 'logits' needs \[loss\] impl"):
        TrainingLoss(Loss(impl="unfused", float8="logits"))
    assert TrainingLoss(Loss(float8="logits+dx")).float8 == "logits+dx"


@pytest.mark.parametrize("argv,match", [
    (["--training.step", "3"], r"unknown config key \[training\] step \(did you mean 'steps'\?\)"),
    (["--trainig.steps", "3"], r"unknown config section \[trainig\] \(did you mean 'training'\?\)"),
    (["--training.steps", "three"], r"\[training\] steps: expected int, got 'three'"),
    (["--training.deterministic", "maybe"], r"\[training\] deterministic: expected bool"),
    (["--loss.impl", "fused"], r"\[loss\] impl = 'fused': expected one of"),
    (["--loss.float8", "all"], r"\[loss\] float8 = 'all': expected one of"),
    (["--training.mixed_precision_reduce", "float16"],
     r"\[training\] mixed_precision_reduce = 'float16': expected one of"),
    (["--training.steps", "0"], r"\[training\] steps = 0: must be >= 1"),
    (["--data.on_bad_document", "ignore"], r"\[data\] on_bad_document = 'ignore': expected one of"),
    (["--training.steps"], r"needs a value"),
    (["--activation_checkpoint.mode", "memory_budget"],
     r"mode = \"memory_budget\" needs \[compile\] enable = true with \"model\" in components"),
    (["--activation_checkpoint.memory_budget", "1.5"],
     r"\[activation_checkpoint\] memory_budget = 1.5: must be in \[0, 1\]"),
    (["steps=3"], r"unexpected argument"),
    (["--config", "/nonexistent.toml"], r"no such file"),
])
def test_bad_command_line(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(argv)


@pytest.mark.parametrize("text,match", [
    ('[training]\nsteps = "10"\n', r"\[training\] steps: expected int, got str '10'"),
    ('[training]\nseq_lenn = 10\n', r"did you mean 'seq_len'"),
    ('[optimiser]\nlr = 0.1\n', r"did you mean 'optimizer'"),
    ('[loss]\nmemory_lean = 1\n', r"\[loss\] memory_lean: expected bool"),
    ('steps = 10\n', r"must be a \[section\]"),
    ('[training\n', r"invalid TOML"),
])
def test_bad_toml(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(["--config", str(path)])


def test_mixture_tables_parse_override_and_round_trip(tmp_path):
    for name in ("web", "code", "books"):
        (tmp_path / name).mkdir()
    toml = tmp_path / "m.toml"
    toml.write_text(f'[data]\nnum_workers = 4\n[[data.mixture]]\nsource = "{tmp_path / "web"}"\nweight = 0.7\n'
                    f'[[data.mixture]]\nsource = "{tmp_path / "code"}"\nweight = 3\n')
    cfg = load_config(["--config", str(toml)])
    assert [(m.source, m.weight) for m in cfg.data.mixture] == [(str(tmp_path / "web"), 0.7),
                                                               (str(tmp_path / "code"), 3.0)]
    assert cfg.data.num_workers == 4
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(to_toml(cfg))
    assert load_config(["--config", str(resolved)]) == cfg
    # The command line replaces the whole list ("folder:weight,..."); "" empties it.
    books = load_config(["--config", str(toml), "--data.mixture", f"{tmp_path / 'books'}:2,{tmp_path / 'web'}:1"])
    assert [(m.source, m.weight) for m in books.data.mixture] == [(str(tmp_path / "books"), 2.0),
                                                                 (str(tmp_path / "web"), 1.0)]
    assert load_config(["--config", str(toml), "--data.mixture", ""]).data.mixture == []
    assert config_changes(to_toml(cfg), books) == [
        f'[data] mixture: [{{source = "{tmp_path / "web"}", weight = 0.7}}, {{source = "{tmp_path / "code"}", '
        f'weight = 3.0}}] -> [{{source = "{tmp_path / "books"}", weight = 2.0}}, {{source = "{tmp_path / "web"}", '
        f'weight = 1.0}}]']


def test_checkpoint_enable_takes_torchtitan_v01s_name_too(tmp_path):
    """[checkpoint] enable is torchtitan v0.2's name; v0.1's enable_checkpoint is read as it."""
    path = tmp_path / "old.toml"
    path.write_text("[checkpoint]\nenable_checkpoint = true\n")
    assert load_config(["--config", str(path)]).checkpoint.enable is True
    assert load_config(["--checkpoint.enable_checkpoint", "true"]).checkpoint.enable is True
    cfg = load_config(["--checkpoint.enable", "true"])
    assert "enable = true" in to_toml(cfg) and "enable_checkpoint" not in to_toml(cfg)
    # a checkpoint's config.toml written under the old name: no change to report
    saved = to_toml(cfg).replace("enable = true", "enable_checkpoint = true")
    assert config_changes(saved, cfg) == []


def test_lr_scheduler_min_lr_factor_takes_this_repos_old_name_too(tmp_path):
    """torchtitan names it min_lr_factor; configs and checkpoints written as min_lr_ratio load."""
    path = tmp_path / "old.toml"
    path.write_text("[lr_scheduler]\nmin_lr_ratio = 0.25\n")
    assert load_config(["--config", str(path)]).lr_scheduler.min_lr_factor == 0.25
    assert load_config(["--lr_scheduler.min_lr_ratio", "0.5"]).lr_scheduler.min_lr_factor == 0.5
    cfg = load_config(["--lr_scheduler.min_lr_factor", "0.25"])
    saved = to_toml(cfg).replace("min_lr_factor = 0.25", "min_lr_ratio = 0.25")
    assert "min_lr_ratio" in saved and config_changes(saved, cfg) == []


@pytest.mark.parametrize("section,key,here", [
    ("debug", "seed", "[training] seed"), ("training", "dataset", "[data] source"),
    ("model", "hf_assets_path", "[tokenizer] path"), ("training", "batch_size",
                                                      "[training] local_batch_size")])
def test_torchtitans_keys_that_live_elsewhere_here_are_named(tmp_path, section, key, here):
    """A torchtitan key under another name here: the error says which (the close-match suggestion
    looks in the same section only, and [debug] is no section here)."""
    message = rf"^unknown config key \[{section}\] {key}: torchtitan's \[{section}\] {key} is " \
              + re.escape(here) + " here$"
    with pytest.raises(ConfigError, match=message):
        load_config([f"--{section}.{key}", "1"])
    (tmp_path / "titan.toml").write_text(f"[{section}]\n{key} = 1\n")
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", str(tmp_path / "titan.toml")])


def test_choices_come_from_the_literal_types():
    """A key with a Literal type accepts exactly its values; a bad one is named with all of them."""
    import dataclasses
    import typing

    from components.config import schema as config
    for name, section in [("loss", config.Loss), ("model", config.Model), ("checkpoint", config.Checkpoint)]:
        for f in dataclasses.fields(section):
            annotation = typing.get_type_hints(section)[f.name]
            if typing.get_origin(annotation) is not typing.Literal:
                continue
            for value in typing.get_args(annotation):
                assert getattr(getattr(load_config([f"--{name}.{f.name}", value]), name), f.name) == value
            with pytest.raises(ConfigError) as error:
                load_config([f"--{name}.{f.name}", "bogus"])
            assert str(error.value).startswith(f"[{name}] {f.name} = 'bogus': expected one of "
                                               + ", ".join(map(repr, typing.get_args(annotation))))
    with pytest.raises(ConfigError, match=r"\[loss\] impl = 'flcee': expected one of 'flce', "
                                          r"'unfused', 'torch_chunked' \(did you mean 'flce'\?\)"):
        load_config(["--loss.impl", "flcee"])
    with pytest.raises(ConfigError, match=r"\[compile\] components: 'optimizer' is not one of 'model', 'loss'"):
        load_config(["--compile.components", "model,optimizer"])


def test_modules_list_the_configs_choices():
    """The modules that check a choice themselves take the list from the config's Literal; the
    ones that cannot import it (models/ stands below components/) or keep their own order agree."""
    import typing

    import flce.float8
    from components import loss, metrics, optim, tokenizer
    from components.data import checks as data_check
    from components.config import schema as config
    from models import sdpa
    from parallelisms import activation_checkpoint, tp
    from scripts.bench import train as bench_train
    args = typing.get_args
    assert loss.IMPLS == args(config.LossImpl)
    assert tokenizer.TOKENIZER_NAMES == args(config.TokenizerName)
    assert optim.IMPLEMENTATIONS == args(config.OptimizerImplementation)
    assert optim.DECAY_TYPES == args(config.DecayType)
    assert tuple(optim.OPTIMIZERS) == args(config.OptimizerName)
    assert metrics.WANDB_MODES == args(config.WandbMode)
    assert data_check.ON_BAD_DOCUMENT == args(config.OnBadDocument)
    assert tp.LOSS_PARALLEL == args(config.LossParallel)
    assert activation_checkpoint.MODES == args(config.ACMode)
    assert sorted(sdpa.BACKENDS) == sorted(args(config.SdpaBackend))
    assert sorted((*bench_train.AC_MODES, "memory_budget")) == sorted(args(config.ACMode))
    assert set(bench_train.LOSS_IMPLS.values()) == set(args(config.LossImpl))
    assert flce.float8.FLOAT8 == args(config.LossFloat8)  # the library cannot import the config


ROOT = Path(__file__).resolve().parents[1]


def _train_py(*argv):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_help_lists_every_key_with_its_choices():
    """`python3 train.py --help` prints usage and each section's keys (type, default, allowed
    values, doc) and exits 0; it used to fail with "--help needs a value"."""
    result = _train_py("--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("usage: python3 train.py") and result.stderr == ""
    loss = out[out.index("\n[loss]"):]
    assert 'impl = "flce"    ("flce" | "unfused" | "torch_chunked")\n      "flce" (fused' in loss
    assert '[quantize.linear.float8]' in out and 'recipe_name = "tensorwise"' in out
    from components.config.fields import sections
    for path, section in sections():
        assert f"\n[{path}]" in out
        for key in vars(section):
            assert f"\n  {key} = " in out, (path, key)


def test_help_in_process_and_as_a_value(capsys):
    import train
    assert train.main(["--config", "nope.toml", "-h"]) == 0
    assert "[training]" in capsys.readouterr().out
    # "-h" as a key's value is a value
    assert load_config(["--job.description", "-h"]).job.description == "-h"
    with pytest.raises(ConfigError, match="python3 train.py --help"):
        load_config(["--help"])


def test_a_config_error_is_one_line_and_exit_status_2():
    result = _train_py("--training.stepz", "3")
    assert result.returncode == 2
    assert result.stderr == "config error: unknown config key [training] stepz (did you mean 'steps'?)\n"
    assert "Traceback" not in result.stdout + result.stderr


def test_a_config_folder_is_named_a_folder(tmp_path):
    """--config naming a folder (a run's dump folder, say) said "no such file", which it is not;
    with a config.toml in it, that file is pointed at."""
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}: a folder, not a TOML file$"):
        load_config(["--config", str(tmp_path)])
    (tmp_path / "config.toml").write_text("[training]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}: a folder, not a TOML file "
                                          rf"\(did you mean {tmp_path}/config\.toml\?\)$"):
        load_config(["--config", str(tmp_path)])


@pytest.mark.parametrize("argv,message", [
    (["--config", "/nonexistent.toml"], "config error: --config /nonexistent.toml: no such file"),
    (["--training.steps"], "config error: --training.steps needs a value"),
    (["--checkpoint.enable", "--job.dump_folder", "X"],  # the flag that lacks it, not 'X'
     "config error: --checkpoint.enable needs a value: the next argument, --job.dump_folder, is "
     "another flag (write --checkpoint.enable true or false)"),
    (["--job.dump_folder", "--config", "c.toml"],
     "config error: --job.dump_folder needs a value: the next argument, --config, is another flag "
     "(a value that starts with -- goes as --job.dump_folder=VALUE)"),
    (["--loss.impl", "fused"], "config error: [loss] impl = 'fused': expected one of 'flce', 'unfused', "
                               "'torch_chunked' (did you mean 'unfused'?)"),
    (["--config", "{bad}"], "config error: {bad}: invalid TOML: Expected ']' at the end of a table "
                            "declaration (at line 1, column 10)"),
    (["--training.max_norm", "nan"],  # was silently no clipping
     "config error: [training] max_norm = nan: must be a number (0 or less: no clipping)"),
    (["--checkpoint.keep_latest_k", "-1"],
     "config error: [checkpoint] keep_latest_k = -1: must be >= 0 (0: keep all)"),
])
def test_config_errors_from_the_command_line(tmp_path, monkeypatch, capsys, argv, message):
    """train.main() raises ConfigError (tests and other callers catch it); the command line
    turns it into one stderr line and exit status 2."""
    import train
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    argv = [a.format(bad=bad) for a in argv]
    with pytest.raises(ConfigError):
        train.main(argv)
    monkeypatch.setattr("sys.argv", ["train.py", *argv])
    assert train.command_line() == 2
    out = capsys.readouterr()
    assert out.err == message.format(bad=bad) + "\n" and out.out == ""


def _refusal(tmp_path, monkeypatch, capsys, *argv) -> str:
    """train.py's command line with argv: exit status 2 and one stderr line, returned."""
    import train
    monkeypatch.setattr("sys.argv", ["train.py", "--config", str(ROOT / "configs/debug.toml"),
                                     "--training.device", "cpu", "--loss.impl", "unfused",
                                     "--job.dump_folder", str(tmp_path / "run"), *argv])
    assert train.command_line() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def test_refusals_the_user_causes_are_one_line_and_exit_status_2(tmp_path, monkeypatch, capsys):
    """Not only config keys: a dump folder in use (a traceback of ~25 lines before), a data source
    that cannot be read, an lr of inf (whose message offered "(0.0, inf]"), one mixture folder
    spelt twice."""
    import os
    import socket

    from components.lock import acquire, release

    held = acquire(tmp_path / "run")
    try:
        assert _refusal(tmp_path, monkeypatch, capsys).startswith(
            f"error: dump folder {tmp_path / 'run'} is in use by another run (pid {os.getpid()} on "
            f"{socket.gethostname()}, started ")
    finally:
        release(held)
    assert _refusal(tmp_path, monkeypatch, capsys, "--data.source", str(tmp_path / "nowhere")) == (
        f"config error: data source not found: {tmp_path / 'nowhere'}")
    assert _refusal(tmp_path, monkeypatch, capsys, "--optimizer.lr", "inf") == (
        "config error: [optimizer] lr = inf: must be a finite number in (0.0, inf)")
    (tmp_path / "web").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _refusal(tmp_path, monkeypatch, capsys, "--data.mixture", "web:0.5,./web/:0.5") == (
        "config error: [[data.mixture]] #2: source './web/' is listed twice (as 'web' too)")


def test_docs_config_md_is_current():
    """docs/config.md is generated from the config's dataclasses; a changed key, type, default
    or doc must come with the regenerated file."""
    from components.config.docs import reference_markdown
    current = (ROOT / "docs/config.md").read_text() if (ROOT / "docs/config.md").is_file() else ""
    assert current == reference_markdown(), (
        "docs/config.md is stale: regenerate it with `python3 -m scripts.config_reference > docs/config.md`")


def test_every_key_has_a_doc():
    from components.config.docs import field_docs
    from components.config.fields import sections
    for path, section in sections():
        missing = [key for key in vars(section) if key not in field_docs(type(section))]
        assert not missing, f"[{path}] {missing}: give each a docstring (the string below the field)"


def test_model_name_takes_torchtitans_llama3():
    """torchtitan v0.2 configs say [model] name = "llama3"; "llama" names the same model."""
    assert load_config([]).model.name == "llama3"
    assert load_config(["--model.name", "llama"]).model.name == "llama"
    with pytest.raises(ConfigError, match=r"\[model\] name = 'llama4'"):
        load_config(["--model.name", "llama4"])


@pytest.mark.parametrize("argv,error,message", [
    (["--model.flavor", "llama_2b"], ConfigError,
     "config error: [model] flavor = 'llama_2b': expected one of the llama3 flavors"),
    (["--model.vocab_size", "100"], ConfigError,
     "config error: [model] vocab_size 100 is smaller than the tokenizer's 259 ids"),
    (["--tokenizer.name", "hf", "--tokenizer.path", "{tmp}/missing.json"], FileNotFoundError,
     "config error: tokenizer file not found: {tmp}/missing.json"),
    (["--parallelism.tensor_parallel_degree", "3"], ValueError,
     "config error: world size 1 is not divisible"),
    # these five were tracebacks (exit status 1) raised while the model was built
    (["--loss.label_smoothing", "1.5"], ValueError,
     "config error: [loss] label_smoothing=1.5: must be in [0, 1]"),
    (["--loss.chunk_size", "-4"], ValueError,
     "config error: [loss] chunk_size = -4: expected 0 (automatic) or a number of tokens > 0"),
    (["--loss.softcap", "-1"], ValueError,  # said "None or ...", which a config cannot write
     "config error: [loss] softcap = -1.0: expected 0 (none) or a finite number > 0"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
      "abc"], ValueError, "config error: [activation_checkpoint] selective_ac_option = 'abc'"),
    # a superscript two passed str.isdigit() and int() then said "invalid literal", naming no key
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
      "\u00b2"], ValueError,
     "config error: [activation_checkpoint] selective_ac_option = '\u00b2'"),
    (["--model.sdpa_backend", "cudnn", "--training.device", "cpu"], ValueError,
     "config error: [model] sdpa_backend = 'cudnn' selects a CUDA kernel, but the model runs on cpu"),
    (["--model.converters", "quantize.linear.float8", "--training.device", "cpu"], ValueError,
     "config error: float8 training needs a CUDA GPU with fp8"),
])
def test_settings_checked_before_the_model_is_built_are_config_errors(tmp_path, monkeypatch,
                                                                      capsys, argv, error,
                                                                      message):
    """Found after the config loads (they need the tokenizer, the world size or the device),
    still the config's fault: one stderr line and exit status 2, no traceback; callers of main()
    get the exception's own type. The refused run leaves the dump folder's config.toml, that of
    the run that wrote its metrics, as it was (it was overwritten before these checks)."""
    import train
    argv = [a.format(tmp=tmp_path) for a in argv] + [
        "--job.dump_folder", str(tmp_path / "run"), "--job.print_config", "false"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("# the earlier run's\n")
    with pytest.raises(error):
        train.main(argv)
    monkeypatch.setattr("sys.argv", ["train.py", *argv])
    assert train.command_line() == 2
    out = capsys.readouterr()
    assert out.err.startswith(message.format(tmp=tmp_path)) and out.err.count("\n") == 1, out.err
    assert (tmp_path / "run" / "config.toml").read_text() == "# the earlier run's\n"


def test_a_run_refused_once_its_data_is_opened_leaves_the_folders_config(tmp_path, capsys):
    """A data mistake is found after the model is built; config.toml had been written before it,
    so the folder's metrics (the earlier run's) and its config.toml no longer matched."""
    import train
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("# the earlier run's\n")
    with pytest.raises(FileNotFoundError, match="data source not found"):
        train.main(["--config", str(ROOT / "configs" / "debug.toml"), "--job.dump_folder",
                    str(tmp_path / "run"), "--job.print_config", "false",
                    "--data.source", str(tmp_path / "missing.jsonl")])
    assert (tmp_path / "run" / "config.toml").read_text() == "# the earlier run's\n"


def test_memory_lean_or_chunk_size_with_an_unfused_loss_warns(tmp_path, capsys):
    """chunk_size was ignored by the unfused loss without a word."""
    import train
    assert train.main(["--loss.impl", "unfused", "--loss.memory_lean", "true", "--training.steps",
                       "1", "--job.dump_folder", str(tmp_path), "--job.print_config", "false",
                       "--validation.enable", "false", "--training.seq_len", "32",
                       "--loss.chunk_size", "7"]) == 0
    out = capsys.readouterr().out
    assert ('warning: [loss] memory_lean = true applies to impl = "flce" only; impl = '
            "'unfused' ignores it") in out
    assert ('warning: [loss] chunk_size = 7 applies to impl = "flce" and "torch_chunked"; '
            "impl = 'unfused' ignores it") in out


def test_a_vocab_parallel_loss_without_tensor_parallelism_warns(tmp_path, capsys):
    """The setting did nothing, silently: the output layer is only sharded over TP ranks."""
    import train
    assert train.main(["--loss.parallel", "vocab", "--training.steps", "1", "--job.dump_folder",
                       str(tmp_path), "--job.print_config", "false", "--validation.enable",
                       "false", "--training.seq_len", "32"]) == 0
    assert ('warning: [loss] parallel = "vocab" shards the output layer over the tensor-parallel '
            "ranks; with [parallelism] tensor_parallel_degree = 1 it does nothing"
            ) in capsys.readouterr().out


def test_a_key_and_its_older_name_in_one_table(tmp_path):
    """enable_checkpoint (torchtitan v0.1) beside enable: the later one won, silently."""
    (tmp_path / "c.toml").write_text("[checkpoint]\nenable = true\nenable_checkpoint = false\n")
    with pytest.raises(ConfigError, match=r"\[checkpoint\] sets both enable and its older name "
                                          r"enable_checkpoint"):
        load_config(["--config", str(tmp_path / "c.toml")])


def _data_mistake(tmp_path: Path, mistake: str) -> list[str]:
    """The command-line arguments of a run that makes it (its files written here)."""
    import json

    import numpy as np
    import torch
    from shard_cases import train_tokenizer, write_token_shards

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "a document"}) + "\n")
    if mistake == "wrong shard path":
        return ["--data.source", str(tmp_path / "shards")]
    if mistake == "shards of another tokenizer":
        import random
        tokenizer = train_tokenizer(tmp_path / "tokenizer.json", random.Random(0))
        write_token_shards(tmp_path / "shards", [np.arange(300)], tokenizer.vocab_size, tokenizer)
        return ["--data.source", str(tmp_path / "shards")]
    if mistake == "a .jsonl in a mixture":
        return ["--data.mixture", f"{corpus}:1"]
    if mistake == "no such text field":
        return ["--data.source", str(corpus), "--data.text_field", "body",
                "--data.cache_dir", str(tmp_path / "cache")]
    assert mistake == "initial_load_path of another vocabulary"
    from models import FLAVORS, Llama
    from scripts import export_hf
    import dataclasses
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=600)
    with torch.device("meta"):
        state = Llama(args, seq_len=1).state_dict()
    state = {k: torch.zeros(v.shape) for k, v in state.items()}
    export_hf.export(state, args, tmp_path / "hf", "float32")
    return ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--model.vocab_size", "520"]


@pytest.mark.parametrize("mistake,error,message", [
    ("wrong shard path", FileNotFoundError, "config error: data source not found: {tmp}/shards"),
    ("shards of another tokenizer", ValueError,
     "config error: {tmp}/shards: its shards were made with another tokenizer"),
    ("a .jsonl in a mixture", ValueError,
     "config error: [[data.mixture]] source '{tmp}/corpus.jsonl': not a token shard folder"),
    ("no such text field", KeyError,
     "config error: {tmp}/corpus.jsonl: the documents have no field 'body' (their fields: text)"),
    ("initial_load_path of another vocabulary", ValueError,
     "config error: [checkpoint] initial_load_path = {tmp}/hf: {tmp}/hf holds another model "
     "than [model] configures (this run vs the folder's config.json): vocab_size 520 vs 600"),
])
def test_data_mistakes_are_one_line_and_exit_status_2(tmp_path, monkeypatch, capsys, mistake,
                                                      error, message):
    """Found once the data or the weights are opened, and as much the run's settings' fault:
    one stderr line with the error's own message, exit status 2 (they were 15-22-line
    tracebacks with status 1)."""
    import train
    argv = _data_mistake(tmp_path, mistake) + [
        "--job.dump_folder", str(tmp_path / "run"), "--job.print_config", "false",
        "--training.device", "cpu", "--data.num_workers", "0"]
    with pytest.raises(error):
        train.main(argv)
    monkeypatch.setattr("sys.argv", ["train.py", *argv])
    capsys.readouterr()
    assert train.command_line() == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err


def test_a_leading_tilde_in_a_path_is_the_home_folder(tmp_path, monkeypatch):
    """TOML values and `--key=~/x` never pass through a shell: ~ was a folder named "~" in the
    current directory (a dump folder there, an initial_load_path not found)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text('[job]\ndump_folder = "~/runs/a"\n')
    cfg = load_config(["--config", "~/c.toml", "--checkpoint.initial_load_path=~/hf",
                       "--tokenizer.name", "hf", "--tokenizer.path", "~/tok.json",
                       "--data.cache_dir", "~/cache"])
    assert cfg.job.dump_folder == str(tmp_path / "runs/a")
    assert cfg.checkpoint.initial_load_path == str(tmp_path / "hf")
    assert cfg.tokenizer.path == str(tmp_path / "tok.json")
    assert cfg.data.cache_dir == str(tmp_path / "cache") and cfg.data.source == "stdlib"


def test_a_hand_written_config_in_the_dump_folder_is_not_overwritten(tmp_path):
    """--config <dump_folder>/config.toml: the run wrote its resolved config over the user's
    file (comments gone, this run's --training.steps 2 baked in for every later use)."""
    import train
    dump = tmp_path / "exp"
    dump.mkdir()
    own = dump / "config.toml"
    text = "# my experiment\n" + (ROOT / "configs/debug.toml").read_text()
    own.write_text(text)
    argv = ["--config", str(own), "--job.dump_folder", str(dump), "--training.steps", "2"]
    with pytest.raises(ConfigError, match=r"--config .*config.toml is .*: copy it elsewhere"):
        check_config_not_overwritten(argv, load_config(argv))
    with pytest.raises(ConfigError, match="copy it elsewhere"):
        train.main(argv)
    assert own.read_text() == text
    # the trainer's own resolved config, given back to resume as it was, may be written again
    own.write_text(to_toml(load_config(argv)))
    check_config_not_overwritten(argv, load_config(argv))


def test_a_command_line_value_that_is_not_utf8_is_refused():
    """A command-line byte outside UTF-8 (a latin-1 path, a description from a latin-1 `git log`)
    reaches Python as a lone surrogate: load_config took it, and the run failed writing
    config.toml (UnicodeEncodeError, a traceback) after setting the folder's earlier metrics
    aside, leaving config.toml empty."""
    with pytest.raises(ConfigError, match=r"\[job\] description = .*: not UTF-8 text"):
        load_config(["--job.description", "caf\udce9"])  # sys.argv's spelling of b"caf\xe9"
    assert load_config(["--job.description", "café 日本"]).job.description == "café 日本"


@pytest.mark.parametrize("section,key", [("job", "dump_folder"), ("checkpoint", "folder"),
                                         ("profiling", "save_traces_folder"),
                                         ("data", "cache_dir")])
def test_a_nul_character_in_a_path_key_is_a_config_error_naming_it(tmp_path, section, key):
    """TOML can spell a NUL ("\\u0000"), which no path may hold: load_config raised a bare
    ValueError ("embedded null byte"), a traceback rather than a config error, and for cache_dir
    the run said "config error: embedded null byte", naming no key."""
    path = tmp_path / "nul.toml"
    path.write_text(f'[{section}]\n{key} = "a\\u0000b"\n')
    with pytest.raises(ConfigError, match=rf"\[{section}\] {key} = .*: holds a NUL character"):
        load_config(["--config", str(path)])


def test_a_list_in_toml_brackets_on_the_command_line_is_refused():
    """Lists on the command line are comma-separated; --quantize.linear.float8.filter_fqns
    '["wk", "wq"]' became the entries '["wk"' and '"wq"]', which no layer name contains: wk and
    wq were converted to float8 without a word."""
    with pytest.raises(ConfigError, match=r"filter_fqns = .*: a list on the command line is "
                                          r"comma-separated"):
        load_config(["--quantize.linear.float8.filter_fqns", '["wk", "wq"]'])
    fqns = load_config(["--quantize.linear.float8.filter_fqns", "wk, wq"])
    assert fqns.quantize.linear.float8.filter_fqns == ["wk", "wq"]
    # "[]" for none: the line says how an empty list is written there
    with pytest.raises(ConfigError, match=r"converters = '\[\]': .* an empty value "
                                          r"\(--section.key=\) is the empty list"):
        load_config(["--model.converters=[]"])
    assert load_config(["--model.converters="]).model.converters == []
