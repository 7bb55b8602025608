"""Batches made ahead by a background thread, so the training loop only takes a finished one.

The copies that build a batch run in numpy and torch without the GIL, and so does the Hugging
Face tokenizer: the thread works while the training thread launches kernels or waits for the
GPU. The state is the one after the last batch the loop took, so a checkpoint resumes where
training is, not where the thread has got to.

With note_epochs, a source read to its end (the training data repeats) is noted on rank 0 when
the loop takes the batch that starts its next epoch: the thread reads ahead, and the trainer
configures no logging, so a log record from there would show nowhere, or too early."""

import os
import queue
import threading
import weakref

_DONE = object()  # what the thread sends instead of a batch when it failed: (_DONE, the error)


class Prefetched:
    def __init__(self, batches, depth: int = 2, note_epochs: bool = False):
        self.batches = batches
        self.depth = depth
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue | None = None
        self._note_epochs = note_epochs and int(os.environ.get("RANK", "0")) == 0
        self._set_state(batches.state_dict())

    def _set_state(self, state: dict) -> None:
        """The state of the last batch taken, and the epochs it is in (a resumed run notes only
        the epochs it starts)."""
        self._state = state
        if self._note_epochs:
            self._epochs = self.batches.epochs(state)

    def __iter__(self) -> "Prefetched":
        return self

    def __next__(self):
        if self._thread is None:
            self._start()
        batch, state = self._queue.get()
        if batch is _DONE:
            self._thread = None
            raise state
        if self._note_epochs:
            self._note_new_epochs(state)
        self._state = state
        return batch

    def _note_new_epochs(self, state: dict) -> None:
        for source, epoch in self.batches.epochs(state).items():
            before = self._epochs.get(source)
            if before is None or epoch == before:  # None: a source smaller than a batch, noted
                continue
            if epoch > before + 1:  # a note a batch would flood the log
                print(f"note: data: {source} is read to its end several times a batch (epoch {epoch} "
                      "starts): the training data repeats within every batch; a larger source "
                      "would not (no more notes of its epochs)", flush=True)
                self._epochs[source] = None
            else:
                print(f"note: data: {source} is read to its end; epoch {epoch} starts: the training "
                      "data repeats (a larger source or fewer [training] steps would not)", flush=True)
                self._epochs[source] = epoch

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(self.depth)
        # The thread holds the batches, not this object: once this object is gone, it stops.
        self._thread = threading.Thread(target=_produce, args=(self.batches, self._queue, self._stop),
                                        name="data-prefetch", daemon=True)
        # Stopped and joined when this object is collected, and at the latest at interpreter exit
        # (atexit, before daemon threads are cut off): an error that ends the run without
        # close() (a failed save) leaves the thread running, and Python 3.11 ends a daemon
        # thread that wants the GIL back during finalization with pthread_exit; inside a torch
        # op that unwinds through C++ frames and aborts the process (SIGABRT, "terminate called
        # without an active exception") after the error was reported.
        weakref.finalize(self, _stop_and_join, self._stop, self._thread)
        self._thread.start()

    def _halt(self) -> None:
        """Stop the thread and drop what it made: the batches are made again from the state."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        self._halt()
        self.batches.load_state_dict(state)
        self._set_state(self.batches.state_dict())

    def resume_at_batch(self, n_batches: int) -> None:
        self._halt()
        self.batches.resume_at_batch(n_batches)
        self._set_state(self.batches.state_dict())

    def read_more_than_once(self) -> list[str]:
        """The sources read more than once up to the last batch taken (not the thread's)."""
        return self.batches.read_more_than_once(self._state)

    def describe(self) -> str:
        return self.batches.describe()

    def close(self) -> None:
        self._halt()
        self.batches.close()


def _stop_and_join(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread() and thread.ident is not None:
        thread.join(timeout=60)  # the batch in the making, then it sees stop


def _produce(batches, out: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            item = (next(batches), batches.state_dict())
        except BaseException as e:  # raised in the training thread by __next__
            item = (_DONE, e)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if item[0] is _DONE:
            return
