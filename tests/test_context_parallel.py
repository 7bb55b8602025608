"""Context parallelism ([parallelism] context_parallel_degree): PyTorch's ring attention.

On the CPU (gloo, fp32) CP = 2, CP x FSDP, CP x TP (sequence- and vocab-parallel loss) and
HSDP x CP, with either rotate method, activation checkpointing and gradient accumulation, train
like one process:
the same losses, gradient norms and validation losses, and the same weights after 5 steps. A
checkpoint of dp 2 x cp 2 resumes at dp 2 without CP and at dp 2 x tp 2 with the losses of the
run that went on, its text data included (each rank reads the data state of its own
data-parallel rank), and scripts.evaluate gives its validation numbers. On two GPUs (skipped
here) CP = 2 trains like one GPU. The rest is checked without processes: the mesh's degrees
and data-parallel ranks, and the settings CP refuses.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from components.checkpoint import Checkpointer
from components.config.schema import ConfigError
from components.config.parse import load_config
from parallelisms.build import model_args
from parallelisms.context_parallel import check_context_parallel
from parallelisms.mesh import ParallelDims
from test_parallelisms import BASE, torchrun, weights

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 4
VALIDATE = ["--validation.enable", "true", "--validation.freq", "5", "--validation.steps", "2"]


def metrics(dump: Path) -> dict[int, dict]:
    """Each step's logged values, its training and its validation row together."""
    steps: dict[int, dict] = {}
    for row in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()):
        steps.setdefault(row["step"], {}).update(row)
    return steps


# ------------------------------------------------------------------------- without processes

