"""models/hf.py and `[checkpoint] initial_load_path` naming a Hugging Face folder.

A small random transformers LlamaForCausalLM (made here with LlamaConfig and save_pretrained,
nothing downloaded) loads into this Llama and gives transformers' logits, with grouped-query
attention, Llama-3 RoPE scaling, tied embeddings, sharded safetensors and bf16 files; export ->
import is the identity; the trainer started from such a folder (one process, FSDP=2, TP=2 on
gloo) computes transformers' loss on its first batch. The q/k weights are drawn larger than
transformers' init so that attention is sharp and a wrong RoPE layout shows in the logits.
"""

import copy as copy_module
import dataclasses
import shutil
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import forked_ranks  # noqa: E402 (the ranks of a launch forked: tests/forked_ranks.py)
import train  # noqa: E402
from components.config.schema import Data, Training  # noqa: E402
from components.data.build import build_data  # noqa: E402
from components.tokenizer import ByteTokenizer  # noqa: E402
from models import FLAVORS, Llama, LlamaArgs  # noqa: E402
from models import hf  # noqa: E402
from torch_threads import one_torch_thread  # noqa: E402, F401 (autouse: one torch thread)

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 64
VOCAB = 300  # above the byte tokenizer's 259, below the debug flavor's 512


def hf_model(tie: bool = False, rope_scaling: bool = False, seed: int = 0, **overrides):
    """A random LlamaForCausalLM shaped like the debug flavor (unless overridden)."""
    torch.manual_seed(seed)
    debug = FLAVORS["debug"]
    kwargs = dict(hidden_size=debug.dim, intermediate_size=debug.ffn_dim,
                  num_hidden_layers=debug.n_layers, num_attention_heads=debug.n_heads,
                  num_key_value_heads=debug.n_kv_heads, vocab_size=VOCAB,
                  rope_theta=debug.rope_theta, rms_norm_eps=debug.norm_eps,
                  max_position_embeddings=debug.max_seq_len, tie_word_embeddings=tie)
    if rope_scaling:  # original_max_position_embeddings 64 puts the pairs in all three bands
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    kwargs.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0.0, 0.3)
            layer.self_attn.k_proj.weight.normal_(0.0, 0.3)
            layer.input_layernorm.weight.uniform_(0.5, 1.5)  # not all ones: a swap would show
        model.model.norm.weight.uniform_(0.5, 1.5)
        model.get_output_embeddings().weight.normal_(0.0, 0.1)  # logits of a real scale
    return model.eval()


def save(model, folder: Path, dtype=torch.float32, shard: str | None = None) -> Path:
    copy = copy_module.deepcopy(model).to(dtype)  # (to() would also round RoPE's inv_freq)
    copy.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def load_float32(folder: Path):
    """transformers' model of a folder, in float32."""
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return transformers.LlamaForCausalLM.from_pretrained(folder, **{key: torch.float32}).eval()


def our_model(folder: Path, args: LlamaArgs | None = None) -> Llama:
    args = args or hf.args_from_hf_config(hf.read_config(folder))
    model = Llama(args, seq_len=SEQ_LEN)
    model.load_state_dict(hf.load_hf_weights(folder, args))
    return model.eval()


def tokens(vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


# transformers tabulates RoPE from float32 frequencies (this Llama: float64 angles), which with
# sharp attention moves logits of size ~5 by up to ~1.3e-4, in float64 too; a wrong layout or
# rope scaling moves them by more than 1e-1.
LOGIT_TOL = 5e-4


def max_logit_diff(ours: Llama, theirs) -> float:
    x = tokens()
    with torch.no_grad():
        a = ours.logits(ours(x))[..., :VOCAB]
        b = theirs(input_ids=x).logits
    assert a.abs().max() > 1.0  # logits of a meaningful scale
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------- layouts

def test_permutations_are_inverse_and_match_the_convert_script():
    n_heads, head_dim, dim = 2, 8, 3
    w = torch.arange(n_heads * head_dim, dtype=torch.float32)[:, None].expand(-1, dim)
    # row 2i of each head (the first of RoPE pair i) goes to row i, row 2i+1 to head_dim/2 + i
    assert hf.permute_to_hf(w, n_heads)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7,
                                                          8, 10, 12, 14, 9, 11, 13, 15]
    x = torch.randn(4 * 16, 5)
    assert torch.equal(hf.permute_from_hf(hf.permute_to_hf(x, 4), 4), x)
    assert torch.equal(hf.permute_to_hf(hf.permute_from_hf(x, 4), 4), x)


