"""A run on the CPU whose model cannot fit this machine's memory is refused with one line before
anything is built (the kernel's out-of-memory killer ended it without a word before):
components/host_memory.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from components.config.schema import ConfigError
from components.host_memory import (BYTES_PER_PARAMETER, available_bytes, check_model_fits_on_cpu,
                                    eager_blocks_keep_all, least_bytes)
from models import FLAVORS, Llama, LlamaArgs, param_count_for, saved_values_per_token

REPO = Path(__file__).resolve().parent.parent


def _meminfo(tmp_path, available_kb, swap_kb):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:          123 kB\n"
                    f"MemAvailable:   {available_kb} kB\nSwapTotal:    0 kB\n"
                    f"SwapFree:  {swap_kb} kB\n")
    return str(path)


def _cgroup(tmp_path, files):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def test_available_memory_is_the_kernels_capped_by_the_containers(tmp_path):
    meminfo = _meminfo(tmp_path, 3000, 1000)  # 4000 KiB with the free swap
    assert available_bytes(meminfo, str(tmp_path / "none")) == 4000 * 1024
    v2 = _cgroup(tmp_path / "v2", {"memory.max": "3145728\n", "memory.current": "1048576\n"})
    assert available_bytes(meminfo, v2) == 2 * 2**20  # the container's 3 MiB less 1 MiB used
    unlimited = _cgroup(tmp_path / "max", {"memory.max": "max\n", "memory.current": "5\n"})
    assert available_bytes(meminfo, unlimited) == 4000 * 1024
    v1 = _cgroup(tmp_path / "v1", {"memory/memory.limit_in_bytes": "9223372036854771712",
                                   "memory/memory.usage_in_bytes": "100"})
    assert available_bytes(meminfo, v1) == 4000 * 1024  # v1's "no limit" is a huge number
    over = _cgroup(tmp_path / "over", {"memory.max": "100", "memory.current": "200"})
    assert available_bytes(meminfo, over) == 0
    # a container's page cache (a corpus read) is reclaimed: not counted as used
    cached = _cgroup(tmp_path / "cached", {"memory.max": "3145728", "memory.current": "3145728",
                                           "memory.stat": "anon 1048576\nfile 2097152\n"})
    assert available_bytes(meminfo, cached) == 2 * 2**20
    v1_cached = _cgroup(tmp_path / "v1_cached", {
        "memory/memory.limit_in_bytes": "3145728", "memory/memory.usage_in_bytes": "3145728",
        "memory/memory.stat": "cache 5\ntotal_cache 2097152\n"})
    assert available_bytes(meminfo, v1_cached) == 2 * 2**20
    assert available_bytes(str(tmp_path / "no_meminfo"), v2) is None
    assert available_bytes() is None or available_bytes() > 0  # this machine's


def _saved(model, forward, in_bytes: bool) -> int:
    """Elements (or bytes) of the tensors autograd saves while `forward()` runs, each storage
    once, the model's parameters and RoPE table left out."""
    shared = {t.untyped_storage().data_ptr() for t in [*model.parameters(), model.rope_cache]}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            storages[storage.data_ptr()] = storage.nbytes() // (1 if in_bytes else t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


@pytest.mark.parametrize("args", [
    FLAVORS["debug"],  # grouped-query attention
    LlamaArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=6, vocab_size=77, ffn_dim=200,
              max_seq_len=64),
    LlamaArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=1, vocab_size=50, ffn_dim=96,
              max_seq_len=64, tie_embeddings=True)])
