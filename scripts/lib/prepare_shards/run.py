"""The whole run, in the main process: the settings prepare.json records, resuming (the finished
units, the plan checked against these settings, one run per folder), the worker pool, index.json.
Everything a rerun of the same command needs to carry on is on disk, read here."""

import contextlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path

from components import lock
from components.data import SPLITS
from components.data.checks import DOCUMENT_RULES, NAMED
from components.data.document_reader import BadDocumentError
from components.data.document_tokens import inherited_objects_frozen, worker_context
from components.data.shards import (FORMAT, INDEX, PLAN, VERSION, ShardFormatError,
                                    token_dtype)
from components.synced_files import write_json_synced
from scripts.lib.prepare_shards.units import PrepareError, Unit
from scripts.lib.prepare_shards.worker import UNITS, _start_job, missing_field, prepare_unit


def tokenizer_record(tokenizer, name: str, path: str | None) -> dict:
    return {"fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "name": name,
            "path": str(Path(path).expanduser().resolve()) if path else None}


def settings_for(tokenizer: dict, text_field: str, val_every: int, on_bad_document: str,
                 unit_bytes: int, source: dict) -> dict:
    return {"format": FORMAT, "version": VERSION, "documents": DOCUMENT_RULES, "tokenizer": tokenizer,
            "text_field": text_field, "val_every": val_every, "on_bad_document": on_bad_document,
            "unit_bytes": unit_bytes, "dtype": token_dtype(tokenizer["vocab_size"]).name, "source": source}


def without_path(record: dict | None) -> dict | None:
    return None if record is None else {k: v for k, v in record.items() if k != "path"}


def _differences(old: dict, new: dict, keys=("tokenizer", "text_field", "val_every", "on_bad_document",
                                             "unit_bytes", "dtype")) -> list[str]:
    out = []
    # a tokenizer is its tokens and ids (the fingerprint), not where its file lies: the same
    # file copied elsewhere, or its folder given instead, was refused as other settings
    same = lambda key: (without_path(old.get(key)) == without_path(new.get(key))  # noqa: E731
                        if key == "tokenizer" else old.get(key) == new.get(key))
    for key in keys:
        if not same(key):
            if key == "tokenizer":
                what = lambda t: f"{t.get('path') or t.get('name')} (vocab {t.get('vocab_size')})"  # noqa: E731
                out.append(f"tokenizer: {what(old[key])} -> {what(new[key])}"
                           + (" with the same name but other tokens or bos/eos" if what(old[key]) == what(new[key])
                              else ""))
            else:
                out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return out


def _finished_units(out: Path) -> set[str]:
    """The units whose report is written, which happens once their shards are finished."""
    return {p.stem for p in (out / UNITS).glob("*.json")}


def reconcile(out: Path, settings: dict, units: list[Unit], files: dict | None) -> list[Unit]:
    """The units of this folder: those of prepare.json when the folder was begun with the same
    settings (a changed file whose units are all still to do is planned again), else these."""
    plan_path = out / PLAN
    if not plan_path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        write_json_synced(plan_path, {**settings, "units": [asdict(u) for u in units]},
                          atomic=True)
        return units
    plan = json.loads(plan_path.read_text())
    differences = _differences(plan, settings)
    old_files, new_files = plan["source"].get("files"), (files or {})
    if files is not None and old_files is not None and sorted(old_files) != sorted(new_files):
        differences.append(f"source files: {len(old_files)} -> {len(new_files)} (added: "
                           f"{sorted(set(new_files) - set(old_files))[:3]}, gone: "
                           f"{sorted(set(old_files) - set(new_files))[:3]})")
    elif files is None and plan["source"] != settings["source"]:
        differences.append(f"source: {plan['source']} -> {settings['source']}")
    done = _finished_units(out)
    begun_under = plan.get("documents", 1)  # a folder of before the key: rules 1
    if begun_under != settings["documents"] and any(u["name"] not in done for u in plan["units"]):
        raise PrepareError(f"{out} was begun by an older prepare_data, which counted other texts as "
                           f"documents (document rules {begun_under}, now {settings['documents']}: empty texts and "
                           f"whitespace-only .txt paragraphs are no documents now), and is unfinished: write to "
                           f"another --out (or delete {out}: it holds only this preparation's work)")
    if differences:
        raise PrepareError(f"{out} was begun with other settings ({'; '.join(differences)}): finish it with "
                           f"the arguments it was begun with, or write to another --out (or delete {out}: it holds only "
                           f"this preparation's work)")
    planned = [Unit(**u) for u in plan["units"]]
    if files is not None:
        for path, stat in new_files.items():
            if old_files[path] == stat:
                continue
            mine = [u for u in planned if u.path == path]
            if any(u.name in done for u in mine):
                raise PrepareError(f"{path} changed after some of its units were tokenized into {out}: "
                                   f"write to another --out (or remove {out})")
            fresh = [u for u in units if u.path == path]
            planned = [u for u in planned if u.path != path] + fresh
            planned.sort(key=lambda u: u.name)
        if planned != [Unit(**u) for u in plan["units"]] or old_files != new_files:
            write_json_synced(plan_path, {**settings, "units": [asdict(u) for u in planned]},
                              atomic=True)
    return planned


