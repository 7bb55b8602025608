"""scripts/bench/kernel_registers.py: the row kernel compiled for sm_90 on a machine without a
GPU, its registers and spilled bytes a thread read from the cubin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cuobjdump() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump"))


pytestmark = pytest.mark.skipif(not _cuobjdump(), reason="triton ships no cuobjdump here")


def registers(tmp_path, *args) -> subprocess.CompletedProcess:
    """The command, without the tests' TRITON_INTERPRET=1 (under it there is nothing to
    compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "scripts.bench.kernel_registers", *args,
                           "--out", str(tmp_path / "registers")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_thread_holds_what_its_warps_leave_it(tmp_path):
    """64 K registers a multiprocessor: at most 64 a thread at 32 warps, 255 at 8 (the cubin's
    count, not a guess); a block of 32768 columns at 32 warps does not fit them and spills."""
    result = registers(tmp_path, "--passes", "full", "--configs", "4096/8,32768/32")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {(r["block"], r["softcap"]): r for r in
            json.loads((tmp_path / "registers.json").read_text())["results"]}
    assert len(rows) == 4
    for softcap in (False, True):
        assert 0 < rows[4096, softcap]["registers"] <= 255
        assert rows[4096, softcap]["stack_bytes"] == 0
        assert 0 < rows[32768, softcap]["registers"] <= 64
        assert rows[32768, softcap]["stack_bytes"] > 0
    table = (tmp_path / "registers.md").read_text()
    assert "| full | 32768/32 | on |" in table and "Target: sm_90" in table


def test_bad_arguments_are_named(tmp_path):
    bad = registers(tmp_path, "--passes", "ful")
    assert bad.returncode == 2 and "--passes: unknown ful" in bad.stderr
    interpreted = subprocess.run([sys.executable, "-m", "scripts.bench.kernel_registers"],
                                 cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
                                 capture_output=True, text=True, timeout=300)
    assert interpreted.returncode == 2 and "run without it" in interpreted.stderr
