"""Training data: documents from Hugging Face `datasets`, framed as [bos] + tokens + [eos], concatenated
and cut into windows of seq_len + 1 tokens; every data-parallel rank reads its own share of the documents.

Document i of a split goes to rank i % dp_world, and document i of the source is held out for validation
when i % val_every == 0 (unless the source has a real validation split). Both rules are the same with and
without streaming, so a run reads the same windows either way. Documents are read in order, not
shuffled: for real pretraining, tokenize once into token shards (scripts.prepare_data), which
build_data reads through components/shard_batches.py in a shuffled, layout-independent order.
"""

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator, Protocol

import datasets
import numpy as np
import torch

from components.config.schema import Data
from components.data_check import MissingTextField, check_files
from components.document_tokens import Framed, TokenizerPool, frame_inline
from components.prefetch import Prefetched
from components.shard_batches import build_shard_batches
from components.shards import is_shard_folder
from components.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/flce-recipes"
BUILDER_BY_SUFFIX = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SPLITS = ("train", "validation")

STDLIB_CORPUS_BYTES = 6 * 2**20
# Tests and test data are skipped because they are full of deliberately odd code and binary-ish fixtures;
# idlelib, turtledemo and lib2to3 are applications or legacy tools rather than library code.
STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                                 "turtledemo", "lib2to3", "__pycache__"})

DOCUMENTS_PER_TASK = 32  # documents tokenized together (one task of a worker)

Documents = datasets.Dataset | datasets.IterableDataset
Window = tuple[torch.Tensor, torch.Tensor]


