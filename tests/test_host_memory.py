"""A run on the CPU whose model cannot fit this machine's memory is refused with one line before
anything is built (the kernel's out-of-memory killer ended it without a word before):
components/host_memory.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import train
from components.config.schema import ConfigError
from components.host_memory import BYTES_PER_PARAMETER, available_bytes, check_model_fits_on_cpu
from models import FLAVORS, param_count_for

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
    assert available_bytes(str(tmp_path / "no_meminfo"), v2) is None
    assert available_bytes() is None or available_bytes() > 0  # this machine's


def test_the_bound_counts_each_process_share_of_the_fp32_state():
    params = 1_000_003
    need = params * BYTES_PER_PARAMETER
    check_model_fits_on_cpu("x", params, 1, 1, need)  # exactly enough
    check_model_fits_on_cpu("x", params, 4, 4, need + 3)  # 4 processes, each a quarter
    check_model_fits_on_cpu("x", params, 1, 1, None)  # unknown: not checked
    with pytest.raises(ConfigError, match=r"^\[model\] flavor = 'x': its 1,000,003 parameters "
                                          r"need at least 0\.0 GiB .*AdamW's two states\), and"):
        check_model_fits_on_cpu("x", params, 1, 1, need - 1)
    with pytest.raises(ConfigError, match=r"two states, 2 processes\)"):  # replicas: each a copy
        check_model_fits_on_cpu("x", params, 2, 1, need)


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(tmp_path, monkeypatch):
    """llama_8b on a CPU machine of 24 GiB needs 120 GiB for its fp32 weights, gradients and
    AdamW state alone; here the debug model, with the machine's memory made smaller."""
    params = param_count_for(FLAVORS["debug"], exclude_embedding=False)
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(1))
    monkeypatch.setattr(train, "available_bytes", lambda: params * BYTES_PER_PARAMETER - 1)
    dump = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"\[model\] flavor = 'debug': its [\d,]+ parameters "
                                          r"need at least .* a smaller flavor, or a GPU"):
        train.main(["--config", str(REPO / "configs" / "debug.toml"),
                    "--job.dump_folder", str(dump), "--training.device", "cpu"])
    assert not built and not (dump / "config.toml").exists()


@pytest.mark.slow
def test_a_refusal_on_one_rank_stops_every_rank_in_one_line(tmp_path):
    """Each rank reads the free memory itself, at its own moment: one rank refusing while the
    others went on into the mesh's collectives would leave them waiting for it."""
    script = tmp_path / "rank_1_short.py"
    script.write_text(f"import os, sys\nsys.path.insert(0, {str(REPO)!r})\nimport train\n"
                      "if os.environ['RANK'] == '1':\n    train.available_bytes = lambda: 1\n"
                      "sys.exit(train.command_line())\n")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "--config", str(REPO / "configs" / "debug.toml"),
         "--job.dump_folder", str(tmp_path / "run"), "--job.print_config", "false"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    refusals = [line for line in result.stdout.splitlines() + result.stderr.splitlines()
                if line.startswith("config error: rank 1: [model] flavor = 'debug'")]
    assert len(refusals) == 1, result.stdout + result.stderr
    assert not (tmp_path / "run" / "config.toml").exists()
