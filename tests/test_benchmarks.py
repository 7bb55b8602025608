"""benchmarks/: README.md indexes every result kept there and in archive/, and every result path
the README, docs/ and the benchmarks' own READMEs cite exists (a result moved to archive/ takes its
citations with it)."""

import importlib
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
FRONT = [REPO / "README.md", *(REPO / "docs").glob("*.md")]  # what a reader is pointed to
CITING = [*FRONT, *BENCHMARKS.rglob("README.md"), *(REPO / "flce").glob("*.py"),
          *(REPO / "models").glob("*.py"), *(REPO / "scripts").glob("*.py")]
# A result file, or a folder of them (`benchmarks/x/`); output paths in usage examples
# (`--out benchmarks/train_h200`) have no suffix and are not results.
CITED = re.compile(r"benchmarks/[\w.*/-]*?(?:\.(?:md|json|png)\b|/(?=[`\s)]))")
# A report named without its folder (`flce_h200.md`, "train_2xh200.md against ..."): a citation
# too when benchmarks/ holds a report of that name.
BARE = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")


def test_every_cited_result_exists():
    missing = []
    for path in CITING:
        for cited in CITED.findall(path.read_text()):
            if not list(REPO.glob(cited.rstrip("/"))):
                missing.append(f"{path.relative_to(REPO)}: {cited}")
    assert missing == []


def test_the_index_names_every_result():
    index = (BENCHMARKS / "README.md").read_text()
    results = [p for folder in (BENCHMARKS, BENCHMARKS / "archive") for p in folder.iterdir()
               if p.suffix == ".md" and p.name != "README.md" or p.is_dir() and p.name != "archive"]
    prefix = lambda p: "archive/" if p.parent.name == "archive" else ""  # noqa: E731
    unindexed = [p.name for p in results
                 if f"`{prefix(p)}{p.name}{'/' if p.is_dir() else ''}`" not in index]
    assert unindexed == []
    # every JSON record has its markdown twin (what the index names)
    orphans = [p.name for p in BENCHMARKS.rglob("*.json") if not p.with_suffix(".md").exists()]
    assert orphans == []


# Cited reports measured before reports recorded a clean commit, or whose recorded command no
# longer runs (`python scripts/X.py` stops at the module guard; scripts.bench_X moved to
# scripts.bench.X). Each is to be re-measured from a clean commit with a command that runs today,
# or no longer cited; it then leaves this list (the test below fails while a listed report is
# already sound, so the list only shrinks).
AWAITING_REMEASUREMENT = {
    "layouts_2xh200.md", "loss_parallel_2xh200.md", "fsdp_scaling_2xh200/",  # two GPUs
    "flce_grad_gemms_dx_rows_h100.md",  # bare GEMMs, a clean tree the device recorded as dirty
}


def _command_problem(command: str) -> str:
    """Why a recorded command would not run today ("" if it would): its script is a module of
    this repository that exists and defines every --option the command passes (it, or a module
    of scripts/ it imports)."""
    words = shlex.split(command)
    for arguments_file in [w[1:] for w in words if w.startswith("@")]:  # @FILE: its arguments
        if not (REPO / arguments_file).is_file():
            return f"reads its arguments from {arguments_file}, which does not exist"
        words += shlex.split((REPO / arguments_file).read_text(), comments=True)
    if any(re.fullmatch(r"scripts/\w+\.py", w) for w in words):
        return "runs a script by its file path (scripts run as modules: python3 -m scripts.NAME)"
    if "-m" not in words:
        return "names no module (python3 -m scripts.NAME)"
    module = words[words.index("-m") + 1]
    spec = importlib.util.find_spec(module) if module.startswith("scripts.") else None
    if spec is None:
        return f"module {module} does not exist"
    source = Path(spec.origin).read_text()
    # options may be defined by a module of scripts/ it imports (bench.row_overlap's command
    # line serves bench.row_order too)
    for imported in re.findall(r"^from (scripts\.[\w.]+) import", source, re.M):
        source += Path(importlib.util.find_spec(imported).origin).read_text()
    unknown = [w.split("=")[0] for w in words if w.startswith("--")
               and f'"{w.split("=")[0]}"' not in source]
    return f"{module} has no option {', '.join(unknown)}" if unknown else ""


def _folder_provenance_problems(folder: Path) -> list[str]:
    """A cited folder of results (raw logs beside a README.md that tables them) has no JSON
    record: its README.md names the commit the runs came from, `git <hash>`, not a dirty tree."""
    readme = folder / "README.md"
    if not readme.is_file():
        return ["no README.md saying what the folder holds and where it came from"]
    commits = re.findall(r"\bgit ([0-9a-f]{7,40})\b(\+dirty)?", readme.read_text())
    if not commits or any(dirty for _, dirty in commits):
        return [f"its README.md names no clean commit ({'+dirty' if commits else 'no git <hash>'})"]
    return []


