"""Text documents as training windows: each framed as [bos] + tokens + [eos] (document_tokens.py),
concatenated and cut into windows of seq_len + 1 tokens; every data-parallel rank reads its own
share of the documents (document i goes to rank i % dp_world). Documents are read in order, not
shuffled: for real pretraining, tokenize once into token shards (scripts.prepare_data), which
shard_batches.py reads in a shuffled, layout-independent order. Also synthetic windows, and the
batches (Batches) that stack a source's windows.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from typing import TYPE_CHECKING, Iterator, Protocol

import numpy as np
import torch

from components.data.checks import MissingTextField
from components.data.document_tokens import Framed, TokenizerPool, frame_inline
from components.data.sources import is_stream
from components.tokenizer import Tokenizer

if TYPE_CHECKING:
    from components.data.sources import Documents

DOCUMENTS_PER_TASK = 32  # documents tokenized together (one task of a worker)

Window = tuple[torch.Tensor, torch.Tensor]


class DataStateMismatch(ValueError):
    """A resumed text source whose saved position does not fit its documents (found at the first
    batch, in the data thread)."""
    user_error = True  # one line and exit status 2 from train.py, no traceback


class EmptyStreamShare(ValueError):
    """A rank's share of a streamed source holds no document (found at the first batch, in the
    data thread: a stream's length is known only by reading it)."""
    user_error = True  # one line and exit status 2 from train.py, no traceback


def _is_rank_share(_example: dict, index: int, dp_rank: int, dp_world: int) -> bool:
    return index % dp_world == dp_rank


