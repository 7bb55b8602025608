"""The test launcher of tests/launches.py: what a crashed rank's failure says, and the one more
launch after a crash in native code."""

import os
import subprocess
import sys

import pytest

from launches import LAUNCH_ENV, errors, launch

CRASH_ONCE = """import ctypes, sys
from pathlib import Path

dump, marker = Path(sys.argv[1]), Path(sys.argv[2])
if not marker.exists():
    marker.touch()
    (dump / "partial").write_text("by the launch that crashed")
    ctypes.string_at(0)
(dump / "written").write_text("by the second launch")
"""


def test_errors_name_the_signal_and_stack_of_a_crashed_rank(tmp_path):
    """A rank that died of SIGSEGV (under CP x TP on a CPU machine) printed nothing before
    torchrun's report, and the failure read "torchrun exited 1: " alone."""
    script = tmp_path / "crash.py"
    script.write_text("import ctypes\n\n\ndef crash():\n    ctypes.string_at(0)\n\n\ncrash()\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "1", str(script)], env={**os.environ, **LAUNCH_ENV},
                         timeout=120, capture_output=True, text=True)
    assert run.returncode != 0
    message = errors(run.stderr)
    assert "SIGSEGV" in message and "in crash" in message, message


def test_a_launch_that_crashed_in_native_code_runs_again_from_its_start(tmp_path):
    script, marker, dump = tmp_path / "crash_once.py", tmp_path / "crashed", tmp_path / "run"
    script.write_text(CRASH_ONCE)
    dump.mkdir()
    (dump / "earlier").write_text("kept")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "1", str(script), str(dump), str(marker)]
    with pytest.warns(UserWarning, match="crashed in native code.*Segmentation fault"):
        run = launch(command, dump)
    assert run.returncode == 0, errors(run.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crash_once.py", "crashed", "run"]
    assert sorted(p.name for p in dump.iterdir()) == ["earlier", "written"]
    assert (dump / "earlier").read_text() == "kept"
    # a rank that fails without crashing is not launched again
    script.write_text("import sys\nopen(sys.argv[2] + '.runs', 'a').write('x')\nraise SystemExit(3)\n")
    assert launch(command, dump).returncode != 0
    assert (tmp_path / "crashed.runs").read_text() == "x"