def _provenance_problems(report: Path) -> list[str]:
    if report.is_dir():
        return _folder_provenance_problems(report)
    twin = report.with_suffix(".json")
    if not twin.exists():
        return ["no JSON record (command, commit)"]
    meta = json.loads(twin.read_text()).get("meta", {})
    problems = []
    git = str(meta.get("git") or "")
    if not re.fullmatch(r"[0-9a-f]{7,40}", git) or meta.get("dirty") is not False:
        problems.append(f"not from a clean commit (git {git or 'absent'}, dirty "
                        f"{meta.get('dirty')})")
    problem = _command_problem(meta["command"]) if meta.get("command") else "no command recorded"
    return problems + ([problem] if problem else [])


def test_cited_reports_come_from_a_clean_commit_and_a_command_that_runs():
    cited = set()
    for path in FRONT:
        text = path.read_text()
        cited |= {c for c in CITED.findall(text) if (c.endswith(".md") or c.endswith("/"))
                  and "/archive/" not in c and c != "benchmarks/README.md"}
        cited |= {f"benchmarks/{name}" for name in BARE.findall(text)
                  if name != "README.md" and (BENCHMARKS / name).is_file()}
    problems = {Path(c).name + ("/" if c.endswith("/") else ""): _provenance_problems(REPO / c)
                for c in sorted(cited)}
    unsound = {name: why for name, why in problems.items() if why}
    assert {n: w for n, w in unsound.items() if n not in AWAITING_REMEASUREMENT} == {}
    assert sorted(AWAITING_REMEASUREMENT - set(unsound)) == [], "re-measured: drop from the list"


def test_a_report_named_without_its_folder_is_a_citation():
    assert BARE.findall("(`benchmarks/flce_h200.md`, `train_1b_1xh200.md`; train_2xh200.md)") == [
        "train_1b_1xh200.md", "train_2xh200.md"]
    assert BARE.findall("`archive/train_best_1xh200.md`, [loss.md](loss.md#x)") == ["loss.md"] * 2


def test_the_command_check_catches_what_no_longer_runs():
    assert _command_problem("python3 -m scripts.bench.flce --grid --seconds 0.5 --out x") == ""
    assert _command_problem("torchrun --nproc_per_node 2 -m scripts.bench.loss_parallel "
                            "--modes sequence --out x") == ""
    assert "file path" in _command_problem("python scripts/bench_flce.py --out x")
    assert "does not exist" in _command_problem("python3 -m scripts.bench_flce --grid")
    assert "no option --gird" in _command_problem("python3 -m scripts.bench.flce --gird")
    runs = "scripts/bench/peer_runs/llama_8b_2gpu.args"
    assert _command_problem(f"python3 -m scripts.bench.peers @{runs} --out x") == ""
    assert "does not exist" in _command_problem("python3 -m scripts.bench.peers @runs.args")


def test_a_cited_folder_needs_a_readme_naming_a_clean_commit(tmp_path):
    assert _folder_provenance_problems(tmp_path) == [
        "no README.md saying what the folder holds and where it came from"]
    (tmp_path / "README.md").write_text("# runs\n\nNVIDIA H200 · 2026-11-30\n")
    assert "no git <hash>" in _folder_provenance_problems(tmp_path)[0]
    (tmp_path / "README.md").write_text("NVIDIA H200 · git 89f160d+dirty\n")
    assert "+dirty" in _folder_provenance_problems(tmp_path)[0]
    (tmp_path / "README.md").write_text("NVIDIA H200 · git 89f160d (the commit sent)\n")
    assert _folder_provenance_problems(tmp_path) == []


def test_the_grid_report_is_its_json_and_the_readme_quotes_it():
    """benchmarks/flce_grid.md (and the H100's grids) is what scripts.lib.loss_grid renders from its
    JSON (no figure edited by hand), and README's results quote the H200 grid's geometric mean
    and fastest-count."""
    from scripts.lib.loss_grid import grid_markdown
    for name in ("flce_grid_h100", "flce_grid_small_h100", "flce_grid_small_host_ahead_h100",
                 "flce_grid_host_ahead_h100", "flce_grid_host_ahead_one_sleep_h100",
                 "flce_grid_host_ahead_busy_h100", "flce_grid"):
        record = json.loads((BENCHMARKS / f"{name}.json").read_text())
        report = grid_markdown(record["meta"], record["results"])
        assert (BENCHMARKS / f"{name}.md").read_text() == report, name
    geomean = re.search(r"geometric mean (\d\.\d{3})×", report).group(1)
    fastest = re.search(r"flce the fastest of [^:]+: (\d+) of (\d+) points", report).groups()
    readme = (REPO / "README.md").read_text()
    assert f"flce {geomean}× its bare GEMMs" in readme
    assert f"at {fastest[0]} of {fastest[1]} points" in readme