def _clean_leftovers(out: Path) -> None:
    """Temporary files of a killed run (their units are not done, so they are tokenized again)."""
    for folder in (*SPLITS, UNITS):
        for leftover in (out / folder).glob("*.tmp"):
            leftover.unlink()


def _check_ours(out: Path) -> None:
    """Refuse a folder of the user's (files, no prepare.json): they would mix with the shards,
    and a later run with other settings is refused with "delete it: it holds only this
    preparation's work". Empty, or holding only a killed run's lock, it is written."""
    if out.exists() and not out.is_dir():  # mkdir's FileExistsError was a traceback
        raise PrepareError(f"{out} is a file, not a folder: --out names the folder to write the "
                           "shards into; give a new or empty folder")
    if not out.is_dir() or (out / PLAN).is_file():
        return
    theirs = sorted(p.name for p in out.iterdir() if p.name != "prepare.lock")
    if theirs:
        shown = ", ".join(theirs[:5]) + (f", ... ({len(theirs)} in all)" if len(theirs) > 5 else "")
        raise PrepareError(f"{out} holds {shown} and no {PLAN}: not a folder prepare_data began; "
                           "write to a new or empty --out")


@contextlib.contextmanager
def _locked(out: Path):
    """One run per folder: prepare.lock names its holder; a killed holder's lock (its workers die
    with it and never hold it) is taken over with a warning naming it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission: a traceback before
        raise PrepareError(f"--out {out}: cannot make the folder ({e.strerror or e})") from None
    path = out / "prepare.lock"
    fd = lock.lock_file(path, lambda holder: PrepareError(
        f"{out} is being written by another prepare_data.py run ({holder}; lock file {path}): "
        "wait for it to end or write to another --out"))
    try:
        yield
    finally:
        lock.release(fd)


@dataclass
class Plan:
    """What a prepare run tokenizes: its units of work, the settings prepare.json records
    (settings_for) and what the units read: the local files (their listing), or the Hugging
    Face dataset (load_hf's {split: dataset})."""
    units: list[Unit]
    settings: dict
    files: dict | None = None
    dataset: object = None


def prepare(out: Path, plan: Plan, tokenizer, workers: int, progress_bar: bool = True,
            log=print) -> dict:
    """Tokenize what is not done yet and write index.json; returns the index."""
    settings = plan.settings
    _check_ours(out)
    with _locked(out):
        units = reconcile(out, settings, plan.units, plan.files)
        _clean_leftovers(out)
        done = _finished_units(out)
        todo = [u for u in units if u.name not in done]
        if not todo and (out / INDEX).is_file():
            try:
                index = json.loads((out / INDEX).read_text())
                log(f"{out}: complete already, nothing to do")
                return index
            except ValueError:  # damaged: written again from the units below
                log(f"{out / INDEX} is damaged: writing it again from the finished units")
        if todo:
            log(f"{out}: {len(todo)} of {len(units)} units to tokenize with {min(workers, len(todo))} "
                f"worker process(es)" + (f" ({len(units) - len(todo)} done before)" if done else ""))
            _run(out, todo, settings, tokenizer, workers, plan.dataset, progress_bar)
        return write_index(out, units, settings, log)


def _run(out: Path, todo: list[Unit], settings: dict, tokenizer, workers: int, dataset,
         progress_bar: bool) -> None:
    context = worker_context()
    progress, tokens = context.Value("q", 0), context.Value("q", 0)
    job = dict(out=out, settings=settings, tokenizer=tokenizer, dataset=dataset, progress=progress,
               progress_tokens=tokens, parent=os.getpid())
    bar = None
    if progress_bar:
        from tqdm import tqdm

        # In a log file (not a terminal) a line every 30 s rather than a redraw every 0.1 s.
        bar = tqdm(total=sum(u.size for u in todo) or None,  # None: streamed, size unknown
                   unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing",
                   dynamic_ncols=True, mininterval=1 if sys.stderr.isatty() else 30)
    started = time.time()

    def show_progress():
        if bar is not None:
            bar.set_postfix_str(f"{tokens.value / max(time.time() - started, 1e-9):,.0f} tokens/s",
                                refresh=False)
            bar.update(progress.value - bar.n)

    with ProcessPoolExecutor(min(workers, len(todo)), mp_context=context, initializer=_start_job,
                             initargs=(job,)) as pool:
        try:
            with inherited_objects_frozen():  # the first submit forks every worker
                futures = [pool.submit(prepare_unit, u) for u in todo]
            wait_in_order(futures, show_progress)
        finally:
            if bar is not None:
                bar.close()


def wait_in_order(futures: list, show_progress=lambda: None) -> None:
    """Waits for the units' futures (listed in the files' order). A worker's error is raised
    here; a bad document's names the first bad document in the files' order, not whichever
    worker came upon one first: the units before it still run (one may hold an earlier one),
    the later ones that have not started are cancelled."""
    order = {future: i for i, future in enumerate(futures)}
    pending, first_bad = set(futures), None
    try:
        while pending:
            finished, pending = wait(pending, timeout=0.2)
            for future in finished:
                try:
                    future.result()
                except BrokenProcessPool as e:
                    raise PrepareError("a worker process died (killed, or out of memory?); the same "
                                       "command resumes (fewer --workers or a smaller --unit-mb need "
                                       "less memory)") from e
                except BadDocumentError as e:
                    if first_bad is None or order[future] < first_bad[0]:
                        first_bad = (order[future], e)
            if first_bad is not None:
                pending = {f for f in pending if order[f] < first_bad[0] or not f.cancel()}
            show_progress()
    finally:
        for future in pending:
            future.cancel()
    if first_bad is not None:
        raise first_bad[1]


def write_index(out: Path, units: list[Unit], settings: dict, log=print) -> dict:
    reports = [json.loads((out / UNITS / f"{u.name}.json").read_text()) for u in units]
    files = _file_tallies(units, reports)
    splits = {}
    for split in SPLITS:
        shards = [{"file": f"{split}/{r['unit']}.tokens.npy", **r["splits"][split]} for r in reports]
        for shard in shards:
            if not (out / shard["file"]).is_file():
                raise ShardFormatError(f"{out / shard['file']} is missing, though its unit is marked done: "
                                       f"remove {out / UNITS}/{Path(shard['file']).name.split('.')[0]}.json "
                                       f"and run again to redo it")
        splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                         "documents": sum(s["documents"] for s in shards),
                         "shards": [s for s in shards if s["tokens"]]}
    _refuse_files_without_the_field(files, settings["text_field"])
    if not splits["train"]["tokens"]:
        raise PrepareError(f"{out}: no training documents in the source"
                           + (f" ({sum(r['bad'] for r in reports)} bad ones were skipped)"
                              if any(r["bad"] for r in reports) else ""))
    bad = sum(r["bad"] for r in reports)
    index = {**{k: settings[k] for k in ("format", "version", "dtype", "tokenizer", "val_every",
                                          "text_field", "source")},
             "max_token_id": max(r["max_token_id"] for r in reports),
             "splits": splits, "skipped_documents": bad,
             "skipped_named": [n for r in reports for n in r["named"]][:NAMED],
             "created": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    write_json_synced(out / INDEX, index, atomic=True)
    # a local file among several that held no document, good or bad: the trainer warns of it
    # (checks.check_files); prepare_data said nothing
    if len(files) > 1:
        for path, tally in files.items():
            if not tally["good"] + tally["bad"] and os.path.isfile(path):
                log(f"note: {path} holds no documents"
                    + (" (the file is empty)" if os.path.getsize(path) == 0 else ""))
    return index


def _file_tallies(units: list[Unit], reports: list[dict]) -> dict[str, dict]:
    """Per local file (a dataset's rows and streams left out): its units' good and bad
    documents, those bad for lacking the text field, and the first such document's fields."""
    files: dict[str, dict] = {}
    for unit, report in zip(units, reports):
        if unit.kind in ("rows", "stream"):
            continue
        tally = files.setdefault(unit.path, {"kind": unit.kind, "good": 0, "bad": 0,
                                             "without_field": 0, "fields": []})
        tally["good"] += sum(split["documents"] for split in report["splits"].values())
        tally["bad"] += report["bad"]
        tally["without_field"] += report.get("without_field", 0)  # an older unit's: unknown
        tally["fields"] = tally["fields"] or report.get("fields", [])
    return files


def _refuse_files_without_the_field(files: dict[str, dict], text_field: str) -> None:
    """A file none of whose documents has the text field is the wrong --text-field, not bad
    documents: an error naming the file and --text-field, as the trainer's (checks.check_files),
    under --on-bad-document skip too (every document was skipped, and the error was "no training
    documents", or the file was left out while the others were tokenized)."""
    for path, tally in files.items():
        if (tally["kind"] in ("jsonl", "json") and not tally["good"] and tally["without_field"]
                and tally["without_field"] == tally["bad"]):
            raise missing_field(path, text_field, tally["fields"])


def usable_cpus() -> int:
    """The CPUs this process may run on (os.sched_getaffinity is Linux-only)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
