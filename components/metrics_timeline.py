"""metrics.jsonl read back as the run's timeline. Never imports torch: scripts read it too.

A resumed run appends to its folder's metrics.jsonl from its checkpoint's step on, so a step below
the file's last one starts the timeline again from there: the earlier lines of the steps after it
belong to a timeline the run abandoned (a rollback to an older checkpoint, or a kill after the
last save), even where the resumed run stopped before reaching them. Where the file went on past
the checkpoint, the resumed run's first line is {"step": <the checkpoint's>, "resumed": true}
(its own first step may be log_freq steps on, past some abandoned ones), and also where the file
ends in a line cut short (a kill or a full disk mid-write): that line stays as it was, the resumed
run's lines start on a new line after it, and `records` skips it. The trainer's summary, its
resume checks, `compare_losses` and the benchmarks' readers all see the same steps."""

import json
from pathlib import Path
from typing import Iterable, Iterator


def records(path: Path) -> Iterator[dict]:
    """The file's JSON objects, in order; nothing where it cannot be read. A line that is not
    JSON (one cut short by a kill) is left out."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield record
    except OSError:
        return


def is_step(step) -> bool:
    return isinstance(step, int) and not isinstance(step, bool)


def timeline(logged: Iterable[dict]) -> dict[int, dict]:
    """{step: its values} of records in the order they were logged, as the run's timeline has
    them: a step below the previous record's drops every later step logged so far; a step logged
    again (a validation line after the training line, a resumed run's repeat) keeps each key's
    last value. Records without an integer "step" are skipped."""
    steps: dict[int, dict] = {}
    previous = None
    for record in logged:
        step = record.get("step")
        if not is_step(step):
            continue
        if previous is not None and step < previous:
            for abandoned in [s for s in steps if s > step]:
                del steps[abandoned]
        previous = step
        steps.setdefault(step, {}).update(record)
    return steps
