"""Inference: the KV cache gives the training forward's results (greedy generation token for
token, prefill in pieces), sampling follows temperature / top-k / top-p, and scripts/generate.py
samples from a trainer's checkpoint and from an exported Hugging Face folder."""

import copy
import dataclasses
import importlib
import shutil
from pathlib import Path

import pytest
import torch

import train
from components.tokenizer import ByteTokenizer
from models import FLAVORS, KVCache, Llama
from models.generation import generate, generate_batch, row_generators, sample_next
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread)

ROOT = Path(__file__).resolve().parents[1]
DEBUG = FLAVORS["debug"]
VARIANTS = {"gqa": DEBUG, "mqa_tied": dataclasses.replace(DEBUG, n_kv_heads=1, tie_embeddings=True),
            "rope_scaling": dataclasses.replace(DEBUG, rope_scaling_factor=8.0,
                                                rope_original_max_pos=32)}


def load_script(name: str):
    return importlib.import_module(f"scripts.{name}")


def model_for(args, seed: int = 0, seq_len: int = 128) -> Llama:
    torch.manual_seed(seed)
    model = Llama(args, seq_len=seq_len)
    model.init_weights()
    with torch.no_grad():  # sharp attention, so that positions and cached keys matter, and
        for layer in model.layers.values():  # blocks that outweigh the embedding (tied ones)
            for name, linear in layer.named_modules():
                if isinstance(linear, torch.nn.Linear):
                    linear.weight.normal_(0.0, 0.2 if name in ("attention.wq", "attention.wk")
                                          else 0.1)
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_greedy_generation_is_full_recompute_token_for_token(variant, rng):
    model = model_for(VARIANTS[variant], seed=rng.randrange(1000))
    prompt = [rng.randrange(DEBUG.vocab_size) for _ in range(rng.randint(1, 12))]
    cached = generate(model, prompt, 40, temperature=0)
    recomputed = generate(model, prompt, 40, temperature=0, use_cache=False)
    assert len(cached) == len(recomputed) == 40
    assert len(set(cached)) > 5  # not one token repeated: the comparison says something
    assert_same_or_parted_at_a_tie(model, prompt, cached, recomputed)


def assert_same_or_parted_at_a_tie(model, prompt, a, b):
    """Two greedy generations are equal token for token, or part only where the two best logits
    tie to within fp32 rounding: paths with other shapes (cached or not, batch of 1 or more) differ
    by up to 4e-5 in the logits, and a step's two best came within 1e-4 in one run of ~150."""
    split = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if split is None:
        assert len(a) == len(b)
        return
    with torch.no_grad():
        logits = model.logits(model(torch.tensor([prompt + a[:split]]))[0, -1])
    gap = (logits[a[split]] - logits[b[split]]).abs().item()
    assert gap < 3e-4, f"token {split}: {a[split]} and {b[split]}"


def test_prefill_in_pieces_gives_the_full_forward(rng):
    """Chunks after the first attend through the offset causal mask to the cached keys. The
    pieces run other GEMM shapes and attention kernels than the full forward, so both are held
    to a float64 forward: the pieces may not be further from it than fp32 rounding puts the
    full forward (a fixed 1e-5 failed about one seed in fifty)."""
    model = model_for(DEBUG, seed=rng.randrange(1000))
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 50))
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(tokens)
        full = model(tokens)
        cache = KVCache(DEBUG, 2, 64)
        pieces = [model(tokens[:, a:b], cache) for a, b in ((0, 17), (17, 18), (18, 41), (41, 50))]
    assert cache.length == 50
    rounding = (full.double() - exact).abs().max().item()
    error = (torch.cat(pieces, dim=1).double() - exact).abs().max().item()
    assert error <= 3 * rounding, f"pieces {error:.2e} from float64, full forward {rounding:.2e}"
    with pytest.raises(ValueError, match="holds 64 positions, 65 needed"):
        model(torch.zeros(2, 15, dtype=torch.long), cache)


def test_the_training_forward_is_unchanged_by_an_empty_cache():
    """A whole sequence into an empty cache runs the training path's attention (is_causal):
    the same bits."""
    model = model_for(DEBUG)
    tokens = torch.randint(0, DEBUG.vocab_size, (3, 40))
    with torch.no_grad():
        assert torch.equal(model(tokens, KVCache(DEBUG, 3, 40)), model(tokens))