@pytest.mark.parametrize("variant", ["gqa", "rope_scaling_sharded", "tied", "bf16_files", "mha"])
def test_transformers_llama_loads_and_gives_its_logits(variant, tmp_path):
    theirs = hf_model(tie=variant == "tied", rope_scaling=variant.startswith("rope"),
                      **({"num_key_value_heads": 4} if variant == "mha" else {}))
    dtype = torch.bfloat16 if variant == "bf16_files" else torch.float32
    folder = save(theirs, tmp_path / "hf", dtype, shard="200KB" if "sharded" in variant else None)
    if "sharded" in variant:
        assert (folder / hf.INDEX).is_file() and not (folder / hf.SINGLE_FILE).exists()
    if variant == "bf16_files":  # the model those files hold
        theirs = load_float32(folder)
        assert torch.equal(theirs.lm_head.weight, theirs.lm_head.weight.bfloat16().float())
    ours = our_model(folder)
    assert ours.args.tie_embeddings == (variant == "tied")
    assert max_logit_diff(ours, theirs) < LOGIT_TOL


def test_a_wrong_rope_layout_would_be_caught(tmp_path, monkeypatch):
    theirs = hf_model()
    folder = save(theirs, tmp_path / "hf")
    monkeypatch.setattr(hf, "permute_from_hf", lambda w, n_heads: w)
    assert max_logit_diff(our_model(folder), theirs) > 1e-1


def test_export_then_import_is_the_identity(tmp_path):
    """Our model -> export_hf's folder (float32, sharded) -> our model: the same tensors, hence
    the same logits bit for bit."""
    from scripts import export_hf

    args = dataclasses.replace(FLAVORS["debug"], rope_scaling_factor=8.0,
                               rope_original_max_pos=64)
    torch.manual_seed(0)
    model = Llama(args, seq_len=SEQ_LEN)
    model.init_weights()
    model.eval()
    out = export_hf.export(model.state_dict(), args, tmp_path / "hf", "float32",
                           max_shard_bytes=300_000)
    assert (out / hf.INDEX).is_file()
    back = our_model(out)
    assert back.args == args
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    x = tokens(args.vocab_size)
    with torch.no_grad():
        assert torch.equal(back.logits(back(x)), model.logits(model(x)))


@pytest.mark.parametrize("tied", [False, True])
def test_hf_name_is_to_hfs_renaming(tied):
    """hf.hf_name names one of this Llama's tensors as the folder does (errors about a weight
    of a Hugging Face folder name it so)."""
    args = dataclasses.replace(FLAVORS["debug"], tie_embeddings=tied)
    with torch.device("meta"):
        state = Llama(args, seq_len=8).state_dict()
    renamed = hf.to_hf(state, args)
    assert sorted(hf.hf_name(k) for k in state if not (tied and k == "output.weight")) == \
        sorted(renamed)
    assert all(renamed[hf.hf_name(k)] is state[k] for k in state
               if "wq" not in k and "wk" not in k and not (tied and k == "output.weight"))


def test_a_larger_vocabulary_pads_with_the_mean_row(tmp_path):
    theirs = hf_model()
    folder = save(theirs, tmp_path / "hf")
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=VOCAB + 20)
    state = hf.load_hf_weights(folder, args)
    for key, source in (("tok_embeddings.weight", theirs.model.embed_tokens.weight),
                        ("output.weight", theirs.lm_head.weight)):
        assert state[key].shape == (VOCAB + 20, args.dim)
        assert torch.equal(state[key][:VOCAB], source)
        torch.testing.assert_close(state[key][VOCAB:], source.mean(0).expand(20, -1))
    assert max_logit_diff(our_model(folder, args), theirs) < LOGIT_TOL


def test_tied_folder_into_an_untied_model_copies_the_embedding(tmp_path):
    theirs = hf_model(tie=True)
    folder = save(theirs, tmp_path / "hf")
    state = hf.load_hf_weights(folder, dataclasses.replace(FLAVORS["debug"], vocab_size=VOCAB))
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])