def test_degrees_and_data_parallel_ranks():
    dims = ParallelDims.resolve(1, -1, 1, 4, cp=2)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.same_batch) == (2, 2, 2, 2)
    # the cp ranks of a data-parallel rank are adjacent and read the same batches
    assert [dims.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    dims = ParallelDims.resolve(2, -1, 2, 16, cp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.same_batch) == (2, 2, 4)
    assert [dims.dp_rank(r) for r in range(16)] == [r // 4 for r in range(16)]
    assert ParallelDims.resolve(1, -1, 2, 4) == ParallelDims(1, 2, 2, 4)  # cp defaults to 1


@pytest.mark.parametrize("args,match", [
    ((1, -1, 1, 6, 4), r"world size 6 is not divisible by data_parallel_replicate_degree \(1\) x "
                       r"context_parallel_degree \(4\) x tensor_parallel_degree \(1\)"),
    ((1, 3, 1, 4, 2), r"data_parallel_replicate_degree \(1\) x data_parallel_shard_degree \(3\) x "
                      r"context_parallel_degree \(2\) x tensor_parallel_degree \(1\) = 6, but "
                      r"the world size is 4"),
    ((1, -1, 1, 4, 0), r"\[parallelism\] context_parallel_degree = 0: must be >= 1"),
])
def test_degrees_that_do_not_fit_the_world_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.resolve(*args[:4], cp=args[4])


@pytest.mark.parametrize("cp,tp,seq_len,backend,match", [
    (2, 1, 66, "auto", r"context_parallel_degree = 2 does not fit \[training\] seq_len = 66: .* "
                       r"multiple of 4"),
    (4, 1, 64, "math", r"sdpa_backend = \"math\" has no context-parallel"),
    (2, 4, 76, "auto", r"tensor_parallel_degree = 4 does not divide a context-parallel rank's 38 "
                       r"tokens"),
])
def test_settings_cp_cannot_shard_are_refused(cp, tp, seq_len, backend, match):
    with pytest.raises(ValueError, match=match):
        check_context_parallel(cp, tp, seq_len, backend)
    check_context_parallel(1, tp, seq_len, backend)  # nothing to check without CP


def test_refused_before_the_model_is_built_as_a_config_error():
    cfg = load_config(["--training.seq_len", "66", "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ValueError, match="multiple of 4"):
        model_args(cfg, 259, ParallelDims.resolve(1, -1, 1, 2, cp=2))


def test_rotate_method_is_one_of_torchtitans():
    assert load_config([]).parallelism.context_parallel_rotate_method == "allgather"
    with pytest.raises(ConfigError, match=r"context_parallel_rotate_method = 'ring': expected one "
                                          r"of 'allgather', 'alltoall'"):
        load_config(["--parallelism.context_parallel_rotate_method", "ring"])


def _rank_files(folder: Path, dp_ranks: list[int]) -> None:
    folder.mkdir(parents=True)
    for rank, dp_rank in enumerate(dp_ranks):
        torch.save({"data": {"dp_rank": dp_rank, "dp_world": max(dp_ranks) + 1},
                    "rng": torch.get_rng_state(), "cuda_rng": None}, folder / f"rank-{rank}.pt")


@pytest.mark.parametrize("saved,dp_ranks_now", [
    ([0, 0, 1, 1], [0, 1]),  # dp 2 x cp 2 resumed at dp 2
    ([0, 1], [0, 0, 1, 1]),  # dp 2 resumed at dp 2 x cp 2 (or tp 2)
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1]),
])
def test_each_rank_resumes_the_data_of_its_data_parallel_rank(tmp_path, saved, dp_ranks_now):
    _rank_files(tmp_path / "step-2", saved)
    for rank, dp_rank in enumerate(dp_ranks_now):
        found = Checkpointer._rank_file(SimpleNamespace(rank=rank, dp_rank=dp_rank),
                                        tmp_path / "step-2")
        assert torch.load(found, weights_only=True)["data"]["dp_rank"] == dp_rank, (rank, found)


def test_evaluate_counts_the_cp_ranks_as_one_data_parallel_rank(tmp_path):
    from scripts.evaluate import data_parallel_ranks
    for rank in range(8):
        (tmp_path / f"rank-{rank}.pt").touch()
    cfg = load_config(["--parallelism.context_parallel_degree", "2",
                       "--parallelism.tensor_parallel_degree", "2"])
    assert data_parallel_ranks(tmp_path, cfg) == 2


def test_compare_layouts_takes_cp():
    result = subprocess.run([sys.executable, "-m", "scripts.compare_layouts", "--config",
                             "configs/debug.toml", "--nproc", "2", "--layouts", "cp2",
                             "--dry-run"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert all("--parallelism.context_parallel_degree 2" in line
               for line in result.stdout.splitlines())


@pytest.mark.parametrize("extra, seed", [([], 1), (["--extra=--training.seed 5"], 6)])
def test_compare_layouts_seed_runs_take_the_next_seed(extra, seed):
    """The seed runs took --training.seed 1 whatever the runs' own: with a config at seed 1 the
    noise run equalled A ("no noise band"), and other seeds were measured against seed 1."""
    result = subprocess.run([sys.executable, "-m", "scripts.compare_layouts", "--config",
                             "configs/debug.toml", "--nproc", "1", "--layouts", "fsdp",
                             "--seed-runs", *extra, "--dry-run"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    seed_run = next(line for line in result.stdout.splitlines() if "_seed+1" in line)
    assert seed_run.split("--training.seed ")[-1].split()[0] == str(seed)


# ------------------------------------------------------------------------- gloo processes

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    dump = tmp_path_factory.mktemp("single")
    assert train.main(BASE + VALIDATE + ["--training.local_batch_size", str(GLOBAL_BATCH),
                                         "--job.dump_folder", str(dump)]) == 0
    return dump


LAYOUTS = {  # name: (processes, overrides); the global batch is 4 windows of 64 tokens
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "cp2_alltoall_unfused_full_ac_accum2": (2, ["--parallelism.context_parallel_degree", "2",
                                                "--parallelism.context_parallel_rotate_method",
                                                "alltoall", "--loss.impl", "unfused",
                                                "--activation_checkpoint.mode", "full",
                                                "--training.gradient_accumulation_steps", "2"]),
    "fsdp2_cp2": (4, ["--parallelism.context_parallel_degree", "2"]),
    "cp2_tp2_sequence_op_ac": (4, ["--parallelism.context_parallel_degree", "2",
                                   "--parallelism.tensor_parallel_degree", "2",
                                   "--activation_checkpoint.mode", "selective",
                                   "--activation_checkpoint.selective_ac_option", "op"]),
    # (this was "hsdp2_cp2_vocab_unfused": with tp 1 the loss-parallel mode did nothing)
    "hsdp2_cp2_unfused": (4, ["--parallelism.context_parallel_degree", "2",
                              "--parallelism.data_parallel_replicate_degree", "2",
                              "--loss.impl", "unfused"]),
    "cp2_tp2_vocab": (4, ["--parallelism.context_parallel_degree", "2",
                          "--parallelism.tensor_parallel_degree", "2", "--loss.parallel", "vocab"]),
}


@pytest.mark.slow
def test_global_batch_size_sets_the_accumulation_on_any_number_of_ranks(tmp_path, single):
    """torchtitan's [training] global_batch_size: 4 windows a step on 2 ranks of local batch 1 are
    2 micro-batches each, the same step as one process's batch of 4 (the key was unknown)."""
    dump = tmp_path / "run"
    torchrun(2, dump, *VALIDATE, "--training.global_batch_size", str(GLOBAL_BATCH),
             "--training.local_batch_size", "1")
    assert "gradient_accumulation_steps = 2" in (dump / "config.toml").read_text()
    ref, got = metrics(single), metrics(dump)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in got:
        for key in ("loss", "grad_norm"):
            assert abs(got[step][key] - ref[step][key]) <= 1e-5, (step, key)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_layout_trains_like_one_process(tmp_path, single, layout):
    nproc, overrides = LAYOUTS[layout]
    cfg = load_config(overrides)
    dims = ParallelDims.resolve(cfg.parallelism.data_parallel_replicate_degree, -1,
                                cfg.parallelism.tensor_parallel_degree, nproc,
                                cfg.parallelism.context_parallel_degree)
    dump = tmp_path / "run"
    local_batch = GLOBAL_BATCH // dims.dp // cfg.training.gradient_accumulation_steps
    torchrun(nproc, dump, *VALIDATE, *overrides, "--training.local_batch_size", str(local_batch))
    ref, got = metrics(single), metrics(dump)
    assert sorted(got) == [1, 2, 3, 4, 5]
    # validation scores validation.steps batches of local_batch_size: under accumulation
    # (smaller micro-batches) other held-out windows
    keys = ["loss", "grad_norm"] + ["val_loss"] * (cfg.training.gradient_accumulation_steps == 1)
    for step in got:
        for key in keys:
            if key in ref[step]:
                assert abs(got[step][key] - ref[step][key]) <= 1e-5, (step, key)
    assert "val_loss" in got[5]
    # as in test_parallelisms.py: AdamW turns ~1e-9 summation-order differences of near-zero
    # gradients into up to ~1e-5 of lr after a few steps
    w_ref, w_got = weights(single, 5, tmp_path), weights(dump, 5, tmp_path)
    assert w_ref.keys() == w_got.keys()
    for name in w_ref:
        torch.testing.assert_close(w_got[name], w_ref[name], rtol=1e-5, atol=3e-5, msg=name)


@pytest.mark.slow
def test_cp_with_one_text_window_a_batch_trains_like_one_process(tmp_path):
    """A batch of one window: its inputs and labels are two views of one tensor a token apart
    (contiguous both, and .to() on the CPU keeps them), and context parallelism shards buffers
    in place: sharding the labels wrote into the inputs (loss 6.354 against 6.351 at step 1).
    Synthetic batches, stacked apart, never showed it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"paragraph {i}: " + " ".join(f"word{(i * 5 + j) % 89}"
                                                                for j in range(50))
                                  for i in range(24)))
    text = ["--data.synthetic", "false", "--data.source", str(corpus), "--data.num_workers", "0",
            "--training.local_batch_size", "1", "--training.steps", "3",
            "--validation.enable", "false"]
    assert train.main(BASE + text + ["--job.dump_folder", str(tmp_path / "one")]) == 0
    torchrun(2, tmp_path / "cp2", *text, "--parallelism.context_parallel_degree", "2")
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "cp2")
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for step in got:
        for key in ("loss", "grad_norm"):
            assert abs(got[step][key] - ref[step][key]) <= 1e-5 * abs(ref[step][key]), (step, key)


@pytest.mark.slow
def test_checkpoint_resumes_across_cp_layouts_with_its_text_data(tmp_path):
    """Saved by dp 2 x cp 2 (4 ranks), resumed at dp 2 (2 ranks) and at dp 2 x tp 2: global rank
    1 now belongs to data-parallel rank 1, whose text windows rank 0 and 1 of the saved run
    never read; it resumes the state of saved rank 2 (without it, it read its documents from
    the start, and under CP its peers' windows would not even be its own)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"paragraph {i}: " + " ".join(f"word{(i * 7 + j) % 97}"
                                                                for j in range(60))
                                  for i in range(48)))
    text = ["--data.synthetic", "false", "--data.source", str(corpus), "--data.num_workers", "0",
            "--data.val_every", "4", "--training.local_batch_size", "2", *VALIDATE]
    saved = tmp_path / "dp2_cp2"
    torchrun(4, saved, *text, "--parallelism.context_parallel_degree", "2")
    expected = metrics(saved)
    for name, nproc, overrides in (("dp2", 2, []),
                                   ("dp2_tp2", 4, ["--parallelism.tensor_parallel_degree", "2"])):
        dump = tmp_path / name
        (dump / "checkpoint").mkdir(parents=True)
        subprocess.run(["cp", "-r", str(saved / "checkpoint" / "step-2"),
                        str(dump / "checkpoint" / "step-2")], check=True)
        torchrun(nproc, dump, *text, *overrides)
        got = metrics(dump)
        assert sorted(got) == [3, 4, 5], name
        for step in got:
            for key in ("loss", "val_loss"):
                if key in expected[step]:
                    assert abs(got[step][key] - expected[step][key]) <= 1e-5, (name, step, key)

    # scripts.evaluate on the CP run's last checkpoint: 2 data-parallel shares, not 4
    from scripts import evaluate
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", str(saved / "checkpoint"), "--json", str(out),
                          "--device", "cpu"]) == 0  # the run's device: CUDA's bf16 rounds apart
    record = json.loads(out.read_text())
    for key in ("val_loss", "val_bpb"):
        assert record[key] == pytest.approx(expected[5][key], abs=1e-5)


# ------------------------------------------------------------------------- two GPUs

@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("variant,tol", [
    # fp32: the efficient-attention kernel as a ring; only the summation order differs
    (["--training.mixed_precision_param", "float32"], 1e-4),
    # bf16: PyTorch's choice of kernel (cuDNN on an H200) as a ring, which merges the bf16
    # partial attentions in fp32
    ([], 2e-2),
    (["--compile.enable", "true"], 2e-2),
], ids=["fp32", "bf16", "bf16_compile"])
def test_cp2_on_two_gpus_trains_like_one_gpu(tmp_path, variant, tol):
    common = ["--config", str(ROOT / "configs/debug.toml"), "--training.seq_len", "4096",
              "--model.max_seq_len", "4096", "--training.local_batch_size", "2",
              "--training.steps", "10", "--metrics.log_freq", "1", "--data.synthetic", "true",
              "--job.print_config", "false", "--lr_scheduler.warmup_steps", "2", *VALIDATE,
              "--validation.freq", "10", *variant]
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    one = tmp_path / "one"
    subprocess.run([sys.executable, str(ROOT / "train.py"), *common, "--job.dump_folder",
                    str(one)], check=True, cwd=ROOT, env=env, timeout=600)
    two = tmp_path / "two"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", str(ROOT / "train.py"), *common,
                    "--parallelism.context_parallel_degree", "2", "--job.dump_folder", str(two)],
                   check=True, cwd=ROOT, env=env, timeout=600)
    ref, got = metrics(one), metrics(two)
    for step in range(1, 11):
        for key in ("loss", "val_loss"):
            if key in ref[step]:
                assert abs(got[step][key] - ref[step][key]) <= tol, (step, key, got[step][key],
                                                                     ref[step][key])


def test_bench_peers_counts_torchtitans_cp_tokens_once():
    """torchtitan logs the tokens of each batch on every rank that reads it (before sharding it
    over CP): its tps under CP 2 is twice the tokens a GPU processes."""
    from scripts.bench.peers import titan_rows, titan_same_batch
    assert titan_same_batch(["--parallelism.context_parallel_degree", "2"]) == 2
    assert titan_same_batch(["--parallelism.context_parallel_degree=2",
                             "--parallelism.tensor_parallel_degree", "2"]) == 4
    assert titan_same_batch(["--training.local_batch_size", "1"]) == 1
    log = "step: 10  loss:  7.1  grad_norm: 1.0  memory: 50.20GiB(36.0%)  tps: 9,458  tflops: 1\n"
    assert titan_rows(log, 2) == [{"step": 10, "tokens_per_second": 4729.0,
                                   "memory_max_reserved_gib": 50.2}]
