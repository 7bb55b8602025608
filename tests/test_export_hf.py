"""scripts/export_hf.py: the exported folder loads in transformers and gives the same logits.

Each case builds a Llama, exports its state dict as the trainer stores it (`model.` prefix), loads
the folder with LlamaForCausalLM.from_pretrained and compares logits on random tokens in fp32.
The q/k weights are re-drawn larger than at init so that attention is sharp and RoPE (hence the
q/k permutation and the rope scaling) visibly changes the logits; two negative controls check
that the comparison would catch a missing permutation or missing rope scaling. A trainer's
checkpoint exports with nothing but its path: the model, the vocab size and the tokenizer come
from its config.toml, and the folder holds the tokenizer and the bos/eos ids.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import train  # noqa: E402
from components.config.schema import Data, Loss, Training  # noqa: E402
from components.data.build import build_data  # noqa: E402
from components.data.document_tokens import frame_texts  # noqa: E402
from components.loss import ModelWithLoss, TrainingLoss  # noqa: E402
from components.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from components.validation import evaluate  # noqa: E402
from models import FLAVORS, Llama, LlamaArgs  # noqa: E402
from models import hf  # noqa: E402
from parallelisms.context_parallel import NoSharding  # noqa: E402
from scripts import export_hf  # noqa: E402
from scripts.lib import checkpoints as reader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

DEBUG = FLAVORS["debug"]  # 4 heads, 2 kv heads: grouped-query attention
VARIANTS = {
    "debug_gqa": DEBUG,
    # original_max_pos 64 puts the 16 frequency pairs in all three bands (kept, ramp, scaled).
    "rope_scaling": dataclasses.replace(DEBUG, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                                        rope_high_freq_factor=4.0, rope_original_max_pos=64),
    "mha": dataclasses.replace(DEBUG, n_kv_heads=4),
    "mqa_tied": dataclasses.replace(DEBUG, n_kv_heads=1, tie_embeddings=True),
}
SEQ_LEN = 64


def _model(args: LlamaArgs, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(args, seq_len=SEQ_LEN)
    model.init_weights()
    with torch.no_grad():  # sharp attention, so that a wrong RoPE layout shows in the logits
        for layer in model.layers.values():
            layer.attention.wq.weight.normal_(0.0, 0.3)
            layer.attention.wk.weight.normal_(0.0, 0.3)
    return model.eval()


def _trainer_state(model: Llama) -> dict[str, torch.Tensor]:
    """As ModelWithLoss(model, loss).state_dict() names them."""
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def _load_hf(folder: Path):
    # transformers 5 renamed from_pretrained's torch_dtype to dtype (the old name still warns).
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        folder, output_loading_info=True, **{key: torch.float32})
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return hf.eval()


def _max_logit_diff(model: Llama, folder: Path, seed: int = 1) -> float:
    hf = _load_hf(folder)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ_LEN), generator=g)
    with torch.no_grad():
        ours = model.logits(model(tokens))
        theirs = hf(input_ids=tokens).logits
    assert theirs.shape == ours.shape and theirs.dtype == torch.float32
    assert ours.abs().max() > 1.0  # logits of a meaningful scale
    return (theirs - ours).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    args = VARIANTS[variant]
    model = _model(args)
    ckpt = tmp_path / "state.pt"
    torch.save(_trainer_state(model), ckpt)
    out = export_hf.export(reader.load_model_state(ckpt), args, tmp_path / "hf", "float32")

    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == args.n_kv_heads
    assert config["tie_word_embeddings"] == args.tie_embeddings
    assert config["torch_dtype"] == "float32"
    if args.rope_scaling_factor is None:
        assert config["rope_scaling"] is None
    else:
        assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64}
    names = set(safetensors_torch.load_file(out / "model.safetensors"))
    assert ("lm_head.weight" in names) == (not args.tie_embeddings)
    assert {"model.embed_tokens.weight", "model.norm.weight",
            "model.layers.3.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.post_attention_layernorm.weight"} <= names

    assert _max_logit_diff(model, out) < 1e-4


def test_comparison_catches_a_missing_permutation(tmp_path, monkeypatch):
    model = _model(DEBUG)
    monkeypatch.setattr(hf, "permute_to_hf", lambda w, n_heads: w)
    out = export_hf.export(_trainer_state(model), DEBUG, tmp_path / "hf", torch.float32)
    assert _max_logit_diff(model, out) > 1e-2


def test_comparison_catches_missing_rope_scaling(tmp_path):
    args = VARIANTS["rope_scaling"]
    model = _model(args)
    unscaled = dataclasses.replace(args, rope_scaling_factor=None)
    out = export_hf.export(_trainer_state(model), unscaled, tmp_path / "hf", torch.float32)
    assert _max_logit_diff(model, out) > 1e-2


def test_bfloat16_export_is_the_rounded_weights(tmp_path):
    model = _model(DEBUG)
    out = export_hf.export(_trainer_state(model), DEBUG, tmp_path / "hf")  # default: bfloat16
    tensors = safetensors_torch.load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"],
                       model.layers["1"].feed_forward.w2.weight.to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert transformers.LlamaConfig.from_pretrained(out).num_hidden_layers == DEBUG.n_layers


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_round_trip_through_the_cli(tmp_path):
    """A trainer-like DCP checkpoint (model + optimizer + step), exported by running the script."""
    import torch.distributed.checkpoint as dcp

    vocab = 600  # a run's [model] vocab_size override, given to the CLI
    args = dataclasses.replace(DEBUG, vocab_size=vocab)
    checkpoints = tmp_path / "dump" / "checkpoint"
    models = {}
    for step, seed in ((5, 1), (20, 2)):
        models[step] = _model(args, seed=seed)
        state = _trainer_state(models[step])
        optimizer = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in state.items()},
                     "param_groups": [{"lr": 3e-4}]}
        dcp.save({"model": state, "optimizer": optimizer, "step": step},
                 checkpoint_id=checkpoints / f"step-{step}", no_dist=True)

    assert reader.load_model_state(checkpoints / "step-5").keys() == \
        models[5].state_dict().keys()
    out = tmp_path / "hf"
    # The folder of step-<N> folders: the latest (step-20) is exported.
    result = subprocess.run(
        [sys.executable, "-m", "scripts.export_hf", "--checkpoint", str(checkpoints),
         "--flavor", "debug",
         "--vocab-size", str(vocab), "--out", str(out), "--dtype", "float32",
         "--bos-id", "256", "--eos-id", "257"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "step-20" in result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == vocab
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    assert _max_logit_diff(models[20], out) < 1e-4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_with_model_tensors_at_the_top_level(tmp_path):
    """torchtitan's layout: the model's keys beside (not under) the optimizer's nested entries."""
    import torch.distributed.checkpoint as dcp

    model = _model(DEBUG)
    state = _trainer_state(model)
    optimizer = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in state.items()}}
    dcp.save({**state, "optimizer": optimizer}, checkpoint_id=tmp_path / "step-1", no_dist=True)
    loaded = reader.load_model_state(tmp_path / "step-1")
    assert loaded.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_latest_step_is_chosen_by_the_trainers_rule(tmp_path):
    """A folder of step-<N> folders is read as the trainer reads it (components.checkpoint_folders'
    list_checkpoints, weights only): a later folder DCP never finished is skipped and named."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _trainer_state(_model(DEBUG))}, checkpoint_id=tmp_path / "step-2",
             no_dist=True)
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "__0_0.distcp").write_bytes(b"cut short")  # no .metadata
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint folder .*step-5"):
        assert reader.resolve(tmp_path) == tmp_path / "step-2"


def test_torch_save_of_a_full_trainer_state(tmp_path):
    model = _model(DEBUG)
    ckpt = tmp_path / "full.pt"
    torch.save({"model": _trainer_state(model), "optimizer": {"state": {}}, "step": 7}, ckpt)
    state = reader.load_model_state(ckpt)
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key


# ------------------------------------------------------------------------------------ errors

def _debug_state() -> dict[str, torch.Tensor]:
    return _trainer_state(_model(DEBUG))


def _assert_nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")], "temp folder left"


def test_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        reader.load_model_state(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a DCP checkpoint"):
        reader.load_model_state(tmp_path / "empty")
    code = export_hf.main(["--checkpoint", str(tmp_path / "nope"), "--flavor", "debug",
                           "--out", str(tmp_path / "hf")])
    assert code == 1
    assert "nope" in capsys.readouterr().err
    _assert_nothing_written(tmp_path)


def test_not_a_checkpoint_file(tmp_path):
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a torch.save file"):
        reader.load_model_state(tmp_path / "junk.pt")


def test_vocab_mismatch_names_the_key_shapes_and_the_fix(tmp_path, capsys):
    ckpt = tmp_path / "state.pt"
    torch.save(_trainer_state(_model(dataclasses.replace(DEBUG, vocab_size=600))), ckpt)
    code = export_hf.main(["--checkpoint", str(ckpt), "--flavor", "debug",
                           "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 1
    assert "tok_embeddings.weight: checkpoint shape [600, 128], flavor shape [512, 128]" in err
    assert "output.weight" in err and "--vocab-size 600" in err
    _assert_nothing_written(tmp_path)


def test_wrong_flavor_shape_mismatch(tmp_path):
    state = _trainer_state(_model(dataclasses.replace(DEBUG, ffn_dim=256)))
    with pytest.raises(ValueError, match=r"layers\.0\.feed_forward\.w1\.weight: checkpoint shape "
                                         r"\[256, 128\], flavor shape \[384, 128\]"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_missing_key(tmp_path):
    state = _debug_state()
    del state["model.layers.2.ffn_norm.weight"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): layers\.2\.ffn_norm\.weight"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_unexpected_key(tmp_path):
    state = _debug_state()
    state["model.layers.4.attention.wq.weight"] = torch.zeros(128, 128)
    with pytest.raises(ValueError,
                       match=r"unexpected keys \(1\): layers\.4\.attention\.wq\.weight"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_non_finite_weights(tmp_path):
    state = _debug_state()
    state["model.norm.weight"][3] = float("nan")
    with pytest.raises(ValueError, match=r"norm\.weight: holds non-finite"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    state = _debug_state()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_hf.export(state, DEBUG, out)
    assert (out / "old.txt").exists()
    (out / "old.txt").unlink()
    export_hf.export(state, DEBUG, out, overwrite=True)  # an empty folder
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export_hf.json",
                                                     "generation_config.json", "model.safetensors"]
    export_hf.export(state, DEBUG, out, overwrite=True)  # an earlier export
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temp or old folders left


def test_overwrite_replaces_only_an_earlier_export(tmp_path, capsys):
    """--out naming another run's dump folder, or another checkpoint: --overwrite refuses,
    naming what is there, and leaves it as it was."""
    state = _debug_state()
    torch.save(state, tmp_path / "state.pt")
    other_run = tmp_path / "other-run"
    (other_run / "checkpoint" / "step-2").mkdir(parents=True)
    (other_run / "metrics.jsonl").write_text("{}\n")
    for out in (other_run, other_run / "checkpoint"):
        assert export_hf.main(["--checkpoint", str(tmp_path / "state.pt"), "--flavor", "debug",
                               "--out", str(out), "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert f"output {str(out)!r} holds " in err and "no export_hf.json" in err, err
        assert err.count("\n") == 1, err  # one line, before the checkpoint is read
    assert (other_run / "metrics.jsonl").is_file() and (other_run / "checkpoint/step-2").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-run", "state.pt"]


def test_overwrite_keeps_a_run_written_into_an_earlier_export(tmp_path, capsys):
    """A run that trained from an export (initial_load_path) with that folder as its dump folder
    wrote its checkpoints, metrics and lock beside export_hf.json: --overwrite deleted them."""
    torch.save(_debug_state(), tmp_path / "state.pt")
    export = ["--checkpoint", str(tmp_path / "state.pt"), "--flavor", "debug", "--out",
              str(tmp_path / "hf"), "--overwrite"]
    assert export_hf.main(export) == 0
    assert export_hf.main(export) == 0  # an export alone is replaced
    (tmp_path / "hf" / "checkpoint" / "step-2").mkdir(parents=True)
    (tmp_path / "hf" / "metrics.jsonl").write_text("{}\n")
    capsys.readouterr()
    assert export_hf.main(export) == 1
    assert (f"output {str(tmp_path / 'hf')!r} holds checkpoint, metrics.jsonl, besides an export "
            "(export_hf.json): not written by this tool alone") in capsys.readouterr().err
    assert (tmp_path / "hf" / "checkpoint" / "step-2").is_dir()
    assert (tmp_path / "hf" / "metrics.jsonl").is_file()


# ------------------------------------------------------------------------ a trainer's checkpoint

RUN = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
       "--loss.impl", "unfused", "--training.seq_len", "64", "--training.steps", "2",
       "--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "2",
       "--validation.enable", "false", "--job.print_config", "false", "--data.synthetic", "true",
       "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2"]


def _train(dump: Path, *overrides) -> Path:
    assert train.main(RUN + ["--job.dump_folder", str(dump), *overrides]) == 0
    return dump / "checkpoint"


def test_a_trainers_checkpoint_exports_from_its_path_alone(tmp_path):
    """No --flavor, --vocab-size or ids: the run's config.toml says them. The folder holds the
    byte tokenizer as a tokenizer.json that transformers loads and that encodes like it."""
    folder = _train(tmp_path / "run", "--model.vocab_size", "300")
    out = tmp_path / "hf"
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(out),
                           "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (300, 256, 257)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (256, 257)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 257

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return 'héllo, 日本 😀'"
    assert tokenizer(text).input_ids == [256, *ByteTokenizer().encode(text)]  # bos, as trained
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)

    ours = reader.load_model(folder, torch.device("cpu")).model
    assert _max_logit_diff(ours, out) < 1e-4


def test_a_hugging_face_folder_is_not_exported_again(tmp_path, capsys):
    """It was read as a checkpoint without config.toml: "pass --flavor", which led nowhere."""
    folder = _train(tmp_path / "run", "--model.vocab_size", "300")
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 0
    assert export_hf.main(["--checkpoint", str(tmp_path / "hf"), "--out",
                           str(tmp_path / "again")]) == 1
    assert (f"{tmp_path / 'hf'} is a Hugging Face folder already: export_hf converts a DCP "
            "checkpoint or a torch.save file") in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_a_replaced_tokenizer_file_is_refused(tmp_path, capsys):
    """The run's [tokenizer] path (or --tokenizer) holding another vocabulary than the one
    trained with was exported without a word: ids that mean other tokens. generate and evaluate
    refused it already (train_state.json records the tokenizer's fingerprint)."""
    path = _bpe_tokenizer(tmp_path / "tok").path
    folder = _train(tmp_path / "run", "--tokenizer.name", "hf", "--tokenizer.path", str(path))
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two tokens' ids swapped
    other = tmp_path / "other.json"
    other.write_text(json.dumps(spec))
    for given in (["--tokenizer", str(other)], []):
        if not given:
            path.write_bytes(other.read_bytes())  # the run's own file replaced since
        out = tmp_path / f"hf{len(given)}"
        assert export_hf.main(["--checkpoint", str(folder), "--out", str(out), *given]) == 1
        assert ("ids as the run's tokenizer had, but other tokens or bos/eos ids: the model's ids "
                "would mean other tokens") in capsys.readouterr().err
        assert not out.exists()


def test_a_runs_hf_tokenizer_is_copied_with_its_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["some text to learn from, twice or more"] * 20,
                                  trainers.BpeTrainer(
                                      vocab_size=300, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "special_tokens_map.json").write_text('{"bos_token": "<s>"}\n')
    folder = _train(tmp_path / "run", "--tokenizer.name", "hf", "--tokenizer.path",
                    str(tmp_path / "tok" / "tokenizer.json"))
    out = tmp_path / "hf"
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(out)]) == 0
    # the same tokenizer, with training's framing as its post-processor
    copied, original = (json.loads((folder / "tokenizer.json").read_text())
                        for folder in (out, tmp_path / "tok"))
    assert copied.pop("post_processor")["single"][0] == {"SpecialToken": {"id": "<s>",
                                                                          "type_id": 0}}
    assert original.pop("post_processor") is None and copied == original
    assert json.loads((out / "special_tokens_map.json").read_text()) == {"bos_token": "<s>"}
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert (written["bos_token"], written["eos_token"]) == ("<s>", "</s>")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    assert config["vocab_size"] == FLAVORS["debug"].vocab_size