@pytest.mark.parametrize("change, match", [
    (dict(vocab_size=200), r"vocab_size 200 vs 300 \(set \[model\] vocab_size = 300\)"),
    (dict(n_layers=3), r"n_layers 3 vs 4"),
    (dict(rope_theta=500000.0), r"rope_theta 500000.0 vs 10000.0"),
    (dict(rope_scaling_factor=8.0), r"rope_scaling_factor 8.0 vs None"),
    (dict(tie_embeddings=True), r"tie_embeddings true vs false"),
])
def test_a_folder_of_another_model_is_named(change, match, tmp_path):
    folder = save(hf_model(), tmp_path / "hf")
    args = dataclasses.replace(FLAVORS["debug"], **{"vocab_size": VOCAB, **change})
    with pytest.raises(ValueError, match=match):
        hf.load_hf_weights(folder, args)


def test_unsupported_configs_and_broken_folders_are_named(tmp_path):
    folder = save(hf_model(), tmp_path / "hf")
    config = hf.read_config(folder)
    for change, match in ((dict(mlp_bias=True), "mlp_bias = True"),
                          (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
                          (dict(model_type="mistral"), "model_type 'mistral'"),
                          (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
                           "rope type 'yarn'")):
        with pytest.raises(ValueError, match=match):
            hf.args_from_hf_config({**config, **change})
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=VOCAB)
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / hf.SINGLE_FILE)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)
    save_file(tensors, folder / hf.SINGLE_FILE)
    with pytest.raises(ValueError, match=r"missing 1 tensors \(model\.layers\.2\.mlp\.up_proj"
                                         r"\.weight\); unexpected tensors \(model\.layers\.0\."
                                         r"self_attn\.q_proj\.bias\)"):
        hf.load_hf_weights(folder, args)
    (folder / hf.SINGLE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        hf.load_hf_weights(folder, args)


def test_a_malformed_config_json_names_the_file_and_the_key(tmp_path):
    """A config.json that is not an object, a head count of 0 and a rope factor that is not a
    number gave AttributeError, ZeroDivisionError and "could not convert string to float: 'x'";
    the trainer (initial_load_path) stopped on the first with a traceback too."""
    folder = save(hf_model(), tmp_path / "hf")
    path, config = folder / hf.CONFIG, hf.read_config(folder)
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=VOCAB)
    scaling = {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    for change, match in (
            (dict(num_attention_heads=0), "num_attention_heads = 0, expected a positive integer"),
            (dict(vocab_size="300"), "vocab_size = '300', expected a positive integer"),
            (dict(rope_scaling=scaling), "rope_scaling.factor = 'x', expected a number"),
            (dict(rms_norm_eps=None), "rms_norm_eps = None, expected a number")):
        path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=re.escape(f"{path}: {match}")):
            hf.load_hf_weights(folder, args)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=re.escape(f"{path}: holds a JSON list, expected an "
                                                   "object of settings")):
        hf.load_hf_weights(folder, args)
    with pytest.raises(ValueError, match=re.escape(f"{path}: holds a JSON list")):
        train.main(TRAIN + ["--checkpoint.initial_load_path", str(folder), "--job.dump_folder",
                            str(tmp_path / "run")])


def test_a_tied_folder_with_its_own_differing_lm_head_is_refused(tmp_path):
    """transformers 4 ties such a folder (the embedding wins), transformers 5 unties it (the head
    wins); this Llama took the embedding without a word, 5.4 off transformers 5's logits."""
    from safetensors.torch import load_file, save_file
    folder = save(hf_model(tie=True), tmp_path / "hf")
    args = hf.args_from_hf_config(hf.read_config(folder))
    tensors = load_file(folder / hf.SINGLE_FILE)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / hf.SINGLE_FILE)
    hf.load_hf_weights(folder, args)  # an equal copy is what tying means: loaded
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.01
    save_file(tensors, folder / hf.SINGLE_FILE)
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight "
                       r"though config\.json ties them"):
        hf.load_hf_weights(folder, args)