class WindowSource(Protocol):
    def __next__(self) -> Window: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TokenWindows:
    """Yields (inputs, labels), each a torch.long tensor of shape [seq_len], forever: when this rank's
    documents run out a new epoch goes over them again in the same order.

    Documents are tokenized DOCUMENTS_PER_TASK at a time: on the calling thread, or with
    num_workers > 0 in that many worker processes running ahead (the calling thread then only
    cuts windows). Either way the windows are the same.

    The state is the position of the next unread token (epoch, document within this rank's share, token
    offset within that document's [bos] + tokens + [eos]), so it stays a few ints however long the
    documents are; resuming re-tokenizes from that document on."""

    def __init__(self, documents: Documents, tokenizer: Tokenizer, seq_len: int, dp_rank: int = 0,
                 dp_world: int = 1, max_token_id: int | None = None, text_field: str = "text",
                 num_workers: int = 0, name: str = "the documents", selection: dict | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank}, dp_world={dp_world}: need 0 <= dp_rank < dp_world")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers}: must be >= 0")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.max_token_id = max_token_id
        self.text_field = text_field
        self.num_workers = num_workers
        self.name = name  # the source, in messages
        # What picks the documents of `documents` besides the source's path (which may move),
        # e.g. {"val_every": 10}: saved with the position, which means nothing under another.
        self.selection = {"text_field": text_field, **(selection or {})}
        self._documents = documents
        if is_stream(documents):
            # By example, so document i of the stream goes to rank i % dp_world as without
            # streaming (split_dataset_by_node's strategy="examples" needs datasets >= 5).
            self._stream = documents.filter(functools.partial(
                _is_rank_share, dp_rank=dp_rank, dp_world=dp_world), with_indices=True)
            self._share = None
        else:
            self._stream = None
            self._share = range(dp_rank, len(documents), dp_world)
            if not self._share:
                raise ValueError(f"data-parallel rank {dp_rank} of {dp_world} gets no documents: there are "
                                 f"only {len(documents)} (for a held-out validation split, a smaller "
                                 f"[data] val_every holds out more)")
        # Workers read the rows of a map-style dataset themselves; a stream is read here.
        self._pool = TokenizerPool(tokenizer, num_workers, documents if self._stream is None else None,
                                   text_field, max_token_id) if num_workers else None
        self._move_to(epoch=0, document=0, token_offset=0)

    def _move_to(self, epoch: int, document: int, token_offset: int) -> None:
        self._epoch = epoch
        self._document = document
        self._token_offset = token_offset
        self._resume_offset = token_offset  # where the first document read from here starts
        self._tokens: np.ndarray | None = None  # the documents being read, concatenated
        self._ends: np.ndarray | None = None  # where each of them ends in _tokens
        self._position = 0  # the next token in _tokens
        self._reader: Iterator[tuple[tuple[int, int], Framed]] | None = None

    def __iter__(self) -> "TokenWindows":
        return self

    def __next__(self) -> Window:
        window = torch.from_numpy(self._take(self.seq_len + 1).astype(np.int64))
        return window[:-1], window[1:]

    def next_windows(self, count: int) -> torch.Tensor:
        """The next `count` windows as one [count, seq_len + 1] tensor (consecutive in the stream)."""
        tokens = self._take(count * (self.seq_len + 1)).astype(np.int64)
        return torch.from_numpy(tokens).view(count, self.seq_len + 1)

    def _take(self, count: int) -> np.ndarray:
        pieces = []
        while count:
            if self._tokens is None:
                self._read_next_documents()
            piece = self._tokens[self._position:self._position + count]
            pieces.append(piece)
            count -= piece.size
            self._position += piece.size
            if self._position == self._tokens.size:
                self._document += self._ends.size
                self._token_offset = 0
                self._tokens = None
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _read_next_documents(self) -> None:
        if self._reader is None:
            tasks = self._tasks_from(self._epoch, self._document)
            self._reader = (self._pool.map(tasks) if self._pool is not None else
                            frame_inline(self.tokenizer, tasks, self._documents, self.text_field,
                                         self.max_token_id))
        expected = (self._epoch, self._document)
        (self._epoch, self._document), (tokens, lengths) = next(self._reader)
        if self._resume_offset:
            if (self._epoch, self._document) != expected or self._resume_offset >= lengths[0]:
                raise DataStateMismatch(
                    f"the data state does not match {self.name}: document {expected[1]} of epoch "
                    f"{expected[0]} on rank {self.dp_rank} has "
                    f"{lengths[0] if (self._epoch, self._document) == expected else 0} tokens, the "
                    f"state points at token {self._resume_offset}. Has [data] source changed "
                    "since the checkpoint? Resume with the documents it was trained on, or start "
                    "a new run from its weights with [checkpoint] initial_load_path")
            self._position, self._resume_offset = self._resume_offset, 0
        else:
            self._position = 0
        self._tokens, self._ends = tokens, np.cumsum(lengths)

    def _tasks_from(self, epoch: int, document: int) -> Iterator[tuple]:
        """(key, first document, rows, texts) for each batch of documents from the position on:
        the key (epoch, document) marks where the batch starts."""
        while True:
            if self._share is not None:
                for first in range(document, len(self._share), DOCUMENTS_PER_TASK):
                    rows = list(self._share[first:first + DOCUMENTS_PER_TASK])
                    yield (epoch, first), first, rows, None
            else:
                # No set_epoch: in datasets 5 a nonzero epoch reorders the stream's file shards even
                # without shuffle(), which would move documents between the train and validation splits.
                stream = iter(self._stream)
                skipped = sum(1 for _ in itertools.islice(stream, document))
                if skipped < document:  # a stream's length is known only by reading it
                    raise ValueError(f"data state points at document {document} of epoch {epoch}, but rank "
                                     f"{self.dp_rank}'s share of the stream holds {skipped} documents (has the "
                                     "source changed since the checkpoint?)")
                count = document
                for examples in _batched(stream, DOCUMENTS_PER_TASK):
                    texts = [self._text_of(example, count + i) for i, example in enumerate(examples)]
                    yield (epoch, count), count, None, texts
                    count += len(examples)
                if count == 0:
                    raise EmptyStreamShare(
                        f"data-parallel rank {self.dp_rank} of {self.dp_world} gets no documents "
                        "from the stream (the held-out validation split takes document 0 and every "
                        "[data] val_every-th: a source of one document leaves none to train on)")
            epoch, document = epoch + 1, 0

    def _text_of(self, example: dict, document: int):
        if self.text_field not in example:
            raise MissingTextField(f"document {document} has no field {self.text_field!r} (its fields: "
                                   f"{', '.join(example)})")
        return example[self.text_field]

    def state_dict(self) -> dict:
        if self._tokens is None:
            document, token_offset = self._document, self._token_offset
        else:
            within = int(np.searchsorted(self._ends, self._position, side="right"))
            document = self._document + within
            token_offset = self._position - (int(self._ends[within - 1]) if within else 0)
        return {"epoch": self._epoch, "document": document, "token_offset": token_offset,
                "dp_rank": self.dp_rank, "dp_world": self.dp_world, "selection": self.selection}

    def read_more_than_once(self, state: dict) -> list[str]:
        """[the source's name] when this rank had begun reading its documents again at the state."""
        return [self.name] if state["epoch"] > 0 else []

    def epochs(self, state: dict) -> dict[str, int]:
        """{the source's name: the epoch this rank reads at the state}."""
        return {self.name: state["epoch"]}

    def load_state_dict(self, state: dict) -> None:
        if not {"epoch", "document", "token_offset", "dp_rank", "dp_world"} <= set(state):
            raise ValueError(f"data state of another kind of source (keys {sorted(state)}), not text documents")
        if (state["dp_rank"], state["dp_world"]) != (self.dp_rank, self.dp_world):
            raise ValueError(f"data state was saved by rank {state['dp_rank']} of {state['dp_world']}, "
                             f"this is rank {self.dp_rank} of {self.dp_world}: the document shares differ")
        saved = state.get("selection", self.selection)  # states saved before it was kept have none
        if saved != self.selection:
            changed = ", ".join(f"[data] {k} {saved.get(k)!r} -> {self.selection.get(k)!r}"
                                for k in sorted(set(saved) | set(self.selection))
                                if saved.get(k) != self.selection.get(k))
            raise ValueError(f"data state was saved reading other documents ({changed})")
        if self._share is not None and not 0 <= state["document"] <= len(self._share):
            raise ValueError(f"data state points at document {state['document']}, but rank {self.dp_rank} "
                             f"has {len(self._share)} documents")
        self._move_to(int(state["epoch"]), int(state["document"]), int(state["token_offset"]))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def _batched(items, size: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


class SyntheticTokens:
    """Uniformly random windows, for throughput runs and layout-equivalence tests.

    Each window is drawn from its own seed, derived from (seed, its index in the global batch
    stream): window j of rank r's local batch at step s is global window
    s * (dp_world * local_batch_size) + r * local_batch_size + j. So a run on 2 ranks with local
    batch 2 sees exactly the windows of 1 rank with local batch 4, and resuming jumps straight
    to window n."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, dp_rank: int = 0,
                 dp_world: int = 1, local_batch_size: int = 1):
        if vocab_size < 1 or seq_len < 1:
            raise ValueError(f"vocab_size={vocab_size}, seq_len={seq_len}: both must be >= 1")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.local_batch_size = local_batch_size
        self._windows = 0
        self._generator = torch.Generator()

    def __iter__(self) -> "SyntheticTokens":
        return self

    def global_index(self, local_index: int) -> int:
        step, j = divmod(local_index, self.local_batch_size)
        return (step * self.dp_world + self.dp_rank) * self.local_batch_size + j

    def __next__(self) -> Window:
        key = f"{self.seed}/{self.global_index(self._windows)}".encode()
        self._generator.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
        window = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=self._generator)
        self._windows += 1
        return window[:-1], window[1:]

    def state_dict(self) -> dict:
        return {"windows": self._windows, "dp_rank": self.dp_rank, "dp_world": self.dp_world,
                "local_batch_size": self.local_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if "windows" not in state:  # another kind of source's: the caller resumes by step
            raise ValueError(f"the data state holds {sorted(state)}, not synthetic tokens' count "
                             "of windows")
        saved = (state.get("dp_rank", self.dp_rank), state.get("dp_world", self.dp_world),
                 state.get("local_batch_size", self.local_batch_size))
        if saved != (self.dp_rank, self.dp_world, self.local_batch_size):
            raise ValueError(f"synthetic data state saved by rank {saved[0]} of {saved[1]} with "
                             f"local batch {saved[2]}; this is rank {self.dp_rank} of "
                             f"{self.dp_world} with local batch {self.local_batch_size}")
        self._windows = int(state["windows"])


class Batches:
    """Stacks local_batch_size consecutive windows into ([B, seq_len], [B, seq_len]). Batches are whole
    windows, so the window source's state after batch n is exactly the state before batch n + 1."""

    def __init__(self, windows: WindowSource, local_batch_size: int):
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size={local_batch_size}: must be >= 1")
        self.windows = windows
        self.local_batch_size = local_batch_size

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> Window:
        if isinstance(self.windows, TokenWindows):  # consecutive windows: one slice of the stream
            windows = self.windows.next_windows(self.local_batch_size)
            return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        pairs = [next(self.windows) for _ in range(self.local_batch_size)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def state_dict(self) -> dict:
        return self.windows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.windows.load_state_dict(state)

    def read_more_than_once(self, state: dict | None = None) -> list[str]:
        """The sources of which more was read up to the state (default: now) than they hold
        (none for synthetic tokens, which never repeat)."""
        state = self.state_dict() if state is None else state
        if isinstance(self.windows, TokenWindows):
            return self.windows.read_more_than_once(state)
        return []

    def epochs(self, state: dict) -> dict[str, int]:
        """{source: the epoch read at the state} (none for synthetic tokens)."""
        return self.windows.epochs(state) if isinstance(self.windows, TokenWindows) else {}

    def resume_at_batch(self, n_batches: int) -> None:
        """Position a synthetic stream after n_batches of this rank, whatever layout saved the
        checkpoint (its windows are indexed globally). Text streams cannot be re-sharded."""
        if not isinstance(self.windows, SyntheticTokens):
            raise ValueError("only synthetic data can be positioned by step under a new layout")
        self.windows._windows = n_batches * self.local_batch_size

    def describe(self) -> str:
        if isinstance(self.windows, TokenWindows):
            workers = self.windows.num_workers
            return ("data: text documents, tokenized " + (f"by {workers} worker processes" if workers
                                                          else "on the loading thread"))
        return "data: synthetic tokens"

    def close(self) -> None:
        """Stop the tokenizer workers, if any."""
        if isinstance(self.windows, TokenWindows):
            self.windows.close()
