"""Leaving a process that used gloo with several ranks without the interpreter's teardown.

DTensor's sharding caches (torch-internal, global) keep the device mesh, and through it its gloo
process groups, alive after destroy_process_group(). They are then destroyed during interpreter
finalization, where gloo intermittently aborts the process ("terminate called without an active
exception", SIGABRT): about one two-process CPU run in twenty with torch 2.13, after all the work
was done and written. Only such a process skips the teardown (os._exit), once its outputs are
flushed and closed; every other one exits normally, so atexit handlers (wandb's, a profiler's,
a user's) run."""

import logging
import os
import sys

_several_gloo_ranks = False


def note_process_group(backend: str, world_size: int) -> None:
    """Record a process group this process created: a gloo group of more than one rank makes
    exit_process() skip the interpreter's teardown."""
    global _several_gloo_ranks
    _several_gloo_ranks |= backend == "gloo" and world_size > 1


def exit_process(code: int) -> None:
    """sys.exit(code), or os._exit(code) after the streams are flushed when this process used
    gloo with several ranks (see the module's docstring)."""
    if not _several_gloo_ranks:
        sys.exit(code)
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