@pytest.mark.parametrize("name, module", [("flce_float8_grid", "float8_grid"),
                                          ("flce_float8_grid_h100", "float8_grid"),
                                          ("flce_float8_chunks_one_block_h100", "chunk_sizes"),
                                          ("flce_chunk_sizes_h200", "chunk_sizes"),
                                          ("flce_chunk_sizes_lean_h200", "chunk_sizes"),
                                          ("flce_chunk_sizes_v256000_h200", "chunk_sizes"),
                                          ("flce_chunk_sizes_more_h200", "chunk_sizes"),
                                          ("flce_grad_gemms_h200", "grad_gemms"),
                                          ("rows_kernel_tuning_512_4096_h200", "tune_rows_kernel"),
                                          ("rows_kernel_tuning_16_2048_h200", "tune_rows_kernel"),
                                          ("flce_row_overlap_h200", "row_overlap"),
                                          ("rows_kernel_tuning_h200", "tune_rows_kernel"),
                                          ("loss_kernels_h200", "loss_kernels"),
                                          ("loss_kernels_compile_h200", "loss_kernels"),
                                          ("loss_kernels_odd_vocab_h200", "loss_kernels"),
                                          ("loss_kernels_host_h200", "loss_kernels"),
                                          ("flce_row_order_h200", "row_order"),
                                          ("row_kernel_registers_sm90", "kernel_registers")])
def test_a_kernel_report_is_its_jsons_render(name, module):
    """These reports are what their benchmark renders from their JSON: no figure edited by hand
    (and a change to the rendering shows here)."""
    markdown = importlib.import_module(f"scripts.bench.{module}").markdown
    record = json.loads((BENCHMARKS / f"{name}.json").read_text())
    assert (BENCHMARKS / f"{name}.md").read_text() == markdown(record["meta"], record["results"])


FIGURE = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?)")


SHAPE = re.compile(r"\b(\d+)x(\d+)x(\d+)\b")  # a report's N x H x V, README's N×H×V


def _figures(text: str) -> set[float]:
    return {float(f.replace(",", "")) for f in FIGURE.findall(SHAPE.sub(r"\1×\2×\3", text))}


def test_the_readmes_figures_are_in_the_reports_it_cites():
    """Every figure in a result of README's table (tokens/s, ms, ratios, counts) is one its cited
    report states: a README figure that no report holds is stale or computed by hand."""
    unbacked, checked = [], 0
    for line in (REPO / "README.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        cited = re.findall(r"\]\((benchmarks/[^)]+)\)", cells[-1]) if len(cells) == 3 else []
        if not cited or cited == ["benchmarks/README.md"]:
            continue
        reports = [p for c in cited for p in
                   ([REPO / c] if (REPO / c).is_file() else sorted((REPO / c).rglob("*.md")))]
        held = set().union(*(_figures(p.read_text()) for p in reports))
        checked += 1
        unbacked += [f"{cells[0]}: {f}" for f in FIGURE.findall(cells[1])
                     if float(f.replace(",", "")) not in held]
    assert checked >= 8, "README's results table no longer reads as | what | result | report |"
    assert unbacked == []


def test_the_performance_pages_grid_table_is_the_reports():
    """docs/performance.md's table of the grid by tokens is the one in benchmarks/flce_grid.md."""
    def table(text):
        start = text.index("| N | geomean × its GEMMs |")
        return [line.replace("**", "") for line in text[start:].split("\n\n")[0].splitlines()]
    assert (table((REPO / "docs/performance.md").read_text())
            == table((BENCHMARKS / "flce_grid.md").read_text()))


def test_a_resumed_grid_names_each_runs_commit():
    """A grid joined from runs at two commits says which points each measured (one run: no line),
    and a report written before points named their run is dated by its meta on --resume."""
    from scripts.lib.loss_grid import resumed_runs
    point = lambda shape, git: {"shape": shape, "method": "bare_gemms", "git": git,
                                "date": f"d-{git}"}
    assert resumed_runs([point("1x2x3", "aaa"), point("4x5x6", "aaa")]) == []
    line = resumed_runs([point("1x2x3", "aaa"), point("4x5x6", "aaa"), point("7x8x9", "bbb"),
                         {"shape": "7x8x9", "method": "flce"}])[0]
    assert line == ("Measured in runs resumed one after another: 2 points at git aaa (d-aaa); "
                    "1 point at git bbb (d-bbb).")