def test_a_single_file_beside_a_stale_index_is_read_as_transformers_reads_it(tmp_path):
    """model.safetensors and an index with its shards: transformers reads the single file; this
    Llama read the index's shards, other weights without a word."""
    model = hf_model()
    folder = save(model, tmp_path / "hf", shard="200KB")
    assert (folder / hf.INDEX).is_file()
    save(hf_model(seed=5), tmp_path / "single")
    (folder / hf.SINGLE_FILE).write_bytes((tmp_path / "single" / hf.SINGLE_FILE).read_bytes())
    assert max_logit_diff(our_model(folder), load_float32(folder)) < LOGIT_TOL
    assert max_logit_diff(our_model(folder), model) > 1e-2  # not the shards' weights


# ---------------------------------------------------------------------------------- the trainer

TRAIN = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
         "--loss.impl", "unfused", "--training.seq_len", str(SEQ_LEN), "--training.steps", "2",
         "--lr_scheduler.warmup_steps", "1",
         "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--job.print_config",
         "false", "--validation.enable", "false", "--data.synthetic", "true",
         "--model.vocab_size", str(VOCAB)]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    theirs = hf_model(seed=3)
    folder = save(theirs, tmp_path_factory.mktemp("hf") / "model", shard="400KB")
    # the trainer's first global batch: synthetic windows 0..3
    inputs, labels = next(build_data(Data(synthetic=True),
                                     Training(seq_len=SEQ_LEN, local_batch_size=4, seed=0),
                                     split="train", tokenizer=ByteTokenizer(), max_token_id=VOCAB))
    with torch.no_grad():
        logits = theirs(input_ids=inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()).item()
    return folder, loss


def first_loss(dump: Path) -> float:
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    return rows[0]["loss"]


@pytest.mark.parametrize("layout", ["one_process", "fsdp2", "tp2"])
def test_trainer_starts_from_a_hf_folder_in_any_layout(layout, hf_folder, tmp_path):
    """The first step's loss, computed by the (sharded) trainer from the loaded weights, is
    transformers' loss on the same batch: every shard got its slice of the right tensor."""
    folder, expected = hf_folder
    dump = tmp_path / "run"
    argv = TRAIN + ["--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(dump)]
    if layout == "one_process":
        assert train.main(argv) == 0
    else:
        tp = "2" if layout == "tp2" else "1"
        batch = "4" if layout == "tp2" else "2"  # the same global batch of 4 windows
        forked_ranks.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(ROOT / "train.py"), *argv,
                          "--parallelism.tensor_parallel_degree", tp,
                          "--training.local_batch_size", batch],
                         check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         timeout=300, stdout=subprocess.DEVNULL)
    assert abs(first_loss(dump) - expected) < 1e-5


def test_trainer_names_a_folder_of_another_model(hf_folder, tmp_path):
    folder, _ = hf_folder
    argv = TRAIN + ["--checkpoint.initial_load_path", str(folder), "--job.dump_folder",
                    str(tmp_path / "run"), "--model.vocab_size", "260"]
    with pytest.raises(ValueError, match=r"initial_load_path = .*vocab_size 260 vs 300"):
        train.main(argv)
    (tmp_path / "neither").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a DCP checkpoint folder"):
        train.main(TRAIN + ["--checkpoint.initial_load_path", str(tmp_path / "neither"),
                            "--job.dump_folder", str(tmp_path / "run2")])


def test_every_rank_stops_with_rank_0s_error(hf_folder, tmp_path):
    """Only rank 0 reads the folder: the others must hear of its failure, not wait forever in
    the broadcast."""
    folder, _ = hf_folder
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", str(ROOT / "train.py"), *TRAIN,
                             "--checkpoint.initial_load_path", str(folder), "--job.dump_folder",
                             str(tmp_path / "run"), "--model.vocab_size", "260",
                             "--training.local_batch_size", "2"],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
                            capture_output=True, text=True)
    assert result.returncode != 0
    # one line (local rank 0 prints it), and every rank exits with the config error's status 2
    assert result.stderr.count("config error: [checkpoint] initial_load_path = ") == 1
    for rank in (0, 1):
        assert re.search(rf"rank\s+: {rank} \(local_rank: {rank}\)\n\s+exitcode\s+: 2 ",
                         result.stderr), result.stderr


