"""The benchmarks' command lines: --resume, the no-GPU message, the one shape parser."""

import importlib
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.lib import loss_grid

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["report", "report_v1.5"])
@pytest.mark.parametrize("module, args", [("flce", ["--grid"]), ("float8_grid", [])])
def test_a_grid_without_resume_leaves_an_existing_report_alone(module, args, name, tmp_path,
                                                               monkeypatch, capsys):
    """The grids' default --out is the committed report: a run without --resume rewrote it
    point by point, one point at the first. A dotted --out (report_v1.5) is the report
    report_v1.5.json, not report_v1.json."""
    report = tmp_path / f"{name}.json"
    report.write_text('{"meta": {}, "results": []}')
    monkeypatch.setattr(sys, "argv", [module, *args, "--out", str(tmp_path / name)])
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"scripts.bench.{module}").main()
    assert exit_.value.code == 2 and report.read_text() == '{"meta": {}, "results": []}'
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: {report} exists: --resume measures the points it lacks, --out names a new "
        "report (a fresh grid would replace it point by point)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("module, args", [
    ("attention", []), ("chunk_sizes", ["--points", "64x8x32:16"]), ("flce", []),
    ("float8_dx", ["--shapes", "64x8x32"]), ("float8_grid", []),
    ("grad_gemms", ["--chunks", "16x8x32"]), ("logits_epilogue", []),
    ("loss_kernels", ["--shapes", "64x8x32"]), ("row_overlap", ["--shapes", "64x8x32"]),
    ("step_floor", []), ("tune_rows_kernel", [])])
def test_a_gpu_benchmark_without_a_gpu_says_so_in_one_line(module, args, tmp_path, monkeypatch,
                                                           capsys):
    """Each said it with an AssertionError's traceback (and under python3 -O, with the assert
    gone, failed later in CUDA's generator). In this process (a subprocess apiece spent most of
    the time importing torch), but for one under python3 -O: no assert does the check."""
    message = (f"error: scripts.bench.{module} times CUDA kernels and needs a CUDA GPU; torch "
               f"{torch.__version__} sees none\n")
    command = [*args, "--out", str(tmp_path / "report")]
    if module == "flce":
        result = subprocess.run([sys.executable, "-O", "-m", "scripts.bench.flce", *command],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr == message
    monkeypatch.setattr(sys, "argv", [module, *command])
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"scripts.bench.{module}").main()
    assert exit_.value.code == 2 and capsys.readouterr().err == message


def test_the_benchmarks_read_their_shapes_with_one_parser(tmp_path, monkeypatch, capsys):
    """bench.flce, float8_grid, logits_epilogue, loss_kernels, loss_parallel, row_overlap,
    row_order (NxHxV), attention (BxHQxHKVxTxD), grad_gemms (CxHxV) and chunk_sizes
    (NxHxV:C1/C2/...) each split their shapes themselves; most with a ValueError's traceback for
    a bad one (after measuring the shapes before it), and those that checked refused a size
    below 1 (a rule all of them keep now). A list keeps each shape as given: the reports' key."""
    from argparse import ArgumentTypeError
    parse_shape, parse_shapes = loss_grid.parse_shape, loss_grid.parse_shapes
    assert parse_shape("16384x8192x256000") == (16384, 8192, 256000)
    assert parse_shape("4x32x8x8192x64", "BxHQxHKVxTxD") == (4, 32, 8, 8192, 64)
    assert parse_shape("64x8x32:16/8", "NxHxV:C1/C2/...") == (64, 8, 32, [16, 8])
    assert parse_shapes("8192x2048x128256,64x8x32") == ["8192x2048x128256", "64x8x32"]
    assert parse_shapes(" 64x8x32") == [" 64x8x32"]  # int()'s spaces, accepted as before
    assert [parse_shape(s) for s in loss_grid.grid_shapes()] == list(itertools.product(
        loss_grid.GRID_N, loss_grid.GRID_H, loss_grid.GRID_V))
    assert loss_grid.parse_sizes("8192,32768") == [8192, 32768]
    for bad, form, why in [("16384x8192", "NxHxV", "is not NxHxV"),
                           ("16384x8192x256000x1", "NxHxV", "is not NxHxV"),
                           ("8x4xa", "NxHxV", "is not NxHxV"), ("", "NxHxV", "is not NxHxV"),
                           ("8x4x2:16", "NxHxV", "is not NxHxV"),
                           ("8x0x2", "NxHxV", "has a size below 1"),
                           ("8x-4x2", "CxHxV", "has a size below 1"),
                           ("4x32x8x8192", "BxHQxHKVxTxD", "is not BxHQxHKVxTxD"),
                           ("8x4x2", "NxHxV:C1/C2/...", "is not NxHxV:C1/C2/..."),
                           ("8x4x2:16:8", "NxHxV:C1/C2/...", "is not NxHxV:C1/C2/..."),
                           ("8x4x2:16/", "NxHxV:C1/C2/...", "is not NxHxV:C1/C2/..."),
                           ("8x4x2:16/-1", "NxHxV:C1/C2/...", "has a size below 1")]:
        good = {"BxHQxHKVxTxD": "1x2x1x8x4", "NxHxV:C1/C2/...": "64x8x32:16"}.get(form, "64x8x32")
        with pytest.raises(ArgumentTypeError) as error:
            parse_shapes(f"{good},{bad}", form)  # the bad one named, not the list
        assert str(error.value) == f"{bad!r} {why}"
    # on the command line: argparse's one-line error naming the option and the value, exit 2
    for module, args, line in [
            ("flce", ["--shapes", "8192x2048x128256,16384x8192"],
             "error: argument --shapes: '16384x8192' is not NxHxV"),
            ("grad_gemms", ["--chunks", "16x8x0"],
             "error: argument --chunks: '16x8x0' has a size below 1"),
            ("chunk_sizes", ["--points", "64x8x32"],
             "error: argument --points: '64x8x32' is not NxHxV:C1/C2/..."),
            ("attention", ["--shapes", "4x32x8x8192"],
             "error: argument --shapes: '4x32x8x8192' is not BxHQxHKVxTxD"),
            ("tune_rows_kernel", ["--vocab", "32000,0"],
             "error: argument --vocab: '0' has a size below 1"),
            ("tune_rows_kernel", ["--rows", "8192,4k"],
             "error: argument --rows: '4k' is not a size")]:
        # in this process (each module's main parses before it asks for a GPU): a subprocess
        # apiece spent most of this test importing torch again
        bench = importlib.import_module(f"scripts.bench.{module}")
        monkeypatch.setattr(sys, "argv", [module, *args, "--out", str(tmp_path / "report")])
        with pytest.raises(SystemExit) as exit_:
            bench.main()
        assert exit_.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(line)
