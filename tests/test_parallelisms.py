"""Every layout trains like one process (CPU, gloo, fp32): dp_shard=2, tp=2, dp_shard=2 x tp=2 and
HSDP, with the sequence- and vocab-parallel loss, fused and unfused, with activation
checkpointing: the losses and gradient norms of the first 5 steps and the weights after them
equal a single-process run; a checkpoint saved at
dp_shard=2 x tp=2 resumes at dp_shard=4 and at one process with the same losses."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train
from launches import errors, launch
from components.tokenizer import ByteTokenizer
from parallelisms.mesh import ParallelDims
from shard_cases import write_token_shards

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 4
BASE = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--training.seq_len", "64",
        "--metrics.log_freq", "1", "--job.print_config", "false", "--validation.enable", "false",
        "--lr_scheduler.warmup_steps", "2", "--training.steps", "5", "--data.synthetic", "true",
        "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2"]


def torchrun(nproc: int, dump: Path, *overrides) -> None:
    run = launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", str(nproc), str(ROOT / "train.py"), *BASE,
                  "--job.dump_folder", str(dump), *overrides], dump, forked=True)
    assert run.returncode == 0, f"torchrun exited {run.returncode}: {errors(run.stderr)}"


def metrics(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def weights(dump: Path, step: int, tmp: Path) -> dict:
    out = tmp / f"{dump.name}-{step}.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", out)
    return {k: v for k, v in torch.load(out, weights_only=False)["model"].items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    dump = tmp_path_factory.mktemp("single")
    assert train.main(BASE + ["--training.local_batch_size", str(GLOBAL_BATCH),
                              "--job.dump_folder", str(dump)]) == 0
    return dump


# Each launch costs ~10 s of CI: a layout whose parts another one already runs together is left
# out (tp=2 with the sequence-parallel flce runs under every-other-block AC below, full AC under
# context parallelism in test_context_parallel.py, the vocab-parallel flce at
# dp_shard=2 x tp=2 under per-op selective AC, the unfused loss under FSDP at dp_shard=2 x tp=2).
LAYOUTS = [  # (processes, dp_replicate, tp, loss parallel, loss impl[, AC mode[:option]])
    (2, 1, 1, "sequence", "flce"),  # FSDP: dp_shard=2 (the loss-parallel mode needs tp > 1)
    (2, 1, 2, "sequence", "unfused"),
    (4, 1, 2, "sequence", "flce"),
    (4, 1, 2, "vocab", "unfused"),
    (4, 2, 1, "sequence", "flce"),  # HSDP: replicate 2 x shard 2
    # every other block checkpointed (TP plan before AC), the others not
    (2, 1, 2, "sequence", "flce", "selective:2"),
    (4, 1, 2, "vocab", "flce", "selective:op"),  # per-op: TP's reduce-scatters kept
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layout_matches_one_process(tmp_path, single, layout):
    nproc, replicate, tp, parallel, impl, ac = (*layout, "none")[:6]
    ac, _, option = ac.partition(":")
    dims = ParallelDims.resolve(replicate, -1, tp, nproc)
    dump = tmp_path / "run"
    torchrun(nproc, dump, "--parallelism.tensor_parallel_degree", str(tp),
             "--parallelism.data_parallel_replicate_degree", str(replicate),
             "--training.local_batch_size", str(GLOBAL_BATCH // dims.dp),
             "--loss.parallel", parallel, "--loss.impl", impl,
             "--activation_checkpoint.mode", ac, "--activation_checkpoint.selective_ac_option", option or "2")
    assert_trains_like_one_process(single, dump, tmp_path)


def assert_trains_like_one_process(single: Path, dump: Path, tmp_path: Path) -> None:
    ref, got = metrics(single), metrics(dump)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in got:
        for key in ("loss", "grad_norm"):
            assert abs(got[step][key] - ref[step][key]) <= 1e-5, (step, key)
    # Weights after 5 AdamW steps: Adam divides by sqrt(v), so for near-zero gradients the fp32
    # summation-order differences of another layout (~1e-9) move an update by up to ~1e-5 of
    # lr 3e-3; the styles themselves match float64 to 1e-9 (test_loss_parallel.py).
    w_ref, w_got = weights(single, 5, tmp_path), weights(dump, 5, tmp_path)
    assert w_ref.keys() == w_got.keys()
    for name in w_ref:
        torch.testing.assert_close(w_got[name], w_ref[name], rtol=1e-5, atol=3e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "memory_budget"])
def test_tp_with_compiled_blocks_matches_one_process(tmp_path, single, ac):
    """TP with [compile] enable: the token embedding's gradient came back zero (grad norm 3.520
    against 3.534 at step 1, the embedding moved by weight decay alone), silently. With AC mode
    "memory_budget" every rank crashed at step 1: the partitioner would not size the DeviceMesh
    in the blocks' graphs."""
    dump = tmp_path / "run"
    torchrun(2, dump, "--parallelism.tensor_parallel_degree", "2", "--compile.enable", "true",
             "--activation_checkpoint.mode", ac, "--activation_checkpoint.memory_budget", "0.5",
             "--training.local_batch_size", str(GLOBAL_BATCH))
    assert_trains_like_one_process(single, dump, tmp_path)


