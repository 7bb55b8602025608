"""Token shards in the trainer: windows of seq_len + 1 in a seeded order that visits each window
once per epoch; the same global batches for any data-parallel layout; exact resume from the state
(in the loader and through train.py's checkpoints); weighted mixtures; a held-out validation split
disjoint from train; clear errors for folders that cannot be read."""

import io
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import forked_ranks
import train
from components.config.schema import Data, MixtureSource, Training
from components.data.build import build_data
from components.data.shard_batches import MIXTURE_BLOCK, Mixture, ShardBatches, _keys, permute
from components.data.shards import ShardFormatError, TokenShards, read_index
from components.checkpoint import Checkpointer
from components.tokenizer import ByteTokenizer
from parallelisms.mesh import ParallelDims
from shard_cases import random_texts, shard_documents, train_tokenizer, write_jsonl, write_token_shards

from scripts import prepare_data

ROOT = Path(__file__).resolve().parents[1]
BYTE = ByteTokenizer()


def stream_shards(folder: Path, rng: np.random.Generator, sizes: list[int], vocab: int = BYTE.vocab_size,
                  validation: list[int] = ()) -> tuple[Path, np.ndarray]:
    """A folder whose train stream is random tokens in shards of the given sizes; returns it and
    the whole stream."""
    pieces = [rng.integers(0, vocab, size) for size in sizes]
    write_token_shards(folder, pieces, vocab, BYTE, [rng.integers(0, vocab, n) for n in validation])
    return folder, np.concatenate(pieces)


def batches(folders, seq_len, batch, seed=0, rank=0, world=1, weights=None) -> ShardBatches:
    sources = [TokenShards(f) for f in folders]
    return ShardBatches(sources, weights or [1.0] * len(sources), seq_len, batch, seed, rank, world)


def windows_of(inputs: torch.Tensor, labels: torch.Tensor) -> list[tuple]:
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    return [tuple(row) for row in torch.cat([inputs, labels[:, -1:]], dim=1).tolist()]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64, 1000, 4097])
def test_permutation_is_a_bijection(size, rng):
    keys = _keys(rng.randrange(2**31), 0, 0)
    assert sorted(permute(np.arange(size), size, keys).tolist()) == list(range(size))
    big = 10**12 + 39
    sample = rng.sample(range(big), 1000)
    out = permute(np.array(sample), big, keys)
    assert len(set(out.tolist())) == 1000 and out.min() >= 0 and out.max() < big