def embedded_corpus(cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """A JSON-lines corpus of this Python's standard library sources: every machine with the same Python
    version builds the same file without a download."""
    cache_dir = Path(cache_dir).expanduser()
    path = cache_dir / f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}.jsonl"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Several ranks may build it at once: each writes its own temporary file and the rename is atomic,
    # so no reader ever sees half a corpus.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for relative_path, text in _stdlib_sources():
                f.write(json.dumps({"text": text, "path": relative_path}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _stdlib_sources() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # os.walk rather than rglob, so the skipped directories (site-packages is huge) are never entered.
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in STDLIB_SKIPPED_DIRS]
        for name in names:
            if name.endswith(".py"):
                file = Path(directory, name)
                files.append((file.relative_to(root).as_posix(), file))
    total_bytes = 0
    for relative_path, file in sorted(files):
        try:
            data = file.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():  # empty __init__.py files would only add bos/eos pairs
            continue
        if total_bytes + len(data) > STDLIB_CORPUS_BYTES:
            return
        total_bytes += len(data)
        yield relative_path, text


def load_documents(source: str, split: str, text_field: str = "text", streaming: bool = False,
                   val_every: int = 100, cache_dir: str | Path = DEFAULT_CACHE_DIR,
                   on_bad_document: str = "error") -> Documents:
    """source: "stdlib", a local .txt/.jsonl/.json/.parquet file or a directory of them, or a Hugging Face
    Hub dataset name (needs network access). A .txt file gives one document per paragraph (blank-line
    separated). split: "train" or "validation", or another split the source really has.
    on_bad_document: what a document of a local .jsonl/.json/.txt file that is not UTF-8, not JSON or
    without the text field does: "error" names it, "skip" leaves it out with a warning."""
    if val_every < 2:
        raise ValueError(f"val_every={val_every}: must be >= 2 (1 would hold out every document)")
    cache_dir = Path(cache_dir).expanduser()
    splits = _load_splits(source, streaming, cache_dir, text_field, on_bad_document)
    documents = _pick_split(splits, split, val_every, source)
    columns = documents.column_names  # None for some streams; then TokenWindows checks the first document
    if columns is not None and text_field not in columns:
        raise MissingTextField(f"{source}: the documents have no field {text_field!r} (their fields: "
                               f"{', '.join(columns)}); set [data] text_field")
    return documents


def _load_splits(source: str, streaming: bool, cache_dir: Path, text_field: str, on_bad_document: str):
    if source == "stdlib":
        return _load_local([embedded_corpus(cache_dir)], streaming, cache_dir)
    path = Path(source).expanduser()
    if path.exists():
        files = check_files(_data_files(path), text_field, on_bad_document, cache_dir)
        return _load_local(files, streaming, cache_dir)
    if source.startswith(("/", "./", "../", "~")) or path.suffix in BUILDER_BY_SUFFIX:
        raise FileNotFoundError(f"data source not found: {path}")
    try:
        return datasets.load_dataset(source, streaming=streaming)
    except Exception as err:
        raise ValueError(
            f"could not load data source {source!r}: it is not a local path, and loading it as a Hugging "
            f"Face Hub dataset failed ({type(err).__name__}: {err}). Hub names need network access (or the "
            f"dataset already in the local HF cache); offline, use a local .jsonl/.json/.txt/.parquet file "
            f"or directory, or \"stdlib\"") from err


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        files = [path]
    else:
        # Hidden directories hold caches and VCS data, not documents.
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDER_BY_SUFFIX
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise FileNotFoundError(f"{path}: no {'/'.join(BUILDER_BY_SUFFIX)} files in this directory")
    suffixes = sorted({p.suffix for p in files})
    if any(s not in BUILDER_BY_SUFFIX for s in suffixes):
        raise ValueError(f"{path}: unsupported file type {suffixes[0]!r}; expected one of "
                         f"{', '.join(BUILDER_BY_SUFFIX)}")
    if len({BUILDER_BY_SUFFIX[s] for s in suffixes}) > 1:
        raise ValueError(f"{path}: mixes file types {', '.join(suffixes)}; one directory must hold one kind")
    return files


def _load_local(files: list[Path], streaming: bool, cache_dir: Path):
    builder = BUILDER_BY_SUFFIX[files[0].suffix]
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    # Arrow caches of local files go next to the corpus, not into the shared Hugging Face cache.
    with _no_progress_bars():
        return datasets.load_dataset(builder, data_files=[str(f) for f in files],
                                     streaming=streaming, cache_dir=str(cache_dir / "datasets"),
                                     **options)


@contextlib.contextmanager
def _no_progress_bars():
    """datasets' "Generating train split" bar, drawn when local files first go into its Arrow
    cache, lands in the training log between the config and step 1, where it reads as trouble
    (and check_files has just read the files without one). Off for these calls only."""
    already_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not already_off:
            datasets.enable_progress_bars()


def _pick_split(splits, split: str, val_every: int, source: str) -> Documents:
    if split in splits and (split != "train" or "validation" in splits):
        return splits[split]
    if split not in SPLITS:
        raise ValueError(f"{source}: no split {split!r} (it has {', '.join(splits)}); use one of "
                         f"{', '.join(SPLITS)}")
    if "train" not in splits:
        raise ValueError(f"{source}: no 'train' split to hold validation documents out of "
                         f"(it has {', '.join(splits)})")
    documents = _hold_out(splits["train"], val_every, validation=(split == "validation"))
    if split == "train" and isinstance(documents, datasets.Dataset) and not len(documents):
        raise ValueError(f"{source}: no training documents: it has one, and document 0 always goes to "
                         f"the held-out validation split (so does every [data] val_every-th)")
    return documents


def _is_held_out(_example: dict, index: int, val_every: int, validation: bool) -> bool:
    return (index % val_every == 0) == validation


def _is_rank_share(_example: dict, index: int, dp_rank: int, dp_world: int) -> bool:
    return index % dp_world == dp_rank


def _hold_out(documents: Documents, val_every: int, validation: bool) -> Documents:
    if isinstance(documents, datasets.IterableDataset):
        # The index counts the whole stream, because TokenWindows splits streams by example (not by
        # file shard) after this filter.
        keep = functools.partial(_is_held_out, val_every=val_every, validation=validation)
        return documents.filter(keep, with_indices=True)
    held_out = np.arange(len(documents)) % val_every == 0
    return documents.select(np.flatnonzero(held_out if validation else ~held_out))


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
                 num_workers: int = 0, name: str = "the documents"):
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
        self._documents = documents
        if isinstance(documents, datasets.IterableDataset):
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
                raise ValueError(f"data state does not match the documents: document {expected[1]} of "
                                 f"epoch {expected[0]} on rank {self.dp_rank} has "
                                 f"{lengths[0] if (self._epoch, self._document) == expected else 0} "
                                 f"tokens, the state points at token {self._resume_offset}")
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
                    raise ValueError(f"data-parallel rank {self.dp_rank} of {self.dp_world} gets no "
                                     f"documents from the stream")
            epoch, document = epoch + 1, 0
            logger.info("data: rank %d read all its documents; epoch %d starts", self.dp_rank, epoch)

    def _text_of(self, example: dict, document: int):
        if self.text_field not in example:
            raise MissingTextField(f"document {document} has no field {self.text_field!r} (its fields: "
                                   f"{', '.join(example)}); set [data] text_field")
        return example[self.text_field]

    def state_dict(self) -> dict:
        if self._tokens is None:
            document, token_offset = self._document, self._token_offset
        else:
            within = int(np.searchsorted(self._ends, self._position, side="right"))
            document = self._document + within
            token_offset = self._position - (int(self._ends[within - 1]) if within else 0)
        return {"epoch": self._epoch, "document": document, "token_offset": token_offset,
                "dp_rank": self.dp_rank, "dp_world": self.dp_world}

    def read_more_than_once(self, state: dict) -> list[str]:
        """[the source's name] when this rank had begun reading its documents again at the state."""
        return [self.name] if state["epoch"] > 0 else []

    def load_state_dict(self, state: dict) -> None:
        if not {"epoch", "document", "token_offset", "dp_rank", "dp_world"} <= set(state):
            raise ValueError(f"data state of another kind of source (keys {sorted(state)}), not text documents")
        if (state["dp_rank"], state["dp_world"]) != (self.dp_rank, self.dp_world):
            raise ValueError(f"data state was saved by rank {state['dp_rank']} of {state['dp_world']}, "
                             f"this is rank {self.dp_rank} of {self.dp_world}: the document shares differ")
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