def test_the_count_of_saved_values_is_what_autograd_saves(args):
    """saved_values_per_token against the tensors the model's forward really saves for
    backward (saved_tensors_hooks), each storage once, parameters and the RoPE table left out:
    a block's, then the model's: its blocks', the final norm's input, rms and input x rms, and
    the token ids the embedding keeps."""
    torch.manual_seed(0)
    model = Llama(args, 40)
    model.init_weights()
    saved_values = lambda forward: _saved(model, forward, in_bytes=False)  # noqa: E731
    batch, seq = 3, 37
    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    block = saved_values(lambda: model.layers["0"](x, model.rope_cache[:seq]))
    assert block == batch * seq * saved_values_per_token(args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    whole = saved_values(lambda: model(tokens))
    assert whole == batch * seq * (args.n_layers * saved_values_per_token(args) + 2 * args.dim + 2)


def test_the_bound_counts_each_process_share_and_what_backward_keeps():
    params, args = 1_000_003, FLAVORS["debug"]
    block = saved_values_per_token(args)
    assert least_bytes(params, 1, 0, args, True, True) == params * BYTES_PER_PARAMETER
    assert least_bytes(params, 4, 0, args, True, False) == params * BYTES_PER_PARAMETER // 4
    layers, dim = args.n_layers, args.dim
    every = (layers * block + 2 * dim + 1) * 4  # a token's bytes: its blocks' and final norm's
    assert least_bytes(0, 1, 1000, args, True, False) == 1000 * every
    # checkpointed: each block's input, one block's values at a time in backward
    assert least_bytes(0, 1, 1000, args, False, False) == 1000 * (
        layers * dim + block - dim + 2 * dim + 1) * 4
    assert least_bytes(0, 1, 1000, args, True, True) == 1000 * (every + args.vocab_size * 4)
    need = least_bytes(params, 1, 100, args, True, False)
    check_model_fits_on_cpu("x", params, 1, 100, need, 1, need)  # exactly enough
    check_model_fits_on_cpu("x", params, 1, 100, need, 1, None)  # unknown: not checked
    with pytest.raises(ConfigError, match=r"^\[model\] flavor = 'x' at \[training\] "
                                          r"local_batch_size = 1, seq_len = 100: its 1,000,003 "
                                          r"parameters need at least 0\.0 GiB .*kept for "
                                          r"backward\), and"):
        check_model_fits_on_cpu("x", params, 1, 100, need, 1, need - 1)
    with pytest.raises(ConfigError, match=r"kept for backward, 2 processes\)"):  # on this host
        check_model_fits_on_cpu("x", params, 1, 100, need, 2, 2 * need - 1)


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(tmp_path, monkeypatch):
    """llama_8b on a CPU machine of 24 GiB needs 120 GiB for its fp32 weights, gradients and
    AdamW state alone; here the debug model, with the machine's memory made smaller."""
    debug = FLAVORS["debug"]
    need = least_bytes(param_count_for(debug, exclude_embedding=False), 1, 8 * 256, debug,
                       True, False)  # configs/debug.toml's batch of 8 x 256 tokens
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(1))
    monkeypatch.setattr(train, "available_bytes", lambda: need - 1)
    dump = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"\[model\] flavor = 'debug' at \[training\] "
                                          r"local_batch_size = 8, seq_len = 256: its [\d,]+ "
                                          r"parameters need at least .* or batch, or a GPU"):
        train.main(["--config", str(REPO / "configs" / "debug.toml"),
                    "--job.dump_folder", str(dump), "--training.device", "cpu"])
    assert not built and not (dump / "config.toml").exists()


def test_a_batch_whose_activations_the_machine_cannot_hold_is_refused(tmp_path, monkeypatch):
    """The debug model's state fits, and half of what autograd keeps for its batch (measured here
    with saved_tensors_hooks, not from the bound): the run cannot take a step. The bound that
    counted only the blocks' inputs let such a run through (at local_batch_size 3000 on a
    24 GiB machine it was killed without a word)."""
    debug = FLAVORS["debug"]
    torch.manual_seed(0)
    model = Llama(debug, 256)
    model.init_weights()
    one_sequence = _saved(model, lambda: model(torch.randint(0, debug.vocab_size, (1, 256))),
                          in_bytes=True)
    state = param_count_for(debug, exclude_embedding=False) * BYTES_PER_PARAMETER
    monkeypatch.setattr(train, "available_bytes", lambda: state + 8 * one_sequence // 2)
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match=r"local_batch_size = 8, seq_len = 256: .* need at "
                                          r"least"):
        train.main(["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder",
                    str(tmp_path / "run"), "--training.device", "cpu"])  # its batch: 8 x 256
    assert not built


@pytest.mark.slow
def test_a_refusal_on_one_rank_stops_every_rank_in_one_line(tmp_path):
    """Each rank reads the free memory itself, at its own moment: one rank refusing while the
    others went on into the mesh's collectives would leave them waiting for it."""
    script = tmp_path / "rank_1_short.py"
    script.write_text("import os, sys\nimport train\n"
                      "if os.environ['RANK'] == '1':\n    train.available_bytes = lambda: 1\n"
                      "sys.exit(train.command_line())\n")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "--config", str(REPO / "configs" / "debug.toml"),
         "--job.dump_folder", str(tmp_path / "run"), "--job.print_config", "false"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})  # train from here
    assert result.returncode != 0
    refusals = [line for line in result.stdout.splitlines() + result.stderr.splitlines()
                if line.startswith("config error: rank 1: [model] flavor = 'debug' at")]
    assert len(refusals) == 1, result.stdout + result.stderr
    assert not (tmp_path / "run" / "config.toml").exists()


def test_checkpointed_or_compiled_blocks_are_counted_one_at_a_time():
    """Activation checkpointing keeps a block's input only; a compiled block's graph may save
    fewer values than eager autograd: the bound then counts one block's, so it stays a bound."""
    from components.config.parse import load_config
    base = ["--config", str(REPO / "configs" / "debug.toml")]
    assert eager_blocks_keep_all(load_config(base))
    assert not eager_blocks_keep_all(load_config(base + ["--activation_checkpoint.mode",
                                                         "full"]))
    assert not eager_blocks_keep_all(load_config(base + ["--compile.enable", "true"]))
    assert eager_blocks_keep_all(load_config(base + ["--compile.enable", "true",
                                                     "--compile.components", "loss"]))