def test_a_whole_grid_report_names_the_points_it_has_not_measured_yet():
    """A --grid report without --shapes that lacks some of the grid's points (a call cut short,
    to be resumed) names them, so its counts are not read as the whole grid's; a report of the
    shapes given (--shapes) or of every point has no such line."""
    from scripts.lib.loss_grid import grid_shapes, unmeasured_lines
    shapes = grid_shapes()
    results = [{"shape": s, "method": m} for s in shapes[:-2] for m in ("bare_gemms", "flce")]
    whole = {"command": "python3 -m scripts.bench.flce --grid --resume --out x"}
    line = unmeasured_lines(whole, results)[0]
    assert line == (f"Not measured yet: 2 of the grid's {len(shapes)} points ({shapes[-2]}, "
                    f"{shapes[-1]}); every figure below is over the other {len(shapes) - 2}.")
    assert unmeasured_lines({"command": whole["command"] + " --shapes 2048x1024x32000"},
                            results) == []
    every = [{"shape": s, "method": "bare_gemms"} for s in shapes]
    assert unmeasured_lines(whole, every) == []


def test_a_grid_resumed_with_remeasure_measures_those_points_again_in_their_rows():
    """--resume keeps an earlier report's points and measures the rest; with --remeasure the
    shapes given are measured again, their earlier records dropped, and a point measured last
    goes back to its row (by N, H, V), so the table keeps the grid's order. A report of
    another GPU (torch, triton, dtype, timing) is not resumed."""
    from scripts.bench.flce import grid_plan, in_grid_order, timing_meta
    record = lambda shape, method: {"shape": shape, "method": method}  # noqa: E731
    setup = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "dtype": "bfloat16"}
    earlier = {"meta": {**setup, "git": "aaa", "date": "d-aaa"},
               "results": [record(s, m) for s in ("2x1x3", "2x1x30", "16x1x3")
                           for m in ("bare_gemms", "flce")]}
    kept, todo = grid_plan(json.loads(json.dumps(earlier)), ["2x1x30", "16x1x3", "16x2x3"], False,
                           setup)
    assert todo == ["16x2x3"] and len(kept) == 6
    assert all(r["git"] == "aaa" for r in kept if r["method"] == "bare_gemms")
    kept, todo = grid_plan(json.loads(json.dumps(earlier)), ["2x1x30", "16x2x3"], True, setup)
    assert todo == ["2x1x30", "16x2x3"]
    assert [r["shape"] for r in kept] == ["2x1x3", "2x1x3", "16x1x3", "16x1x3"]
    assert grid_plan(None, ["2x1x3"], False, setup) == ([], ["2x1x3"])
    refused = "earlier report's gpu is 'NVIDIA H200', this run's 'NVIDIA H100"
    with pytest.raises(SystemExit, match=refused):
        grid_plan(earlier, ["2x1x3"], False, {**setup, "gpu": "NVIDIA H100 80GB HBM3"})
    # a report from before --host-ahead was timed synchronised: not resumed with the host ahead
    with pytest.raises(SystemExit, match="host_ahead is False, this run's True"):
        grid_plan(earlier, ["2x1x3"], False, {**setup, "host_ahead": True})
    assert len(grid_plan(earlier, ["2x1x3"], False, {**setup, "host_ahead": False})[0]) == 6
    # nor one whose GPU slept ahead of each timed call (each run its own sleep, or one for
    # all) with the GEMMs that keep it busy
    ahead = {**earlier, "meta": {**earlier["meta"], "host_ahead": True}}
    with pytest.raises(SystemExit, match="ahead_fill is None, this run's 'GEMMs, one length"):
        grid_plan(ahead, ["2x1x3"], False, {**setup, **timing_meta(True)})
    one_sleep = {**earlier, "meta": {**ahead["meta"], "ahead_sleep": "one a point"}}
    with pytest.raises(SystemExit, match="ahead_fill is None, this run's 'GEMMs, one length"):
        grid_plan(one_sleep, ["2x1x3"], False, {**setup, **timing_meta(True)})
    # nor one whose extra memory was the allocated bytes with the requested ones
    with pytest.raises(SystemExit, match="targets is 'extra memory = peak allocated"):
        allocated = {**earlier["meta"], "targets": "extra memory = peak allocated"}
        grid_plan({**earlier, "meta": allocated}, ["2x1x3"], False,
                  {**setup, "targets": "extra memory = peak bytes requested"})
    again = [record("2x1x30", "bare_gemms"), record("2x1x30", "flce")]
    ordered = [(r["shape"], r["method"]) for r in in_grid_order(kept + again)]
    assert ordered == [("2x1x3", "bare_gemms"), ("2x1x3", "flce"), ("2x1x30", "bare_gemms"),
                       ("2x1x30", "flce"), ("16x1x3", "bare_gemms"), ("16x1x3", "flce")]