def build_data(data: Data, *, split: str, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
               dp_rank: int = 0, dp_world: int = 1, seed: int = 0,
               max_token_id: int | None = None) -> Batches | Prefetched:
    """The batches of one split of the [data] section's source: synthetic tokens; token shards
    (a folder made by scripts.prepare_data, or a [[data.mixture]] of such folders); or text
    documents, tokenized by data.num_workers worker processes (0: by the loading thread;
    validation always is, it reads little). Shards and text are made ahead by a background
    thread (components/prefetch.py)."""
    if data.synthetic:
        vocab_size = max_token_id if max_token_id is not None else tokenizer.vocab_size
        # Validation gets its own stream so it never scores the windows it trained on.
        split_seed = seed if split == "train" else seed + 1
        windows = SyntheticTokens(vocab_size, seq_len, split_seed, dp_rank, dp_world, local_batch_size)
        return Batches(windows, local_batch_size)
    if data.mixture or is_shard_folder(data.source):
        for part in data.mixture:
            if not is_shard_folder(part.source):
                raise ValueError(f"[[data.mixture]] source {part.source!r}: not a token shard folder (a "
                                 f"mixture mixes folders made by scripts.prepare_data)")
        sources = [(m.source, m.weight) for m in data.mixture] or [(data.source, 1.0)]
        return Prefetched(build_shard_batches(
            sources=sources, split=split, tokenizer=tokenizer, seq_len=seq_len,
            local_batch_size=local_batch_size, seed=seed, dp_rank=dp_rank, dp_world=dp_world,
            max_token_id=max_token_id))
    documents = load_documents(data.source, split, text_field=data.text_field, streaming=data.streaming,
                               val_every=data.val_every, cache_dir=data.cache_dir,
                               on_bad_document=data.on_bad_document)
    windows = TokenWindows(documents, tokenizer, seq_len, dp_rank=dp_rank, dp_world=dp_world,
                           max_token_id=max_token_id, text_field=data.text_field,
                           num_workers=data.num_workers if split == "train" else 0,
                           name=f"{data.source} ({split})")
    return Prefetched(Batches(windows, local_batch_size))