def test_a_run_with_a_logit_softcap_is_refused(tmp_path, capsys):
    folder = _train(tmp_path / "run", "--loss.softcap", "30")
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 1
    assert "softcap = 30.0: LlamaForCausalLM has neither" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_flavor_keeps_the_runs_model_settings(tmp_path, capsys):
    """--flavor built the bare flavor though config.toml was there: a run's [model] max_seq_len
    and rope_scaling_factor were dropped, and the folder gave other logits without a word."""
    folder = _train(tmp_path / "run", "--model.max_seq_len", "4096",
                    "--model.rope_scaling_factor", "2")
    out = tmp_path / "hf"
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(out), "--flavor", "debug",
                           "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096
    assert config["rope_scaling"]["factor"] == 2.0
    ours = reader.load_model(folder, torch.device("cpu")).model
    assert _max_logit_diff(ours, out) < 1e-4
    capsys.readouterr()
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "other"),
                           "--flavor", "llama_150m"]) == 1
    assert capsys.readouterr().err.endswith(
        f"\nexport_hf: error: --flavor llama_150m: {folder / 'step-2' / 'config.toml'} says "
        "[model] flavor = 'debug'; leave --flavor out to export the run's model\n")
    assert not (tmp_path / "other").exists()


def test_a_garbled_train_state_is_named(tmp_path, capsys):
    """train_state.json records the tokenizer the run trained with; garbled, it was read as
    absent and the export went ahead without checking the tokenizer."""
    folder = _train(tmp_path / "run")
    state = folder / "step-2" / "train_state.json"
    state.write_text("{")
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err.endswith(
        f"export_hf: error: {state} is damaged (JSONDecodeError: Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1))\n")
    assert not (tmp_path / "hf").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_without_config_toml_needs_the_flavor(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _trainer_state(_model(DEBUG))}, checkpoint_id=tmp_path / "step-1",
             no_dist=True)
    assert export_hf.main(["--checkpoint", str(tmp_path / "step-1"), "--out",
                           str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "no config.toml" in err and "pass --flavor" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_overwrite_never_replaces_the_checkpoint_being_exported(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "run" / "checkpoint" / "step-1"
    dcp.save({"model": _trainer_state(_model(DEBUG))}, checkpoint_id=step, no_dist=True)
    for out in (tmp_path / "run", step.parent, step):  # the dump folder, the checkpoints, it
        assert export_hf.main(["--checkpoint", str(step.parent), "--out", str(out),
                               "--flavor", "debug", "--overwrite"]) == 1
        assert "holds the checkpoint being exported" in capsys.readouterr().err
        assert (step / ".metadata").is_file()

# ------------------------------------------------------------- the tokenizer's framing in transformers

DOCUMENTS = ["def f(x):\n    return x", "héllo, 日本 😀"]


def _bpe_tokenizer(folder: Path) -> HFTokenizer:
    """A user's own BPE, trained as docs/data.md shows: its tokenizer.json has no post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(DOCUMENTS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return HFTokenizer(folder / "tokenizer.json")


def _project_loss(model: Llama, tokenizer, seq_len: int, tmp_path: Path) -> float:
    """The trainer's validation loss on the first window of DOCUMENTS (both held out)."""
    tmp_path.mkdir()
    corpus = tmp_path / "corpus.jsonl"
    rows = [DOCUMENTS[0], "a training document", DOCUMENTS[1]]  # val_every 2: 0 and 2 held out
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    data = Data(source=str(corpus), val_every=2, cache_dir=str(tmp_path / "cache"))
    batches = build_data(data, Training(seq_len=seq_len, local_batch_size=1), split="validation",
                         tokenizer=tokenizer, max_token_id=model.args.vocab_size)
    scored = ModelWithLoss(model, TrainingLoss(Loss(impl="unfused")))
    return evaluate(scored, batches, 1, torch.device("cpu"), shard=NoSharding())["val_loss"]


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_transformers_frames_text_and_scores_it_as_training_did(kind, tmp_path):
    """AutoTokenizer on the export puts bos first, and a pair is two documents joined as
    training joined them; the loss transformers computes on either is the project's validation
    loss on the same window. (A user's BPE without a post-processor got no bos.)"""
    tokenizer = ByteTokenizer() if kind == "byte" else _bpe_tokenizer(tmp_path / "tok")
    model = _model(DEBUG)
    out = export_hf.export(_trainer_state(model), DEBUG, tmp_path / "hf", "float32",
                           bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                           extra_files=export_hf.tokenizer_files(tokenizer, DEBUG.max_seq_len))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    framed = frame_texts(tokenizer, DOCUMENTS)[0].tolist()  # bos A eos bos B eos
    first = len(tokenizer.encode(DOCUMENTS[0])) + 1  # bos A
    assert hf_tokenizer(DOCUMENTS[0]).input_ids == framed[:first]
    assert hf_tokenizer(*DOCUMENTS).input_ids == framed[:-1]
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (tokenizer.bos_id,
                                                                      tokenizer.eos_id)

    hf_model = _load_hf(out)
    for texts, length in ((DOCUMENTS[:1], first), (DOCUMENTS, len(framed) - 1)):
        ids = hf_tokenizer(*texts, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = hf_model(input_ids=ids, labels=ids).loss.item()
        ours = _project_loss(model, tokenizer, length - 1, tmp_path / str(len(texts)))
        assert theirs == pytest.approx(ours, abs=1e-5)


def test_a_tokenizers_own_framing_and_flags_give_way_to_trainings(tmp_path):
    """A post-processor that frames "<s> $A </s>" and a tokenizer_config.json with
    add_bos_token = false (transformers 5 would rebuild the framing from it): the export frames
    as training did, keeps the ByteLevel offsets processor, and names training's bos/eos."""
    from tokenizers import processors

    tokenizer = _bpe_tokenizer(tmp_path / "tok")
    raw = tokenizer._tokenizer
    raw.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0),
                                                                            ("</s>", 1)])])
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
         "add_eos_token": True, "bos_token": "<s>", "eos_token": "</s>"}))
    files = export_hf.tokenizer_files(HFTokenizer(tmp_path / "tok" / "tokenizer.json"), 64)
    (tmp_path / "hf").mkdir()
    for name, content in files.items():
        (tmp_path / "hf" / name).write_bytes(content)
    config = json.loads(files["tokenizer_config.json"])
    assert "add_bos_token" not in config and "add_eos_token" not in config
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    processor = json.loads(files["tokenizer.json"])["post_processor"]
    assert [p["type"] for p in processor["processors"]] == ["ByteLevel", "TemplateProcessing"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = frame_texts(tokenizer, DOCUMENTS[:1])[0].tolist()
    assert hf_tokenizer(DOCUMENTS[0]).input_ids == ids[:-1]


def test_shard_size_parsing():
    assert export_hf.parse_size("5GB") == 5 * 10**9
    assert export_hf.parse_size("2GiB") == 2 * 2**30
    assert export_hf.parse_size("300kB") == 300_000
    assert export_hf.parse_size("1000") == 1000
    with pytest.raises(ValueError, match="expected e.g. 5GB"):
        export_hf.parse_size("lots")
    with pytest.raises(ValueError, match="'0': expected at least one byte"):
        export_hf.parse_size("0")  # was a shard per tensor


@pytest.mark.parametrize("option, value", [("--bos-id", "300"), ("--eos-id", "-1")])
def test_a_token_id_outside_the_vocabulary_is_refused(tmp_path, capsys, option, value):
    """config.json got it as given, and generation from the folder then failed."""
    torch.save(_debug_state(), tmp_path / "model.pt")
    assert export_hf.main(["--checkpoint", str(tmp_path / "model.pt"), "--flavor", "debug",
                           "--vocab-size", "300", "--out", str(tmp_path / "hf"),
                           option, value]) == 1
    assert capsys.readouterr().err.endswith(f"export_hf: error: {option} {value}: not a token "
                                            "id of the model (0 to 299)\n")
    _assert_nothing_written(tmp_path)


def test_an_out_below_a_file_says_so(tmp_path, capsys):
    torch.save(_debug_state(), tmp_path / "model.pt")
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "hf"
    assert export_hf.main(["--checkpoint", str(tmp_path / "model.pt"), "--flavor", "debug",
                           "--out", str(out)]) == 1
    assert capsys.readouterr().err == (f"export_hf: error: output '{out}': "
                                       f"'{tmp_path / 'a_file'}' is a file, not a folder; pick "
                                       "another --out\n")


def test_damaged_files_name_themselves(tmp_path, capsys):
    """A checkpoint weight file overwritten after the save (its checksums.json says so), a
    safetensors file whose header is garbage ("header too large"), a shard index cut short:
    each is an error naming the file, not a bare library error or silently wrong weights."""
    folder = _train(tmp_path / "run")
    distcp = folder / "step-2" / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2:len(data) // 2 + 256] = bytes(256)
    distcp.write_bytes(bytes(data))
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert f"export_hf: error: {distcp} does not match its checksum: damaged" in err, err
    assert not (tmp_path / "hf").exists()

    state = _debug_state()
    export_hf.export(state, DEBUG, tmp_path / "one", dtype="float32")
    weights = tmp_path / "one" / "model.safetensors"
    weights.write_bytes((10**12).to_bytes(8, "little") + weights.read_bytes()[8:])
    with pytest.raises(ValueError, match=rf"{weights}: damaged, not a readable safetensors file "
                                         r"\(Error while deserializing header: header too large\)"):
        hf.load_hf_weights(tmp_path / "one", DEBUG)
    export_hf.export(state, DEBUG, tmp_path / "shards", dtype="float32", max_shard_bytes=10**6)
    index = tmp_path / "shards" / hf.INDEX
    index.write_text(index.read_text()[:100])
    with pytest.raises(ValueError, match=rf"{index}: damaged, not a safetensors index"):
        hf.load_hf_weights(tmp_path / "shards", DEBUG)


def test_an_index_naming_files_outside_its_folder_is_refused(tmp_path):
    """model.safetensors.index.json naming ../ read a file outside the folder."""
    export_hf.export(_debug_state(), DEBUG, tmp_path / "hf", dtype="float32", max_shard_bytes=10**6)
    index = tmp_path / "hf" / hf.INDEX
    spec = json.loads(index.read_text())
    first = sorted(set(spec["weight_map"].values()))[0]
    (tmp_path / "hf" / first).rename(tmp_path / "outside.safetensors")
    spec["weight_map"] = {k: "../outside.safetensors" if v == first else v
                          for k, v in spec["weight_map"].items()}
    index.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=rf"{index}: names '\.\./outside\.safetensors', not a "
                                         r"file name in the folder; not reading outside it"):
        hf.load_hf_weights(tmp_path / "hf", DEBUG)