def test_windows_visit_every_stride_once_per_epoch_in_a_new_order(tmp_path, rng):
    generator = np.random.default_rng(rng.randrange(2**31))
    seq_len, batch = rng.randint(3, 9), rng.randint(1, 4)
    folder, stream = stream_shards(tmp_path / "s", generator, [rng.randint(1, 40) for _ in range(5)] + [30])
    per_epoch = (stream.size - 1) // seq_len
    expected = sorted(tuple(stream[k * seq_len:k * seq_len + seq_len + 1]) for k in range(per_epoch))
    source = batches([folder], seq_len, batch, seed=rng.randrange(2**31))
    read = [w for _ in range(-(-3 * per_epoch // batch)) for w in windows_of(*next(source))]
    epochs = [read[e * per_epoch:(e + 1) * per_epoch] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == expected, "each window once per epoch, shard boundaries crossed"
    if per_epoch > 3:
        assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0]), "shuffled anew each epoch"
    other = batches([folder], seq_len, batch, seed=1 + source.seed)
    assert [w for _ in range(3) for w in windows_of(*next(other))] != read[:3 * batch] or per_epoch < 4


def test_global_batches_do_not_depend_on_the_data_parallel_layout(tmp_path, rng):
    """1 rank of batch 4 = 2 ranks of batch 2 = 4 ranks of batch 1, step by step (as for synthetic
    data), for one source and for a mixture; the windows of a step are disjoint across ranks."""
    generator = np.random.default_rng(rng.randrange(2**31))
    folders = [stream_shards(tmp_path / n, generator, [rng.randint(50, 300), 80])[0] for n in "abc"]
    seed = rng.randrange(2**31)
    for sources, weights in (([folders[0]], None), (folders, [0.5, 0.3, 0.2])):
        layouts = {world: [batches(sources, 8, 4 // world, seed, r, world, weights) for r in range(world)]
                   for world in (1, 2, 4)}
        first_epoch = min(layouts[1][0].windows_per_epoch) // 4  # steps before any source repeats
        read = []
        for step in range(20):
            steps = {world: [w for ranks in [next(b) for b in group] for w in windows_of(*ranks)]
                     for world, group in layouts.items()}
            assert steps[1] == steps[2] == steps[4]
            read += steps[4] if step < first_epoch else []
        assert len(set(read)) == len(read), "no window twice within an epoch, on any rank"


@pytest.mark.parametrize("mixed", [False, True], ids=["one source", "mixture"])
def test_resume_continues_exactly_from_any_rank_and_layout(tmp_path, rng, mixed):
    generator = np.random.default_rng(rng.randrange(2**31))
    folders = [stream_shards(tmp_path / n, generator, [rng.randint(20, 60) for _ in range(3)])[0]
               for n in ("a", "b")[:1 + mixed]]
    weights = [0.8, 0.2][:len(folders)]
    seq_len = 5  # a few windows per epoch: the run crosses epochs
    make = lambda batch, rank=0, world=1: batches(folders, seq_len, batch, 7, rank, world, weights)  # noqa: E731
    reference = [make(2, r, 2) for r in (0, 1)]
    states, steps = [], []
    for _ in range(30):
        buffer = io.BytesIO()  # the checkpoint's rank files: plain data through torch.save / load
        torch.save(reference[1].state_dict(), buffer)
        states.append(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        steps.append([w for b in reference for w in windows_of(*next(b))])
    assert states[-1]["global_windows"] > 2 * max(reference[0].windows_per_epoch)
    for k in rng.sample(range(len(states) - 3), 5):
        resumed = make(2, 0, 2)
        resumed.load_state_dict(states[k])  # rank 1's state resumes rank 0: the state is global
        one = make(4)  # and one rank of the same global batch
        one.load_state_dict(json.loads(json.dumps(states[k])))
        for n in range(k, k + 3):
            assert windows_of(*next(resumed)) == steps[n][:2]
            assert windows_of(*next(one)) == steps[n]
    positioned = make(2, 1, 2)
    positioned.resume_at_batch(4)  # a rank without a state of its own (the world grew)
    assert windows_of(*next(positioned)) == steps[4][2:]


def test_mixture_meets_its_weights_and_each_source_keeps_its_epochs(tmp_path, rng):
    generator = np.random.default_rng(rng.randrange(2**31))
    sizes = [400, 1500, 90]
    folders = [stream_shards(tmp_path / str(i), generator, [n])[0] for i, n in enumerate(sizes)]
    weights = [0.6, 0.3, 0.1]
    mixture = Mixture(weights, seed=3)
    assert mixture.quotas.sum() == MIXTURE_BLOCK
    assert np.allclose(mixture.realized_weights, weights, atol=1 / MIXTURE_BLOCK)
    source, number = mixture.locate(np.arange(2 * MIXTURE_BLOCK + 100))
    for s in range(3):
        assert (source[:MIXTURE_BLOCK] == s).sum() == mixture.quotas[s], "exact in every block"
        assert sorted(number[source == s].tolist()) == list(range((source == s).sum()))
    assert not (source[:64] == source[0]).all(), "sources interleave"

    seq_len = 9
    loader = batches(folders, seq_len, 8, seed=3, weights=weights)
    tokens = {i: {tuple(TokenShards(f)._arrays[0][k:k + seq_len + 1]) for k in range(0, n - seq_len, seq_len)}
              for i, (f, n) in enumerate(zip(folders, sizes))}
    seen = Counter()
    for _ in range(200):
        for window in windows_of(*next(loader)):
            owners = [i for i, ws in tokens.items() if window in ws]
            assert len(owners) == 1
            seen[owners[0]] += 1
    total = sum(seen.values())
    assert all(abs(seen[i] / total - w) < 0.05 for i, w in enumerate(weights)), seen
    assert seen[2] > 2 * loader.windows_per_epoch[2], "the small source went round several epochs"
    with pytest.raises(ValueError, match="all > 0"):
        Mixture([1.0, 0.0], 0)


def test_validation_split_is_held_out_and_read_the_same_way_for_any_seed(tmp_path, rng):
    texts = random_texts(rng, 90)
    write_jsonl(tmp_path / "a.jsonl", texts)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", rng)
    assert prepare_data.main(["--source", str(tmp_path / "a.jsonl"), "--tokenizer",
                                    str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "s"),
                                    "--val-every", "4", "--workers", "1", "--no-progress"]) == 0
    train_docs = {tuple(d) for d in shard_documents(tmp_path / "s", "train")}
    validation_docs = {tuple(d) for d in shard_documents(tmp_path / "s", "validation")}
    assert validation_docs and train_docs and not train_docs & validation_docs
    assert len(train_docs) + len(validation_docs) == len(texts)

    def first_batches(split, seed):
        data = build_data(Data(source=str(tmp_path / "s")),
                          Training(seq_len=16, local_batch_size=4, seed=seed), split=split,
                          tokenizer=tokenizer)
        return [windows_of(*next(data)) for _ in range(3)]

    validation_stream = np.concatenate([np.load(tmp_path / "s" / s["file"]) for s in
                                        read_index(tmp_path / "s")["splits"]["validation"]["shards"]])
    text = ",".join(map(str, validation_stream.tolist())) + ","
    for window in sum(first_batches("validation", 0), []):
        assert ",".join(map(str, window)) + "," in text, "validation windows come from validation documents"
    assert first_batches("validation", 0) == first_batches("validation", 5)
    assert first_batches("train", 0) != first_batches("train", 5)


def test_folders_that_cannot_be_read_are_named(tmp_path, rng):
    generator = np.random.default_rng(rng.randrange(2**31))
    folder, _ = stream_shards(tmp_path / "s", generator, [50, 20])
    with pytest.raises(ShardFormatError, match="fewer than one window of seq_len \\+ 1 = 71"):
        batches([folder], 70, 1)
    # the fix for each user of the split: the trainer's key, the evaluation script's option
    with pytest.raises(ShardFormatError, match=r"no validation documents .* \(\[validation\] "
                       r"enable = false when training, --split train for scripts.evaluate\)"):
        build_data(Data(source=str(folder)), Training(seq_len=8, local_batch_size=1),
                   split="validation", tokenizer=BYTE)
    with pytest.raises(ShardFormatError, match="out of range for the model's vocab size 10"):
        build_data(Data(source=str(folder)), Training(seq_len=8, local_batch_size=1), split="train",
                   tokenizer=BYTE, max_token_id=10)
    index = (folder / "index.json").read_text()
    (folder / "index.json").write_text(index[:len(index) // 2])  # cut short
    with pytest.raises(ShardFormatError, match=rf"{folder}/index.json: damaged, not a token shard "
                                               r"index \(.*\); prepare the folder again"):
        TokenShards(folder)
    (folder / "index.json").write_text(index)
    shard = folder / "train" / "00001-00000.tokens.npy"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ShardFormatError, match="00001-00000.tokens.npy: .* bytes, expected .*truncated"):
        TokenShards(folder)
    (folder / "index.json").rename(folder / "prepare.json")
    with pytest.raises(ShardFormatError, match="unfinished token shards"):
        build_data(Data(source=str(folder)), Training(seq_len=8, local_batch_size=1), split="train",
                   tokenizer=BYTE)
    with pytest.raises(ValueError, match="not a token shard folder"):
        build_data(Data(mixture=[MixtureSource(str(tmp_path), 1.0)]),
                   Training(seq_len=8, local_batch_size=1), split="train", tokenizer=BYTE)


# ---- end to end through train.py ------------------------------------------------------------

# The unfused loss: the fastest on the CPU, where the fused kernels run in Triton's interpreter.
SMALL = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu", "--loss.impl", "unfused",
         "--training.seq_len", "32", "--metrics.log_freq", "1", "--job.print_config", "false",
         "--lr_scheduler.warmup_steps", "2", "--validation.enable", "false"]


@pytest.fixture(scope="module")
def byte_shards(tmp_path_factory):
    """Two shard folders of the byte tokenizer from random documents."""
    import random

    root = tmp_path_factory.mktemp("shards")
    rng = random.Random(0)
    for name, count in (("web", 150), ("code", 60)):
        write_jsonl(root / f"{name}.jsonl", random_texts(rng, count))
        assert prepare_data.main(["--source", str(root / f"{name}.jsonl"), "--tokenizer", "byte",
                                        "--out", str(root / name), "--workers", "1", "--no-progress",
                                        "--val-every", "10"]) == 0
    return root


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_training_on_shards_resumes_exactly(tmp_path, byte_shards):
    """8 steps straight = a new process resuming from the step-4 checkpoint (the data position
    comes back from the rank file); validation passes in between read their own split."""
    args = SMALL + ["--data.source", str(byte_shards / "web"), "--training.local_batch_size", "4",
                    "--training.steps", "8", "--checkpoint.interval", "4", "--checkpoint.enable_checkpoint",
                    "true", "--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "2"]
    straight = tmp_path / "straight"
    assert train.main(args + ["--job.dump_folder", str(straight)]) == 0
    state = torch.load(straight / "checkpoint" / "step-4" / "rank-0.pt", weights_only=True)["data"]
    assert state["global_windows"] == 16
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    assert train.main(args + ["--job.dump_folder", str(resumed)]) == 0
    a, b = losses(straight), losses(resumed)
    assert sorted(a) == list(range(1, 9)) and sorted(b) == list(range(5, 9))
    assert max(abs(a[s] - b[s]) for s in b) <= 1e-6


def test_torchrun_gloo_two_processes_match_one_on_a_mixture(tmp_path, byte_shards):
    """[[data.mixture]] from TOML; FSDP over 2 CPU processes with local batch 2 gives the losses of
    one process with local batch 4."""
    config = tmp_path / "mixture.toml"
    config.write_text(f'[[data.mixture]]\nsource = "{byte_shards / "web"}"\nweight = 3\n'
                      f'[[data.mixture]]\nsource = "{byte_shards / "code"}"\nweight = 1\n')
    args = SMALL + ["--config", str(config), "--training.steps", "4"]
    assert train.main(args + ["--job.dump_folder", str(tmp_path / "one"), "--training.local_batch_size", "4"]) == 0
    resolved = (tmp_path / "one" / "config.toml").read_text()
    assert f'mixture = [{{source = "{byte_shards / "web"}", weight = 3.0}}' in resolved
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the ranks forked from a process that imported torch already (tests/forked_ranks.py)
    forked_ranks.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", str(ROOT / "train.py"), *args,
                      "--training.local_batch_size", "2",
                      "--job.dump_folder", str(tmp_path / "two")],
                     check=True, cwd=ROOT, env=env, timeout=300, stdout=subprocess.DEVNULL)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    assert max(abs(one[s] - two[s]) for s in one) <= 1e-5


def test_a_token_id_the_shard_dtype_cannot_hold_names_the_file(tmp_path):
    from components.data.shards import ShardWriter
    writer = ShardWriter(tmp_path / "train" / "00000-00000", np.dtype(np.uint16))
    with pytest.raises(ShardFormatError, match=r"00000-00000.*: token id 70000 does not fit the "
                                               r"shards' uint16"):
        writer.add(np.array([1, 70000]), np.array([2]))
    writer.abandon()


def test_mixture_counts_are_the_windows_located_in_each_source():
    mixture = Mixture([0.6, 0.3, 0.1], seed=5)
    source, _ = mixture.locate(np.arange(2 * MIXTURE_BLOCK + 77))
    for windows in (0, 1, 100, MIXTURE_BLOCK, 2 * MIXTURE_BLOCK + 77):
        assert mixture.counts(windows).tolist() == np.bincount(source[:windows], minlength=3).tolist()


def test_a_token_id_past_the_vocabulary_names_the_shard(tmp_path, rng):
    """A shard changed after index.json vouched for its ids: the batch that reads the bad id is an
    error naming the shard file, not an IndexError in the model's embedding."""
    generator = np.random.default_rng(rng.randrange(2**31))
    folder, _ = stream_shards(tmp_path / "s", generator, [50, 60], vocab=200)
    shard = folder / "train" / "00001-00000.tokens.npy"
    tokens = np.load(shard, mmap_mode="r+")
    tokens[7] = 300  # as damage would
    tokens.flush()
    del tokens
    loader = build_data(Data(source=str(folder)), Training(seq_len=8, local_batch_size=4),
                        split="train", tokenizer=BYTE, max_token_id=BYTE.vocab_size)
    with pytest.raises(ShardFormatError, match=rf"{shard}: token id 300, out of range for the "
                                               r"model's vocab size \d+ \(its index.json says at "
                                               r"most \d+\)"):
        for _ in range(20):  # an epoch reads every window
            next(iter(loader))
    loader.close()


def test_an_index_naming_shards_outside_its_folder_is_refused(tmp_path, rng):
    """index.json naming ../ (or an absolute path) read token files outside its folder."""
    generator = np.random.default_rng(rng.randrange(2**31))
    folder, _ = stream_shards(tmp_path / "s", generator, [50, 60])
    shutil.copytree(folder / "train", tmp_path / "elsewhere")
    index = json.loads((folder / "index.json").read_text())
    for named in ("../elsewhere/00000-00000.tokens.npy", str(tmp_path / "elsewhere/00000-00000.tokens.npy")):
        index["splits"]["train"]["shards"][0]["file"] = named
        (folder / "index.json").write_text(json.dumps(index))
        with pytest.raises(ShardFormatError, match=rf"index.json: names shard '{named}', outside the "
                                                   r"folder; not reading it"):
            TokenShards(folder)


def _resume_data_like_load_full(path: Path, data, rank: int, dp_rank: int, step: int,
                                batches_per_step: int) -> None:
    """Checkpointer._load_full's data part: the rank file _rank_file picks, else none."""
    ckpt = SimpleNamespace(rank=rank, dp_rank=dp_rank, data=data,
                           batches_per_step=batches_per_step)
    rank_file = Checkpointer._rank_file(ckpt, path)
    if rank_file.is_file():
        Checkpointer._load_data_state(ckpt, torch.load(rank_file, weights_only=True)["data"], step)
    else:
        Checkpointer._load_data_state(ckpt, None, step,
                                      f"{rank_file.name} is not in the checkpoint")


def test_token_shards_resumed_on_more_ranks_continue_at_one_position(tmp_path):
    """Token shards saved by 2 data-parallel ranks (local batch 2: 4 windows a step), resumed on
    4 ranks with the same local batch (8 windows a step). The shards' state is global (the same
    in every rank file): every rank should continue after the 8 windows the checkpoint read.
    Ranks 0 and 1 load their rank files (global window 8); ranks 2 and 3 have none and are
    placed by step x the new global batch (window 16): the ranks disagree, and windows 12-15
    are never read."""
    rng = np.random.default_rng(0)
    folder = write_token_shards(tmp_path / "shards", [rng.integers(0, 256, 4000)], 259, BYTE)
    data = Data(source=str(folder), synthetic=False)
    step_dir = tmp_path / "step-2"
    step_dir.mkdir()
    saved = ParallelDims.resolve(1, -1, 1, 2)
    for rank in range(2):  # the saving run: 2 steps on 2 ranks, its rank files
        batches = build_data(data, Training(seq_len=16, local_batch_size=2), split="train",
                             tokenizer=BYTE, dp_rank=saved.dp_rank(rank), dp_world=saved.dp)
        for _ in range(2):
            next(batches)
        torch.save({"data": batches.state_dict(), "rng": torch.get_rng_state(), "cuda_rng": None},
                   step_dir / f"rank-{rank}.pt")
        batches.close()
    now = ParallelDims.resolve(1, -1, 1, 4)
    positions = []
    for rank in range(4):
        batches = build_data(data, Training(seq_len=16, local_batch_size=2), split="train",
                             tokenizer=BYTE, dp_rank=now.dp_rank(rank), dp_world=now.dp)
        _resume_data_like_load_full(step_dir, batches, rank, now.dp_rank(rank), step=2,
                                    batches_per_step=1)
        positions.append(batches.state_dict()["global_windows"])
        batches.close()
    assert positions == [8, 8, 8, 8], positions
