"""Training past a flavor's native context: [model] max_seq_len and rope_scaling_factor.

The debug flavor's native length is 2048; these tests extend it to 4096 with Llama-3 RoPE
scaling (factor 2 from an original 2048), train at 2560 tokens, and check that the exported
config.json says so (max_position_embeddings, rope_scaling), that transformers computes our
logits at 2560 positions from the folder alone, and that the folder loads back through
`[checkpoint] initial_load_path` (and is refused, naming the key, by a run whose RoPE differs).
A sequence longer than the model's context is a one-line config error naming the key.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from components.config.schema import ConfigError, Training
from components.config.parse import load_config
from models import FLAVORS, Llama, with_context
from models import hf
from parallelisms.build import model_args
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread)

ROOT = Path(__file__).resolve().parents[1]
DEBUG = FLAVORS["debug"]
LONG = ["--model.max_seq_len", "4096", "--model.rope_scaling_factor", "2"]
SEQ = 2560  # past the debug flavor's 2048
BASE = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--job.print_config", "false", "--validation.enable", "false", "--data.synthetic", "true",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1"]


def test_with_context_keeps_the_flavor_unless_asked():
    assert with_context(DEBUG) is DEBUG
    longer = with_context(DEBUG, max_seq_len=4096)
    assert (longer.max_seq_len, longer.rope_scaling_factor) == (4096, None)
    # a flavor without scaling gets Llama-3 scaling from its own length
    scaled = with_context(DEBUG, 4096, 2.0)
    assert (scaled.rope_scaling_factor, scaled.rope_original_max_pos) == (2.0, 2048)
    assert (scaled.rope_low_freq_factor, scaled.rope_high_freq_factor) == (1.0, 4.0)
    # a flavor with scaling keeps its original length (Llama 3's 8192) and changes the factor
    one_b = with_context(FLAVORS["llama_1b"], 262144, 64.0)
    assert (one_b.max_seq_len, one_b.rope_scaling_factor, one_b.rope_original_max_pos) == \
        (262144, 64.0, 8192)


@pytest.mark.parametrize("argv,message", [
    (["--training.seq_len", "4096"],
     "[training] seq_len = 4096 exceeds [model] max_seq_len = 2048 (the debug flavor's): set "
     "[model] max_seq_len = 4096 or more to train longer sequences"),
    (["--training.seq_len", "8192", *LONG],
     "[training] seq_len = 8192 exceeds [model] max_seq_len = 4096: set [model] max_seq_len = "
     "8192 or more"),
])
def test_a_sequence_longer_than_the_context_is_one_config_line(tmp_path, monkeypatch, capsys,
                                                               argv, message):
    argv = BASE + argv + ["--job.dump_folder", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=r"exceeds \[model\] max_seq_len"):
        train.main(argv)
    monkeypatch.setattr("sys.argv", ["train.py", *argv])
    assert train.command_line() == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: " + message) and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,match", [
    (["--model.max_seq_len", "-1"], r"\[model\] max_seq_len = -1: must be >= 1, or 0"),
    (["--model.rope_scaling_factor", "0.5"], r"\[model\] rope_scaling_factor = 0.5: must be >= 1"),
    (["--model.rope_scaling_factor", "nan"], r"\[model\] rope_scaling_factor = nan"),
])
def test_bad_context_keys_are_named(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(argv)


def _sharp(model: Llama) -> Llama:
    """q/k drawn larger than at init: attention is sharp, so a wrong RoPE shows in the logits."""
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.normal_(0.0, 0.3)
            layer.attention.wk.weight.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.slow
def test_trained_past_the_flavor_exports_and_imports_what_it_was_trained_at(tmp_path):
    transformers = pytest.importorskip("transformers")
    # one training step at 2560 tokens, validated at that length, with a checkpoint
    run = tmp_path / "run"
    corpus = tmp_path / "corpus.txt"  # text, so that scripts.evaluate reads the same held-out part
    corpus.write_text("\n\n".join(f"document {i}: " + "the quick brown fox jumps. " * 60
                                   for i in range(12)))
    assert train.main(BASE + LONG + ["--training.seq_len", str(SEQ), "--training.steps", "1",
                                     "--training.local_batch_size", "1",
                                     "--data.synthetic", "false", "--data.source", str(corpus),
                                     "--data.val_every", "3",
                                     "--validation.enable", "true", "--validation.steps", "1",
                                     "--checkpoint.enable", "true",
                                     "--job.dump_folder", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (validated,) = [r for r in rows if "val_loss" in r]
    # scripts.evaluate reads the run's context from its config.toml (it took the flavor's 2048
    # and refused the run's 2560-token windows) and gives the run's validation loss
    from scripts import evaluate
    record = tmp_path / "eval.json"
    # on the run's device (CPU, fp32): on a GPU machine the default (CUDA, bf16) rounds 5e-4 apart
    assert evaluate.main(["--checkpoint", str(run / "checkpoint"), "--json", str(record),
                          "--device", "cpu"]) == 0
    record = json.loads(record.read_text())
    assert record["seq_len"] == SEQ
    assert record["val_loss"] == pytest.approx(validated["val_loss"], abs=1e-5)
    # export from the checkpoint's path alone: config.toml says the context and the scaling
    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-m", "scripts.export_hf", "--checkpoint",
                             str(run / "checkpoint"), "--out", str(out), "--dtype", "float32"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 2048}
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    assert transformers.LlamaConfig.from_pretrained(out).max_position_embeddings == 4096

    # the folder's weights with sharp attention: transformers' logits at 2560 positions are ours
    args = hf.args_from_hf_config(config)
    assert args == with_context(dataclasses.replace(DEBUG, vocab_size=config["vocab_size"]),
                                4096, 2.0)
    ours = Llama(args, seq_len=SEQ)
    ours.load_state_dict(hf.load_hf_weights(out, args))
    torch.manual_seed(0)
    _sharp(ours)
    hf.save_hf_folder(hf.to_hf(ours.state_dict(), args), config, out)
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, **{key: torch.float32}).eval()
    tokens = torch.randint(0, args.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours.logits(ours(tokens)), theirs(input_ids=tokens).logits
        # the negative control: the flavor's unscaled RoPE at the same positions
        unscaled = dataclasses.replace(args, rope_scaling_factor=None)
        control = Llama(unscaled, seq_len=SEQ)
        control.load_state_dict(ours.state_dict())
        c = control.logits(control.eval()(tokens))
    assert a.abs().max() > 1.0
    # transformers' float32 frequencies vs this Llama's float64 angles: ~6e-5 here; the
    # flavor's unscaled RoPE is off by ~0.2
    assert (a - b)[:, 2048:].abs().max() < 1e-3
    assert (c - b)[:, 2048:].abs().max() > 1e-1

    # and back: a run with the same [model] keys starts from the folder and scores its loss ...
    again = tmp_path / "again"
    argv = BASE + LONG + ["--training.seq_len", str(SEQ), "--training.steps", "1",
                          "--training.local_batch_size", "1", "--loss.impl", "unfused",
                          "--checkpoint.initial_load_path", str(out),
                          "--job.dump_folder", str(again)]
    assert train.main(argv) == 0
    inputs, labels = _first_batch(argv)
    with torch.no_grad():
        logits = theirs(input_ids=inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    first = json.loads((again / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(first - expected) < 1e-4
    # ... and a run with the flavor's RoPE is refused, naming the key to set
    with pytest.raises(ValueError, match=r"rope_scaling_factor None vs 2.0 \(set \[model\] "
                                         r"rope_scaling_factor = 2.0\)"):
        train.main(BASE + ["--training.seq_len", "64", "--checkpoint.initial_load_path", str(out),
                           "--job.dump_folder", str(tmp_path / "refused")])


def _first_batch(argv):
    from components.data.build import build_data
    from components.tokenizer import ByteTokenizer
    cfg = load_config(argv)
    return next(build_data(cfg.data, Training(seq_len=SEQ, local_batch_size=1, seed=0),
                           split="train", tokenizer=ByteTokenizer(), max_token_id=DEBUG.vocab_size))


def _peak_rss_of_evaluate(argv: list[str]) -> int:
    """scripts.evaluate run in a fresh process: its peak resident memory, in bytes."""
    code = ("import resource, sys\nfrom scripts import evaluate\nassert evaluate.main(sys.argv[1:]) == 0\n"
            "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                            cwd=ROOT, timeout=300, env={**__import__("os").environ,
                                                        "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split("maxrss")[-1]) * 1024  # KiB on Linux


@pytest.mark.slow
def test_evaluate_holds_no_full_logits(tmp_path):
    """scripts.evaluate's default loss on the CPU was the unfused one, whose [tokens, vocab]
    logits (64 GiB for one sequence of 131072 tokens with Llama 3's vocabulary) made a long
    sequence impossible to evaluate; the fused loss holds one chunk of them (the run's [loss]
    chunk_size, 1024 tokens here). 65536 tokens and 4096 classes: 1 GiB of logits, which must
    not show in the peak memory."""
    run = tmp_path / "run"
    assert train.main(BASE + ["--model.vocab_size", "4096", "--loss.chunk_size", "1024",
                              "--training.seq_len", "64", "--training.steps", "1",
                              "--training.local_batch_size", "1", "--checkpoint.enable", "true",
                              "--job.dump_folder", str(run)]) == 0
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(f"paragraph {i}: " + "lorem ipsum dolor sit amet " * 40
                                 for i in range(40)))
    argv = ["--checkpoint", str(run / "checkpoint"), "--source", str(text), "--split", "train",
            "--seq-len", "512", "--steps", "1", "--device", "cpu"]
    baseline = _peak_rss_of_evaluate(argv + ["--batch-size", "1"])
    tokens = 128 * 512
    grown = _peak_rss_of_evaluate(argv + ["--batch-size", "128"]) - baseline
    assert grown < tokens * 4096 * 4, f"{grown / 2**30:.2f} GiB more for 65536 tokens"

def test_the_long_config_fits_its_context_on_one_gpu_and_with_cp():
    """configs/llama_1b_long.toml: past the flavor's 131072, batch 1, full activation
    checkpointing; the two-GPU command in its header passes the same checks."""
    from parallelisms.mesh import ParallelDims
    config = str(ROOT / "configs/llama_1b_long.toml")
    cfg = load_config(["--config", config])
    assert (cfg.training.local_batch_size, cfg.activation_checkpoint.mode) == (1, "full")
    assert cfg.training.seq_len > FLAVORS["llama_1b"].max_seq_len
    assert cfg.loss.impl == "flce" and cfg.validation.enable
    args = model_args(cfg, 259, ParallelDims.resolve(1, -1, 1, 1))
    assert args.max_seq_len == cfg.training.seq_len
    two = load_config(["--config", config, "--parallelism.context_parallel_degree", "2",
                       "--training.seq_len", "524288", "--model.max_seq_len", "524288"])
    assert model_args(two, 259, ParallelDims.resolve(1, -1, 1, 2, cp=2)).max_seq_len == 524288