def test_continued_pretraining_from_an_export_takes_its_tokenizer_and_vocab(tmp_path, capsys):
    """An export of a run with its own BPE and [model] vocab_size 600 (above the debug
    flavor's 512) continues with nothing but initial_load_path, on shards of that tokenizer:
    the tokenizer (same fingerprint, so the shards are accepted) and the vocab size come from
    the folder, the log says so, config.toml records them, and the first loss is the folder's
    model's on the first batch. (It was a vocab mismatch, and shards of another tokenizer.)"""
    import random as random_module

    from components.config.parse import load_config
    from components.tokenizer import HFTokenizer
    from scripts import export_hf, prepare_data
    from shard_cases import random_texts, train_tokenizer, write_jsonl

    rng = random_module.Random(0)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", rng)
    write_jsonl(tmp_path / "corpus.jsonl", random_texts(rng, 40))
    shards = tmp_path / "shards"
    assert prepare_data.main(["--source", str(tmp_path / "corpus.jsonl"), "--tokenizer",
                              str(tmp_path / "tokenizer.json"), "--out", str(shards),
                              "--workers", "1", "--no-progress"]) == 0
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=600)
    torch.manual_seed(0)
    trained = Llama(args, seq_len=SEQ_LEN)
    trained.init_weights()
    folder = export_hf.export({f"model.{k}": v for k, v in trained.state_dict().items()}, args,
                              tmp_path / "hf", "float32", bos_token_id=tokenizer.bos_id,
                              eos_token_id=tokenizer.eos_id,
                              extra_files=export_hf.tokenizer_files(tokenizer, args.max_seq_len))
    (folder / "tokenizer_config.json").unlink()  # the bos/eos come from config.json's ids

    dump = tmp_path / "continued"
    argv = [a for a in TRAIN if a not in ("--model.vocab_size", str(VOCAB))]
    argv = [a for a in argv if a not in ("--data.synthetic", "true")]
    capsys.readouterr()
    assert train.main(argv + ["--data.source", str(shards), "--checkpoint.initial_load_path",
                              str(folder), "--job.dump_folder", str(dump)]) == 0
    out = capsys.readouterr().out
    assert (f'from [checkpoint] initial_load_path {folder} (the run does not set them): '
            f'[tokenizer] name = "hf", path = "{folder}", bos_token = \'<|begin_of_text|>\', '
            f"eos_token = '<|end_of_text|>'; [model] vocab_size = 600\n") in out
    assert (f"checkpoint: the weights come from [checkpoint] initial_load_path {folder} "
            "(a Hugging Face folder)") in out
    saved = load_config(["--config", str(dump / "config.toml")])
    assert (saved.tokenizer.name, saved.tokenizer.path, saved.model.vocab_size) == (
        "hf", str(folder), 600)
    assert HFTokenizer(folder, "<|begin_of_text|>", "<|end_of_text|>").fingerprint() == \
        tokenizer.fingerprint()

    inputs, labels = next(build_data(Data(source=str(shards)),
                                     Training(seq_len=SEQ_LEN, local_batch_size=4, seed=0),
                                     split="train", tokenizer=tokenizer, max_token_id=600))
    with torch.no_grad():
        logits = trained.logits(trained(inputs))
    expected = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()).item()
    assert abs(first_loss(dump) - expected) < 1e-5
    assert "warning: [tokenizer] is not the tokenizer" not in out

    # [tokenizer] set to another than the folder's (another BPE, or the folder's own file with
    # bos and eos swapped): trained on without a word; a DCP checkpoint warned
    train_tokenizer(tmp_path / "other.json", rng, vocab_size=350)
    for other in (["--tokenizer.name", "hf", "--tokenizer.path", str(tmp_path / "other.json")],
                  ["--tokenizer.name", "hf", "--tokenizer.path", str(folder),
                   "--tokenizer.bos_token", "<|end_of_text|>",
                   "--tokenizer.eos_token", "<|begin_of_text|>"]):
        assert train.main(argv + ["--checkpoint.initial_load_path", str(folder),
                                  "--model.vocab_size", "600", "--training.steps", "1",
                                  "--job.dump_folder", str(tmp_path / "other"), *other]) == 0
        shutil.rmtree(tmp_path / "other")
        assert (f"warning: [tokenizer] is not the tokenizer of [checkpoint] initial_load_path "
                f"{folder} (its tokenizer.json: {tokenizer.vocab_size} ids, bos "
                f"{tokenizer.bos_id}, eos {tokenizer.eos_id}): the model's embeddings are read as "
                "this tokenizer's ids") in capsys.readouterr().out