def test_sampling_follows_temperature_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    g = torch.Generator().manual_seed(0)
    draws = 10000

    def frequencies(**kwargs):
        counts = torch.zeros(len(logits))
        for _ in range(draws):
            counts[sample_next(logits, generator=g, **kwargs)] += 1
        return counts / draws

    expected = (logits / 0.7).softmax(-1)
    assert (frequencies(temperature=0.7) - expected).abs().max() < 0.02
    top3 = frequencies(temperature=1.0, top_k=3)
    assert top3[3:].sum() == 0
    torch.testing.assert_close(top3[:3], logits[:3].softmax(-1), atol=0.02, rtol=0)
    # p = 0.75: the ids of probability 0.56 and 0.21 reach it (0.56 alone does not)
    nucleus = frequencies(temperature=1.0, top_p=0.75)
    assert nucleus[2:].sum() == 0
    torch.testing.assert_close(nucleus[:2], logits[:2].softmax(-1), atol=0.02, rtol=0)
    assert sample_next(logits, temperature=0) == 0
    assert sample_next(logits, top_k=1, generator=g) == 0
    assert sample_next(logits, top_p=1e-6, generator=g) == 0
    # a tiny temperature is greedy in the limit: 1e-38 overflowed the largest logit to inf, and
    # the softmax's NaN failed torch.multinomial; rows masked to -inf stay out
    masked = torch.cat([logits * 100, torch.full((3,), float("-inf"))])
    for temperature in (1e-38, 1e-45):
        assert sample_next(masked, temperature=temperature, generator=g) == 0


