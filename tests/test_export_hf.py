"""scripts/export_hf.py: the exported folder loads in transformers and gives the same logits.

Each case builds a Llama, exports its state dict as the trainer stores it (`model.` prefix), loads
the folder with LlamaForCausalLM.from_pretrained and compares logits on random tokens in fp32.
The q/k weights are re-drawn larger than at init so that attention is sharp and RoPE (hence the
q/k permutation and the rope scaling) visibly changes the logits; two negative controls check
that the comparison would catch a missing permutation or missing rope scaling. A trainer's
checkpoint exports with nothing but its path: the model, the vocab size and the tokenizer come
from its config.toml, and the folder holds the tokenizer and the bos/eos ids. What it refuses
is in test_export_hf_refusals.py; the tokenizer (its framing, its copy, a replaced file
refused) in test_export_hf_tokenizer.py.
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
from components.tokenizer import ByteTokenizer  # noqa: E402
from models import FLAVORS, Llama, LlamaArgs  # noqa: E402
from models import hf  # noqa: E402
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


def sharp_model(args: LlamaArgs, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(args, seq_len=SEQ_LEN)
    model.init_weights()
    with torch.no_grad():  # sharp attention, so that a wrong RoPE layout shows in the logits
        for layer in model.layers.values():
            layer.attention.wq.weight.normal_(0.0, 0.3)
            layer.attention.wk.weight.normal_(0.0, 0.3)
    return model.eval()


def trainer_state(model: Llama) -> dict[str, torch.Tensor]:
    """As ModelWithLoss(model, loss).state_dict() names them."""
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def load_hf(folder: Path):
    # transformers 5 renamed from_pretrained's torch_dtype to dtype (the old name still warns).
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        folder, output_loading_info=True, **{key: torch.float32})
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return hf.eval()


def _max_logit_diff(model: Llama, folder: Path, seed: int = 1) -> float:
    hf = load_hf(folder)
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
    model = sharp_model(args)
    ckpt = tmp_path / "state.pt"
    torch.save(trainer_state(model), ckpt)
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
    model = sharp_model(DEBUG)
    monkeypatch.setattr(hf, "permute_to_hf", lambda w, n_heads: w)
    out = export_hf.export(trainer_state(model), DEBUG, tmp_path / "hf", torch.float32)
    assert _max_logit_diff(model, out) > 1e-2


def test_comparison_catches_missing_rope_scaling(tmp_path):
    args = VARIANTS["rope_scaling"]
    model = sharp_model(args)
    unscaled = dataclasses.replace(args, rope_scaling_factor=None)
    out = export_hf.export(trainer_state(model), unscaled, tmp_path / "hf", torch.float32)
    assert _max_logit_diff(model, out) > 1e-2


def test_bfloat16_export_is_the_rounded_weights(tmp_path):
    model = sharp_model(DEBUG)
    out = export_hf.export(trainer_state(model), DEBUG, tmp_path / "hf")  # default: bfloat16
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
        models[step] = sharp_model(args, seed=seed)
        state = trainer_state(models[step])
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

    model = sharp_model(DEBUG)
    state = trainer_state(model)
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

    dcp.save({"model": trainer_state(sharp_model(DEBUG))}, checkpoint_id=tmp_path / "step-2",
             no_dist=True)
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "__0_0.distcp").write_bytes(b"cut short")  # no .metadata
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint folder .*step-5"):
        assert reader.resolve(tmp_path) == tmp_path / "step-2"


def test_torch_save_of_a_full_trainer_state(tmp_path):
    model = sharp_model(DEBUG)
    ckpt = tmp_path / "full.pt"
    torch.save({"model": trainer_state(model), "optimizer": {"state": {}}, "step": 7}, ckpt)
    state = reader.load_model_state(ckpt)
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key


def test_shard_size_parsing():
    assert export_hf.parse_size("5GB") == 5 * 10**9
    assert export_hf.parse_size("2GiB") == 2 * 2**30
    assert export_hf.parse_size("300kB") == 300_000
    assert export_hf.parse_size("1000") == 1000
    with pytest.raises(ValueError, match="expected e.g. 5GB"):
        export_hf.parse_size("lots")
    with pytest.raises(ValueError, match="'0': expected at least one byte"):
        export_hf.parse_size("0")  # was a shard per tensor


# ------------------------------------------------------------------------ a trainer's checkpoint

RUN = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
       "--loss.impl", "unfused", "--training.seq_len", "64", "--training.steps", "2",
       "--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "2",
       "--validation.enable", "false", "--job.print_config", "false", "--data.synthetic", "true",
       "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2"]


def train_checkpoints(dump: Path, *overrides) -> Path:
    assert train.main(RUN + ["--job.dump_folder", str(dump), *overrides]) == 0
    return dump / "checkpoint"


def test_a_trainers_checkpoint_exports_from_its_path_alone(tmp_path):
    """No --flavor, --vocab-size or ids: the run's config.toml says them. The folder holds the
    byte tokenizer as a tokenizer.json that transformers loads and that encodes like it."""
    folder = train_checkpoints(tmp_path / "run", "--model.vocab_size", "300")
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


def test_flavor_keeps_the_runs_model_settings(tmp_path, capsys):
    """--flavor built the bare flavor though config.toml was there: a run's [model] max_seq_len
    and rope_scaling_factor were dropped, and the folder gave other logits without a word."""
    folder = train_checkpoints(tmp_path / "run", "--model.max_seq_len", "4096",
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
