"""Warnings every rank would give alike, given once: a warning of category SameOnEveryRank (the
tokenizer file's settings, the environment [comm] replaces, a checkpoint folder skipped, a data
order changed at resume) comes from rank 0 alone while a run holds `said_by_rank_zero`. Other
warnings stay on every rank: what one of them says is about that rank (its data shard, its
lock)."""

import warnings
from contextlib import contextmanager
from typing import Iterator


class SameOnEveryRank(UserWarning):
    """A warning whose text is the same on every rank of a run."""


@contextmanager
def said_by_rank_zero(rank: int) -> Iterator[None]:
    """On ranks other than 0, SameOnEveryRank warnings are dropped; the filters are put back as
    they were when the run returns (a caller in the same process keeps its own)."""
    with warnings.catch_warnings():
        if rank != 0:
            warnings.filterwarnings("ignore", category=SameOnEveryRank)
        yield
