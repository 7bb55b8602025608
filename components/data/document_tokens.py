"""Texts to framed token ids, [bos] + ids + [eos] per document, a batch of documents at a time: on
the calling thread, or in worker processes that run ahead of the training loop.

Workers are forked on Linux, as torch's DataLoader does (they touch no CUDA; "spawn" would import
the launching script, train.py and all, into every worker), spawned elsewhere. Each worker is one
single-threaded tokenizer; several run side by side."""

import contextlib
import gc
import multiprocessing
import os
import signal
import sys
import weakref
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterator

import numpy as np

from components import lock
from components.data.checks import MissingTextField

Framed = tuple[np.ndarray, np.ndarray]  # the documents' tokens concatenated (int32), their lengths


def frame_texts(tokenizer, texts: list, first_document: int = 0, max_token_id: int | None = None,
                text_field: str = "text") -> Framed:
    """first_document numbers the documents in errors."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"document {first_document + i}: field {text_field!r} holds "
                            f"{type(text).__name__}, not text")
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    flat, lengths = [], []
    for ids in tokenizer.encode_batch(texts):
        flat.append(bos)
        flat += ids
        flat.append(eos)
        lengths.append(len(ids) + 2)
    tokens = np.array(flat, dtype=np.int32)
    lengths = np.array(lengths, dtype=np.int64)
    if max_token_id is not None and tokens.size and int(tokens.max()) >= max_token_id:
        at = int(np.flatnonzero(tokens >= max_token_id)[0])
        document = first_document + int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        raise ValueError(f"document {document}: token id {int(tokens[at])} is out of range for the "
                         f"model's vocab size {max_token_id} (the tokenizer's vocab size is "
                         f"{tokenizer.vocab_size})")
    return tokens, lengths


# What a worker keeps between tasks (set by _start_worker in each worker process).
_worker: dict = {}


def _start_worker(parent: int, tokenizer, documents, text_field: str, max_token_id: int | None) -> None:
    bind_to_parent(parent)  # else, after kill -9, it kept run.lock held and the resume out
    # The trainer decides when to stop (Ctrl-C, SLURM's USR1 warning) and ends its workers then;
    # a forked worker would otherwise run the trainer's own handlers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; the workers are the parallelism
    _worker.update(tokenizer=tokenizer, documents=documents, text_field=text_field,
                   max_token_id=max_token_id)


def bind_to_parent(parent: int) -> None:
    """In a forked worker (the trainer's tokenizers, prepare_data's): close the inherited lock
    descriptors and die with the parent. A worker of a parent killed with kill -9 would otherwise
    live on under PID 1, idle on its task queue or still writing, and keep the parent's lock held.
    On Linux the kernel kills it with the process that forked it (the thread, in fact: pools fork
    from the thread that makes them, which lives as long)."""
    lock.close_inherited()
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl
        os._exit(1)


def texts_of_rows(documents, rows: list[int], text_field: str, first_document: int) -> list:
    if text_field not in documents.column_names:
        raise MissingTextField(f"document {first_document} has no field {text_field!r} (its fields: "
                               f"{', '.join(documents.column_names)})")
    return documents[rows][text_field]


def _frame_task(first_document: int, rows: list[int] | None, texts: list | None) -> Framed:
    if texts is None:  # rows of the worker's own copy of a memory-mapped dataset
        texts = texts_of_rows(_worker["documents"], rows, _worker["text_field"], first_document)
    return frame_texts(_worker["tokenizer"], texts, first_document, _worker["max_token_id"],
                       _worker["text_field"])


def worker_context() -> multiprocessing.context.BaseContext:
    return multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")


@contextlib.contextmanager
def inherited_objects_frozen():
    """Around the call that forks the workers: the objects they inherit are never collected in
    them. A forked worker that garbage-collects its parent's objects runs their finalizers
    without the parent's threads, and some abort then ("terminate called after throwing an
    instance of 'std::system_error'", seen with a parent running telemetry threads): the
    pattern the `gc.freeze` documentation gives for fork without exec."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class TokenizerPool:
    """num_workers processes framing batches of documents, given as texts or, for a map-style
    `datasets.Dataset` (memory-mapped, so each worker opens it cheaply), as row numbers. Results
    come back in the order submitted; up to `ahead` batches are in flight. A worker that dies
    (killed, out of memory) is an error, not a wait that never ends."""

    def __init__(self, tokenizer, num_workers: int, documents=None, text_field: str = "text",
                 max_token_id: int | None = None, ahead: int | None = None):
        self._executor = ProcessPoolExecutor(num_workers, mp_context=worker_context(), initializer=_start_worker,
                                             initargs=(os.getpid(), tokenizer, documents, text_field, max_token_id))
        with inherited_objects_frozen():
            self._executor.submit(int).result()  # the workers start now, from this thread
        self.ahead = ahead or 4 * num_workers
        # Shut down with this object (a trainer may end with os._exit, skipping atexit).
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)

    def map(self, tasks: Iterator[tuple]) -> Iterator[tuple]:
        """For each (key, first_document, rows, texts) task, (key, framed), in order; the tasks
        are drawn only as far as `ahead` batches beyond what has been consumed."""
        pending = deque()
        try:
            for key, first_document, rows, texts in tasks:
                pending.append((key, self._executor.submit(_frame_task, first_document, rows, texts)))
                if len(pending) >= self.ahead:
                    key, future = pending.popleft()
                    yield key, future.result()
            while pending:
                key, future = pending.popleft()
                yield key, future.result()
        except BrokenProcessPool as e:
            raise RuntimeError("a tokenizer worker process died (killed, or out of memory?); [data] "
                               "num_workers = 0 tokenizes without workers") from e

    def close(self) -> None:
        """Cancel what is queued, let each worker finish its batch, and end them."""
        self._finalizer.detach()
        self._executor.shutdown(wait=True, cancel_futures=True)


def frame_inline(tokenizer, tasks: Iterator[tuple], documents=None, text_field: str = "text",
                 max_token_id: int | None = None) -> Iterator[tuple]:
    """TokenizerPool.map's results on the calling thread."""
    for key, first_document, rows, texts in tasks:
        if texts is None:
            texts = texts_of_rows(documents, rows, text_field, first_document)
        yield key, frame_texts(tokenizer, texts, first_document, max_token_id, text_field)