@pytest.mark.slow
def test_clipping_under_dp_and_tp_matches_one_process(tmp_path):
    """The layouts above never clip (grad norms 0.45-0.73 under max_norm 1) and AdamW would hide a
    wrong clip factor (it divides by sqrt(v)): here max_norm 0.3 clips every step and eps 1
    makes the update follow the gradient's size, so the losses and weights show the factor that
    grad_norm_and_clip applies across the DTensor groups of dp_shard=2 x tp=2."""
    clip = ["--training.max_norm", "0.3", "--optimizer.eps", "1.0", "--optimizer.lr", "3.0"]
    ref_dump, dump = tmp_path / "single", tmp_path / "run"
    assert train.main(BASE + clip + ["--training.local_batch_size", str(GLOBAL_BATCH),
                                     "--job.dump_folder", str(ref_dump)]) == 0
    torchrun(4, dump, *clip, "--parallelism.tensor_parallel_degree", "2", "--loss.parallel",
             "vocab", "--training.local_batch_size", str(GLOBAL_BATCH // 2))
    ref, got = metrics(ref_dump), metrics(dump)
    assert all(ref[s]["grad_norm"] > 0.3 for s in ref)  # clipped at every step
    for step in got:
        for key in ("loss", "grad_norm"):
            assert abs(got[step][key] - ref[step][key]) <= 1e-5, (step, key)
    w_ref, w_got = weights(ref_dump, 5, tmp_path), weights(dump, 5, tmp_path)
    for name in w_ref:
        torch.testing.assert_close(w_got[name], w_ref[name], rtol=1e-5, atol=3e-5, msg=name)


@pytest.mark.slow
def test_checkpoint_reshards_across_layouts(tmp_path):
    saved = tmp_path / "dp2_tp2"
    torchrun(4, saved, "--parallelism.tensor_parallel_degree", "2",
             "--training.local_batch_size", "2")
    expected = metrics(saved)
    for name, nproc, batch in (("dp4", 4, 1), ("one", 1, 4)):
        dump = tmp_path / name
        (dump / "checkpoint").mkdir(parents=True)
        shutil.copytree(saved / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
        if nproc == 1:
            assert train.main(BASE + ["--training.local_batch_size", str(batch),
                                      "--job.dump_folder", str(dump)]) == 0
        else:
            torchrun(nproc, dump, "--training.local_batch_size", str(batch))
        got = metrics(dump)
        assert sorted(got) == [3, 4, 5], name
        assert all(abs(got[s]["loss"] - expected[s]["loss"]) <= 1e-5 for s in got), name


def test_token_shards_resumed_on_more_processes_read_from_one_position(tmp_path):
    """The same end to end: 2 steps on 2 processes (local batch 2) saved at step 2, resumed on 4
    processes (local batch 2) for step 3. After step 3 every rank's shard state should be the
    same global position (8 windows read + 8 = 16); ranks 2 and 3, which have no rank file of
    their own, started at 16 instead of 8 and are at 24: at step 3 they read windows 20-23
    while ranks 0 and 1 read 8-11, and windows 12-15 are never read in the epoch."""
    rng = np.random.default_rng(0)
    folder = write_token_shards(tmp_path / "shards", [rng.integers(0, 256, 20000)], 259,
                                ByteTokenizer())
    shards = ["--data.synthetic", "false", "--data.source", str(folder),
              "--training.local_batch_size", "2", "--checkpoint.interval", "1"]
    saved = tmp_path / "dp2"
    torchrun(2, saved, *shards, "--training.steps", "2")
    dump = tmp_path / "dp4"
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(saved / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    torchrun(4, dump, *shards, "--training.steps", "3")
    step3 = dump / "checkpoint" / "step-3"
    positions = [torch.load(step3 / f"rank-{r}.pt", weights_only=True)["data"]["global_windows"]
                 for r in range(4)]
    assert positions == [16, 16, 16, 16], positions


def test_tp_rejects_settings_it_cannot_honour():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from components.config.schema import Loss
    from components.loss import ModelWithLoss, TrainingLoss
    from models import FLAVORS, Llama
    from parallelisms.tp import apply_tp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with torch.device("meta"):
            model = ModelWithLoss(Llama(FLAVORS["debug"], seq_len=64),
                                  TrainingLoss(Loss(impl="torch_chunked")))
        with pytest.raises(ValueError, match="'torch_chunked' has no vocab-parallel form"):
            apply_tp(model, mesh, "vocab")
        with torch.device("meta"):
            model = ModelWithLoss(Llama(FLAVORS["debug"], seq_len=64),
                                  TrainingLoss(Loss(impl="flce", memory_lean=True)))
        with pytest.raises(ValueError, match="memory_lean has no vocab-parallel form"):
            apply_tp(model, mesh, "vocab")
        with torch.device("meta"):
            model = ModelWithLoss(Llama(FLAVORS["debug"], seq_len=64),
                                  TrainingLoss(Loss(impl="flce", float8="logits")))
        with pytest.raises(ValueError, match="float8 = 'logits' has no vocab-parallel form"):
            apply_tp(model, mesh, "vocab")
        # A block already wrapped by activation checkpointing would be skipped by the plan.
        from parallelisms.activation_checkpoint import apply_activation_checkpointing
        with torch.device("meta"):
            model = ModelWithLoss(Llama(FLAVORS["debug"], seq_len=64), TrainingLoss(Loss()))
        apply_activation_checkpointing(model.model, "full")
        with pytest.raises(TypeError, match="layers.0 is a CheckpointWrapper: apply tensor"):
            apply_tp(model, mesh, "sequence")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("policy, gathered", [("default", True), ("always", False),
                                              ("never", True)])
def test_fsdp_reshard_policy_with_nothing_sharded(policy, gathered):
    """With dp_shard 1 (one GPU) "default" keeps every block gathered from forward to backward:
    resharding would only drop the bf16 copy and cast it again."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from components.config.schema import Loss
    from components.loss import ModelWithLoss, TrainingLoss
    from models import FLAVORS, Llama
    from parallelisms.fsdp import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dims = ParallelDims.resolve(1, -1, 1, 1)
        with torch.device("meta"):
            model = ModelWithLoss(Llama(FLAVORS["debug"], seq_len=16), TrainingLoss(Loss()))
        apply_fsdp(model, dims.build_mesh("cpu"), dims, torch.float32,
                   reshard_after_forward=policy)
        model.to_empty(device="cpu")
        model.model.init_weights()
        vocab = model.model.args.vocab_size
        tokens, labels = (torch.randint(0, vocab, (2, 16)) for _ in range(2))
        loss = model(tokens, labels, torch.tensor(32.0))
        first_block = model.model.layers["0"].attention.wq.weight
        assert isinstance(first_block, DTensor) != gathered
        loss.backward()  # and backward works from either state
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flavor, tp, seq_len, match", [
    ("debug", 3, 63, r"^\[parallelism\] tensor_parallel_degree = 3 does not divide the debug "
                     r"flavor's n_heads = 4 \(\[model\] flavor\); degrees that fit it: 1, 2$"),
    ("debug", 4, 64, r"debug flavor's n_kv_heads = 2 .*: 1, 2$"),
    ("llama_8b", 16, 8192, r"llama_8b flavor's n_kv_heads = 8 .*: 1, 2, 4, 8$"),
    ("odd_ffn", 2, 64, r"odd_ffn flavor's ffn_dim = 385 .*: 1$"),
    ("debug", 2, 127, r"^\[parallelism\] tensor_parallel_degree = 2 does not divide "
                      r"\[training\] seq_len = 127: sequence parallelism"),
])
def test_tp_degree_that_does_not_divide_is_named(flavor, tp, seq_len, match):
    """It crashed deep inside instead: a reshape error (heads), a matmul of mismatched cuts
    (FFN), a gloo collective mismatch and SIGABRT (seq_len)."""
    from dataclasses import replace

    from models import FLAVORS
    from parallelisms.tp import check_tp_degree

    args = replace(FLAVORS["debug"], ffn_dim=385) if flavor == "odd_ffn" else FLAVORS[flavor]
    with pytest.raises(ValueError, match=match):
        check_tp_degree(args, flavor, tp, seq_len)


@pytest.mark.parametrize("flavor, tp, seq_len", [("debug", 1, 127), ("debug", 2, 64),
                                                 ("llama_1b", 8, 8192), ("llama_8b", 4, 4)])
def test_tp_degree_that_divides_passes(flavor, tp, seq_len):
    from models import FLAVORS
    from parallelisms.tp import check_tp_degree

    check_tp_degree(FLAVORS[flavor], flavor, tp, seq_len)


@pytest.mark.slow
def test_train_refuses_tp_degree_before_building(tmp_path):
    """tp=2 with seq_len 63 failed mid-step (127: a gloo abort); now it stops with the message."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(ROOT / "train.py"), *BASE,
                          "--job.dump_folder", str(tmp_path), "--training.seq_len", "63",
                          "--parallelism.tensor_parallel_degree", "2"],
                         cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 1  # torchrun's status when a trainer exits 2 (a config error)
    line = ("config error: [parallelism] tensor_parallel_degree = 2 does not divide [training] "
            "seq_len = 63: sequence parallelism cuts every sequence into 2 equal pieces\n")
    # local rank 0 says it, in one line (torchrun may SIGTERM the other once one has failed)
    assert line in run.stderr, run.stderr[-3000:]
    assert "SIGABRT" not in run.stderr and "Signal 6 " not in run.stderr
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("loss_keys, message", [
    (["--loss.impl", "torch_chunked"], r"\[loss\] impl = 'torch_chunked' has no vocab-parallel"),
    (["--loss.memory_lean", "true"], r"\[loss\] memory_lean has no vocab-parallel form"),
    (["--loss.float8", "logits"], r"\[loss\] float8 = 'logits' has no vocab-parallel form"),
])
def test_train_refuses_a_loss_tp_cannot_honour_before_building(tmp_path, loss_keys, message):
    """These were tracebacks from apply_tp on every rank, after the model was built; now they
    are config errors (one line) before anything is built or written."""
    from components.config.parse import is_config_error, load_config
    cfg = load_config([*BASE, "--job.dump_folder", str(tmp_path), "--loss.parallel", "vocab",
                       "--parallelism.tensor_parallel_degree", "2", *loss_keys])
    with pytest.raises(ValueError, match=message) as refused:
        train.check_before_building(cfg, 0, 2, torch.device("cpu"))
    assert is_config_error(refused.value)
    assert not (tmp_path / "config.toml").exists()
    cfg.parallelism.tensor_parallel_degree = 1  # the vocab style is not applied: a warning only
    train.check_before_building(cfg, 0, 1, torch.device("cpu"))


@pytest.mark.slow
def test_a_data_error_of_one_rank_alone_is_said_by_local_rank_0(tmp_path):
    """A validation split of one document over two data-parallel ranks: rank 1's share is empty.
    Rank 0 went on into a collective and said only that gloo's peer had closed the connection;
    rank 1's one line was never printed (only local rank 0 prints)."""
    import json
    source = tmp_path / "short.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(5)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(ROOT / "train.py"), *BASE,
                          "--data.synthetic", "false", "--data.source", str(source),
                          "--validation.enable", "true", "--validation.freq", "2",
                          "--validation.steps", "1", "--job.dump_folder", str(tmp_path / "run")],
                         cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 1  # torchrun's status when a trainer exits 2
    line = ("config error: rank 1: data-parallel rank 1 of 2 gets no documents: there are only 1 "
            "(for a held-out validation split, a smaller [data] val_every holds out more)\n")
    assert line in run.stderr, run.stderr[-3000:]
    assert "Connection closed" not in run.stderr