def test_generation_stops_at_eos_keeps_to_the_tokenizer_and_is_seeded(rng):
    model = model_for(DEBUG)
    prompt = [256, 100, 101]
    greedy = generate(model, prompt, 10, temperature=0)
    assert generate(model, prompt, 10, temperature=0, eos_id=greedy[3]) == greedy[:3]
    sampled = [generate(model, prompt, 30, temperature=2.0, vocab_limit=100,
                        generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert sampled[0] == sampled[1] and max(sampled[0]) < 100
    with torch.no_grad():
        model.output.weight[300:] += 10.0  # padding rows that would otherwise win
    assert min(generate(model, prompt, 5, temperature=0, vocab_limit=259)) >= 0
    assert max(generate(model, prompt, 5, temperature=0, vocab_limit=259)) < 259


def test_generation_fills_every_position_the_model_has():
    """The last new token is never fed back: 20 prompt + 13 new tokens need 32 positions, all a
    seq_len 32 model has (refused before as 33), and the cache agrees with recomputation."""
    model = model_for(DEBUG, seq_len=32)
    cached = generate(model, [1] * 20, 13, temperature=0)
    assert len(cached) == 13 and cached == generate(model, [1] * 20, 13, temperature=0,
                                                    use_cache=False)


def test_generation_errors_name_the_problem():
    model = model_for(DEBUG, seq_len=32)
    with pytest.raises(ValueError, match="20 prompt \\+ 14 new tokens need 33 positions, more "
                                         "than the 32"):
        generate(model, [1] * 20, 14)
    with pytest.raises(ValueError, match="prompt token id 512 is outside"):
        generate(model, [1, 512], 1)
    with pytest.raises(ValueError, match="top_p=0"):
        generate(model, [1], 1, top_p=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        generate(model, [1], 1, temperature=-1)
    with pytest.raises(ValueError, match="temperature=inf: expected a finite number"):
        generate(model, [1], 1, temperature=float("inf"))
    with pytest.raises(ValueError, match="no tokens"):
        generate(model, [], 1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_greedy_rows_are_the_one_row_generation(variant, rng):
    """Every row of a greedy batch is the one-row generation, cached (the prompt's cache copied
    into each row) and recomputed."""
    model = model_for(VARIANTS[variant], seed=rng.randrange(1000))
    prompt = [rng.randrange(DEBUG.vocab_size) for _ in range(rng.randint(1, 12))]
    one = generate(model, prompt, 40, temperature=0)
    assert len(set(one)) > 5  # not one token repeated: the comparison says something
    rows = generate_batch(model, prompt, 40, 5, temperature=0)
    recomputed = generate_batch(model, prompt, 40, 3, temperature=0, use_cache=False)
    assert len(rows) == 5 and len(recomputed) == 3
    for row in rows + recomputed:
        assert_same_or_parted_at_a_tie(model, prompt, one, row)


def test_batched_sampling_rows_differ_are_seeded_and_stop_at_their_own_eos():
    model = model_for(DEBUG)
    prompt = [256, 100, 101]
    kwargs = dict(temperature=2.0, top_k=6, top_p=0.95, vocab_limit=8)

    def sample(count=6, first=0, **more):
        return generate_batch(model, prompt, 30, count, **kwargs, **more,
                              generators=row_generators(7, 6)[first:first + count])

    rows = sample()
    assert len({tuple(row) for row in rows}) == 6 and all(len(row) == 30 for row in rows)
    assert sample() == rows
    # a row draws from its own generator: the same samples in batches of 2 and 4 or 1 by 1
    assert sample(2) + sample(4, first=2) == rows
    assert [generate(model, prompt, 30, **kwargs, generator=row_generators(7, 6)[i])
            for i in range(6)] == rows
    assert generate_batch(model, prompt, 30, 6, **kwargs,
                          generators=row_generators(8, 6)) != rows
    # each row ends at its own first eos; the others go on as without one
    stopped = sample(eos_id=3)
    assert stopped == [row[:row.index(3)] if 3 in row else row for row in rows]
    assert len({len(row) for row in stopped}) > 2


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "recompute"])
def test_a_row_that_stops_leaves_the_batch(use_cache):
    """Each forward after the prompt's runs only the rows still going (once, every row ran to the
    end of the batch's decoding), and each row draws what it draws with no row stopping."""
    model = model_for(DEBUG)
    prompt = [256, 100, 101]
    kwargs = dict(temperature=2.0, top_k=6, top_p=0.95, vocab_limit=8, use_cache=use_cache)
    rows = generate_batch(model, prompt, 30, 6, **kwargs, generators=row_generators(7, 6))
    batches = []
    model.register_forward_hook(lambda module, args, out: batches.append(args[0].shape[0]))
    stopped = generate_batch(model, prompt, 30, 6, eos_id=3, **kwargs,
                             generators=row_generators(7, 6))
    assert stopped == [row[:row.index(3)] if 3 in row else row for row in rows]
    # forward k (after the prompt's) feeds back the k-th token of the rows that drew k or more
    going = [sum(len(row) >= k for row in stopped) for k in range(1, 30)]
    expected = [1] + going[:going.index(0) if 0 in going else None]
    assert batches == expected and len(set(expected)) > 2, (batches, expected)


def test_batched_decoding_ends_when_every_row_has_stopped():
    model = model_for(DEBUG)
    prompt = [256, 100, 101]
    greedy = generate(model, prompt, 10, temperature=0)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    assert generate_batch(model, prompt, 10, 4, temperature=0, eos_id=greedy[3]) == [greedy[:3]] * 4
    assert len(forwards) == 4  # the prompt, then the 3 tokens before eos
    assert generate_batch(model, prompt, 0, 2) == [[], []]
    with pytest.raises(ValueError, match="num_samples=0: expected >= 1"):
        generate_batch(model, prompt, 1, 0)
    with pytest.raises(ValueError, match="2 generators for 3 samples"):
        generate_batch(model, prompt, 1, 3, generators=row_generators(0, 2))


# ---------------------------------------------------------------------------------- the script

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    dump = tmp_path_factory.mktemp("run")
    assert train.main(["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
                       "--loss.impl", "unfused", "--training.seq_len", "64",
                       "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
                       "--training.local_batch_size", "2", "--validation.enable", "false",
                       "--job.print_config", "false", "--data.synthetic", "true",
                       "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2",
                       "--loss.logit_scale", "1.5", "--job.dump_folder", str(dump)]) == 0
    return dump / "checkpoint"


def test_generate_script_samples_from_a_checkpoint(checkpoint, capsys):
    generate_script = load_script("generate")
    argv = ["--checkpoint", str(checkpoint), "--prompt", "def f(", "--max-new-tokens", "25",
            "--temperature", "0"]
    assert generate_script.main(argv) == 0
    text = capsys.readouterr().out
    loaded = generate_script.checkpoints.load_model(checkpoint, torch.device("cpu"))
    assert loaded.logit_scale == 1.5
    prompt = [256, *ByteTokenizer().encode("def f(")]
    expected = generate(loaded.model, prompt, 25, temperature=0, eos_id=257, logit_scale=1.5,
                        vocab_limit=259)
    assert text == "def f(" + ByteTokenizer().decode(expected) + "\n"
    assert generate_script.main(argv + ["--no-cache"]) == 0
    assert capsys.readouterr().out == text
    # greedy samples in one batch, cached or recomputed: each the one-row generation above
    assert generate_script.main(argv + ["--num-samples", "3"]) == 0
    assert capsys.readouterr().out == "".join(f"--- sample {i}\n{text}" for i in (1, 2, 3))
    assert generate_script.main(argv + ["--num-samples", "3", "--no-cache"]) == 0
    assert capsys.readouterr().out == "".join(f"--- sample {i}\n{text}" for i in (1, 2, 3))
    sampling = argv[:4] + ["--num-samples", "5", "--top-k", "5", "--top-p", "0.9",
                           "--max-new-tokens", "8", "--seed", "3"]
    assert generate_script.main(sampling) == 0
    out, err = capsys.readouterr()
    samples = out.split("--- sample ")[1:]
    assert [s.split("\n")[0] for s in samples] == ["1", "2", "3", "4", "5"]
    assert len(set(s.split("\n", 1)[1] for s in samples)) == 5
    assert err.count(" tokens, ") == 5 and err.count("(batch of 5: ") == 1
    # sample i depends on the seed and i only, not on how the samples are batched
    assert generate_script.main(sampling + ["--batch-size", "2"]) == 0
    out_2, err = capsys.readouterr()
    assert out_2 == out and err.count("(batch of 2: ") == 2 and err.count("(batch of 1: ") == 1
    assert generate_script.main(sampling + ["--seed", "4"]) == 0
    assert capsys.readouterr().out != out


def test_generate_script_reads_an_exported_folder_and_names_bad_input(checkpoint, tmp_path,
                                                                     capsys):
    pytest.importorskip("safetensors")
    generate_script = load_script("generate")
    argv = ["--prompt", "x", "--max-new-tokens", "10", "--temperature", "0"]
    # logit_scale 1.5 cannot be exported; the same weights without it can
    state = generate_script.checkpoints.load_model_state(checkpoint)
    export_hf = load_script("export_hf")
    out = export_hf.export(state, DEBUG, tmp_path / "hf", "float32", bos_token_id=256,
                           eos_token_id=257,
                           extra_files=export_hf.tokenizer_files(ByteTokenizer(), 2048))
    assert generate_script.main(["--checkpoint", str(out), *argv]) == 0
    from_hf = capsys.readouterr().out
    loaded = generate_script.checkpoints.load_model(checkpoint, torch.device("cpu"))
    expected = generate(loaded.model, [256, 120], 10, temperature=0, eos_id=257, vocab_limit=259)
    assert from_hf == "x" + loaded.tokenizer.decode(expected) + "\n"

    assert generate_script.main(["--checkpoint", str(tmp_path / "nope"), *argv]) == 1
    assert "does not exist" in capsys.readouterr().err
    # --tokenizer naming no file: it was ignored for a byte-tokenizer run, and for a folder
    # with its own tokenizer.json the error said the folder had none
    missing = str(tmp_path / "missing.json")
    assert generate_script.main(["--checkpoint", str(out), "--tokenizer", missing, *argv]) == 1
    assert capsys.readouterr().err == f"generate: error: --tokenizer {missing}: no such file\n"
    assert generate_script.main(["--checkpoint", str(checkpoint), "--tokenizer", missing,
                                 *argv]) == 1
    assert (f"generate: error: --tokenizer {missing}: the run trained with [tokenizer] name = "
            "'byte', which reads no file" in capsys.readouterr().err)
    assert generate_script.main(["--checkpoint", str(checkpoint), "--top-p", "1.5"]) == 1
    assert "top_p=1.5" in capsys.readouterr().err
    assert generate_script.main(["--checkpoint", str(checkpoint), "--batch-size", "0"]) == 1
    assert capsys.readouterr().err == "generate: error: --batch-size 0: expected >= 1\n"


def _sentencepiece_folder(folder: Path, unknown: bool = True) -> Path:
    """A tiny transformers Llama that always predicts "▁def", with a SentencePiece-style BPE
    (Metaspace: a word's space is the "▁" its first token starts with) as its tokenizer.json;
    unknown=False: no <unk> and no byte fallback, so text outside its alphabet is dropped."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True) if unknown
                          else models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback()])
    tokenizer.train_from_iterator(["def f(x): return x", "def g(y): return y + 1"] * 10,
                                  trainers.BpeTrainer(vocab_size=60, show_progress=False,
                                                      special_tokens=["<unk>", "<s>", "</s>"]))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=259, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():  # blocks that add nothing, so every position's logits are the same
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.token_to_id("▁def")] = 1.0
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_continuation_starting_a_word_keeps_its_space(tmp_path, capsys):
    """The new ids were decoded alone, and a Metaspace decoder drops the space of the word that
    starts a decode: "def" + "▁def▁def▁def" printed "defdef def def"."""
    folder = _sentencepiece_folder(tmp_path / "hf")
    argv = ["--checkpoint", str(folder), "--prompt", "def", "--max-new-tokens", "3"]
    assert load_script("generate").main(argv + ["--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "def def def def\n" and "warning" not in err
    assert load_script("generate").main(argv + ["--temperature", "1.0", "--seed", "0"]) == 0
    assert capsys.readouterr().out == "def def def def\n"


def test_a_prompt_the_tokenizer_drops_is_shown_as_the_model_sees_it(tmp_path, capsys):
    """Text the tokenizer cannot encode vanished from the model's input, but the output began
    with the prompt as typed, as if the model had seen it."""
    folder = _sentencepiece_folder(tmp_path / "hf", unknown=False)
    generate_script = load_script("generate")
    assert generate_script.main(["--checkpoint", str(folder), "--prompt", "日本語 def",
                                 "--max-new-tokens", "2", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert ("generate: warning: the tokenizer does not give back the prompt: the model sees "
            "' def'\n") in err
    assert out == " def def def\n"


def test_a_garbled_train_state_is_named(checkpoint, tmp_path, capsys):
    """train_state.json records the tokenizer the model was trained with: read as absent when
    garbled, it let any tokenizer through without a word."""
    step = tmp_path / "step-2"
    shutil.copytree(checkpoint / "step-2", step)
    (step / "checksums.json").unlink()  # as saved before checksums; else the checksum names it
    (step / "train_state.json").write_text("{")
    assert load_script("generate").main(["--checkpoint", str(step), "--max-new-tokens", "2"]) == 1
    assert capsys.readouterr().err == (
        f"generate: error: {step / 'train_state.json'} is damaged (JSONDecodeError: Expecting "
        "property name enclosed in double quotes: line 1 column 2 (char 1))\n")


def _hf_folder_with_a_nan(folder: Path) -> Path:
    """A small Hugging Face folder (byte tokenizer) whose final norm weight holds a NaN: a
    damaged or diverged model from elsewhere (export_hf refuses to write one)."""
    pytest.importorskip("safetensors")
    from models import hf
    export_hf = load_script("export_hf")
    state = {k: v.detach().clone() for k, v in model_for(DEBUG, seq_len=64).state_dict().items()}
    state["norm.weight"][3] = float("nan")
    folder.mkdir()
    hf.save_hf_folder(hf.to_hf(state, DEBUG), hf.hf_config(DEBUG, torch.float32, 256, 257), folder)
    for name, content in export_hf.tokenizer_files(ByteTokenizer(), 2048).items():
        (folder / name).write_bytes(content)
    return folder


def _checkpoint_with_a_nan(checkpoint: Path, step: Path) -> Path:
    """The run's step-2 model with an inf in one weight, as a checkpoint saved before checksums
    (and before train_state.json recorded the tokenizer) holds it: a damaged file that no
    checksum names."""
    import torch.distributed.checkpoint as dcp
    state = load_script("generate").checkpoints.load_model_state(checkpoint / "step-2")
    state["layers.1.attention.wq.weight"][0, 0] = float("inf")
    dcp.save({"model": state}, checkpoint_id=step, no_dist=True)
    shutil.copy(checkpoint / "step-2" / "config.toml", step / "config.toml")
    return step


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("temperature", ["1", "0"])
def test_generate_from_weights_with_a_nan_is_one_line_not_a_traceback(checkpoint, tmp_path,
                                                                      capsys, temperature):
    """A model whose weights hold a NaN or an inf gives NaN logits: torch.multinomial's
    RuntimeError ("probability tensor contains either inf, nan or element < 0") came out as a
    traceback, and greedy decoding (temperature 0) printed garbage. The weights are refused
    when loaded: one line naming the tensor (as the folder names it), exit status 1."""
    generate_script = load_script("generate")
    hf_folder = _hf_folder_with_a_nan(tmp_path / "hf")
    step = _checkpoint_with_a_nan(checkpoint, tmp_path / "step-2")
    for folder, tensor in ((hf_folder, "model.norm.weight"),
                           (step, "layers.1.attention.wq.weight")):
        code = generate_script.main(["--checkpoint", str(folder), "--prompt", "x",
                                     "--max-new-tokens", "3", "--temperature", temperature])
        out, err = capsys.readouterr()
        assert code == 1 and out == ""
        assert err == (f"generate: error: {folder}: {tensor} holds non-finite values (NaN or "
                       "inf): the model's outputs would be NaN; a run that diverged, or a "
                       "damaged file\n")


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_finite_weights_that_overflow_to_inf_logits_are_named(temperature):
    """Finite float16 weights whose logits overflow (65504 is float16's largest): sampling
    failed in torch.multinomial (a device-side assert on CUDA) and greedy decoding drew
    garbage. A ValueError names the token and its position."""
    model = model_for(DEBUG, seq_len=64).to(torch.float16)
    with torch.no_grad():  # each logit about 60000 x the sum of a hidden state's values
        model.output.weight[0::2] = 60000.0
        model.output.weight[1::2] = -60000.0
    prompt = [256, 100, 101]
    assert not torch.isfinite(model.logits(model(torch.tensor([prompt]))[:, -1])).all()
    with pytest.raises(ValueError, match=r"^the logits of new token 1 \(position 3\) hold NaN or "
                                         r"inf: an overflow in torch.float16 \(float32 has more "
                                         r"range\), or a model that diverged$"):
        generate_batch(model, prompt, 5, 3, temperature=temperature, vocab_limit=259)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("temperature", ["1", "0"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "recompute"])
def test_generate_with_inf_logits_at_one_step_is_one_line(checkpoint, capsys, monkeypatch,
                                                          temperature, use_cache):
    """The model's logits hold inf (in one row) at the third new token only: generate.py said
    so with torch.multinomial's traceback ("probability tensor contains either inf, nan or
    element < 0"), and printed garbage at temperature 0. One line naming the token and its
    position, exit status 1."""
    calls = []

    def logits(self, hidden):
        calls.append(1)
        out = self.output(hidden)
        last_row = torch.tensor([out.shape[0] - 1], device=out.device)  # cuda under the GPU suite
        return out.index_fill(0, last_row, float("inf")) if len(calls) == 3 else out

    monkeypatch.setattr(Llama, "logits", logits)
    # float32 on CUDA too (its "auto" is bfloat16 there), so the line names one dtype
    argv = ["--checkpoint", str(checkpoint), "--prompt", "ab", "--max-new-tokens", "6",
            "--temperature", temperature, "--num-samples", "2", "--seed", "1",
            "--dtype", "float32"]
    code = load_script("generate").main(argv + ([] if use_cache else ["--no-cache"]))
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and len(calls) == 3, err
    assert err.splitlines()[-1] == (
        "generate: error: the logits of new token 3 (position 5) hold NaN or inf: an overflow "
        "in torch.float32 (float32 has more range), or a model that diverged")


def test_the_logits_check_reads_nothing_more_to_the_host():
    """The check rides on the tokens read each step (for eos): one read per step, as before,
    not a sync of its own per token; inf logits at the third step only name that token."""
    model = model_for(DEBUG, seq_len=64)
    prompt = [256, 100, 101]
    reads, tolist = [], torch.Tensor.tolist
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
        assert len(generate_batch(model, prompt, 5, 3, temperature=1.0)[0]) == 5
    assert len(reads) == 5
    steps, logits = [], model.logits
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "logits", lambda hidden: steps.append(1) or (
            logits(hidden) + (float("inf") if len(steps) == 3 else 0.0)))
        with pytest.raises(ValueError, match=r"^the logits of new token 3 \(position 5\) hold "):
            generate_batch(model, prompt, 5, 3, temperature=1.0)
