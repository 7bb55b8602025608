"""Token shards: a folder of memory-mappable token arrays that scripts.prepare_data writes and
the trainer reads (`[data] source = "<folder>"`).

    <folder>/index.json                    the header, written last: a folder without it is unfinished
    <folder>/train/00000.tokens.npy        1-D uint16 (vocab <= 65536) or uint32 token ids: the
                                           documents of work unit 0, each [bos] + tokens + [eos]
    <folder>/train/00000.docs.npy          1-D int64 offsets, documents + 1 of them: document i is
                                           tokens[offsets[i]:offsets[i + 1]]
    <folder>/validation/00000.*.npy        the held-out documents of unit 0, the same way
    <folder>/units/00000.json              unit 0 is complete (what prepare_data.py resumes from)
    <folder>/prepare.json                  the settings and work units (written first)

Both arrays are plain .npy files: `np.load(path, mmap_mode="r")` reads them anywhere. index.json:

    {"format": "flce-token-shards", "version": 1, "dtype": "uint16", "max_token_id": 32767,
     "tokenizer": {"fingerprint": "<sha256 of the vocabulary and bos/eos ids>", "vocab_size": 32768,
                   "bos_id": 1, "eos_id": 2, "name": "hf", "path": "/abs/tokenizer.json"},
     "val_every": 100, "text_field": "text",
     "splits": {"train": {"tokens": ..., "documents": ..., "shards": [{"file": "train/00000.tokens.npy",
                                                                       "tokens": ..., "documents": ...}]},
                "validation": {...}},
     "source": {...}, "created": "..."}

A split's token stream is its shards' tokens concatenated in the listed order. A document goes to
validation when the hash of its text falls in 1/val_every of the range, so copies of a document
land in the same split and the two splits never share one.
"""

import json
import mmap
import os
import resource
from pathlib import Path

import numpy as np

from components.synced_files import sync, tmp_sibling

FORMAT = "flce-token-shards"
VERSION = 1
INDEX = "index.json"
PLAN = "prepare.json"


class ShardFormatError(ValueError):
    user_error = True  # one line and exit status 2 from train.py, no traceback


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def is_shard_folder(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_dir() and ((path / INDEX).is_file() or (path / PLAN).is_file())


def read_index(folder: str | Path) -> dict:
    folder = Path(folder).expanduser()
    if not (folder / INDEX).is_file():
        if (folder / PLAN).is_file():
            raise ShardFormatError(f"{folder}: unfinished token shards (no {INDEX}): run "
                                   f"scripts.prepare_data again with the same arguments to finish them")
        raise ShardFormatError(f"{folder}: not a token shard folder (no {INDEX}); make one with "
                               f"scripts.prepare_data")
    try:
        index = json.loads((folder / INDEX).read_text())
        index.get("format")
    except (ValueError, AttributeError) as e:  # cut short, or not JSON at all
        raise ShardFormatError(f"{folder / INDEX}: damaged, not a token shard index ({e}); "
                               f"prepare the folder again (scripts.prepare_data with the same "
                               f"arguments rewrites it)") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ShardFormatError(f"{folder}/{INDEX}: format {index.get('format')!r} version "
                               f"{index.get('version')!r}; this trainer reads {FORMAT!r} version {VERSION}")
    for split in index.get("splits", {}).values():  # (a shard may be a link to another disk)
        for shard in split.get("shards", []):
            file = str(shard.get("file", ""))
            if Path(file).is_absolute() or ".." in Path(file).parts:
                raise ShardFormatError(f"{folder}/{INDEX}: names shard {file!r}, outside the folder; "
                                       "not reading it")
    return index


def check_tokenizer(index: dict, tokenizer, folder: str | Path, what: str = "[tokenizer]") -> None:
    """The shards' ids must mean what the tokenizer's ids mean, framed by the same bos/eos."""
    made = index["tokenizer"]
    if made["fingerprint"] != tokenizer.fingerprint():
        given = getattr(tokenizer, "path", None) or type(tokenizer).__name__
        raise ShardFormatError(
            f"{folder}: its shards were made with another tokenizer ({made.get('path') or made.get('name')}, "
            f"vocab {made['vocab_size']}, bos {made['bos_id']}, eos {made['eos_id']}) than {what} gives "
            f"({given}, vocab {tokenizer.vocab_size}, bos {tokenizer.bos_id}, eos {tokenizer.eos_id}): use "
            f"that tokenizer, or prepare the shards again with this one")


class ShardWriter:
    """Writes one shard's two arrays as documents come, under temporary names that finish()
    renames: a shard under its final name is always whole."""

    def __init__(self, stem: Path, dtype: np.dtype):
        self.stem = stem
        self.dtype = np.dtype(dtype)
        stem.parent.mkdir(parents=True, exist_ok=True)
        self._tokens_tmp = tmp_sibling(self.tokens_path)
        self._file = open(self._tokens_tmp, "wb")
        self._header_bytes = self._write_header(0)
        self._offsets = [np.zeros(1, np.int64)]
        self._count = 0

    @property
    def tokens_path(self) -> Path:
        return self.stem.with_name(self.stem.name + ".tokens.npy")

    @property
    def docs_path(self) -> Path:
        return self.stem.with_name(self.stem.name + ".docs.npy")

    def _write_header(self, length: int) -> int:
        self._file.seek(0)
        np.lib.format.write_array_header_1_0(self._file, {
            "descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (length,)})
        return self._file.tell()

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents, concatenated, and each one's length."""
        if tokens.size and int(tokens.max()) > np.iinfo(self.dtype).max:
            raise ShardFormatError(f"{self.tokens_path}: token id {int(tokens.max())} does not fit the shards' "
                                   f"{self.dtype} (the tokenizer's vocab size decides it): is the tokenizer's "
                                   "vocab size right?")
        self._file.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._count + np.cumsum(lengths, dtype=np.int64))
        self._count += int(tokens.size)

    def finish(self) -> dict:
        # numpy leaves room in the header for the length to grow, so it is rewritten in place.
        if self._write_header(self._count) != self._header_bytes:
            raise RuntimeError(f"{self.tokens_path}: the .npy header changed size")
        sync(self._file)
        self._file.close()
        offsets = np.concatenate(self._offsets)
        docs_tmp = tmp_sibling(self.docs_path)
        with open(docs_tmp, "wb") as f:
            np.save(f, offsets)
            sync(f)
        os.replace(self._tokens_tmp, self.tokens_path)
        os.replace(docs_tmp, self.docs_path)
        return {"tokens": self._count, "documents": len(offsets) - 1}

    def abandon(self) -> None:
        self._file.close()
        self._tokens_tmp.unlink(missing_ok=True)


class TokenShards:
    """One split of a shard folder as one token stream, memory-mapped (nothing is read until a
    window is asked for)."""

    def __init__(self, folder: str | Path, split: str = "train", index: dict | None = None):
        self.folder = Path(folder).expanduser()
        self.index = index if index is not None else read_index(self.folder)
        if split not in self.index["splits"]:
            raise ShardFormatError(f"{self.folder}: no split {split!r} (it has "
                                   f"{', '.join(self.index['splits'])})")
        self.split = split
        self.dtype = np.dtype(self.index["dtype"])
        shards = [s for s in self.index["splits"][split]["shards"] if s["tokens"]]
        _allow_open_files(len(shards))
        self._arrays, self._maps, self._data_offsets = [], [], []
        for shard in shards:
            array, mapped, offset = _map(self.folder / shard["file"], self.dtype, shard["tokens"])
            self._arrays.append(array)
            self._maps.append(mapped)
            self._data_offsets.append(offset)
        self.starts = np.cumsum([0] + [a.size for a in self._arrays], dtype=np.int64)
        self.tokens = int(self.starts[-1])
        self.documents = sum(s["documents"] for s in shards)

    def file_at(self, position: int) -> Path:
        """The shard file holding token `position` of the stream."""
        shards = [s for s in self.index["splits"][self.split]["shards"] if s["tokens"]]
        return self.folder / shards[int(np.searchsorted(self.starts, position, side="right")) - 1]["file"]

    def read(self, start: int, stop: int, out: np.ndarray) -> None:
        """Tokens [start, stop) of the stream into out (any integer dtype)."""
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while start < stop:
            end = min(stop, int(self.starts[i + 1]))
            out[filled:filled + end - start] = self._arrays[i][start - self.starts[i]:end - self.starts[i]]
            filled += end - start
            start = end
            i += 1

    def will_need(self, start: int, stop: int) -> None:
        """Ask the kernel to read these tokens in the background (a window that comes soon)."""
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[i + 1]))
            begin = self._data_offsets[i] + (start - int(self.starts[i])) * self.dtype.itemsize
            aligned = begin - begin % mmap.PAGESIZE  # madvise takes whole pages
            self._maps[i].madvise(mmap.MADV_WILLNEED, aligned,
                                  begin - aligned + (end - start) * self.dtype.itemsize)
            start = end
            i += 1


def _map(path: Path, dtype: np.dtype, expected: int) -> tuple[np.ndarray, mmap.mmap, int]:
    """The array, its mapping and where its data begin in the file."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version != (1, 0):
                raise ValueError(f".npy version {version}")
            shape, fortran_order, file_dtype = np.lib.format.read_array_header_1_0(f)
        except ValueError as e:
            raise ShardFormatError(f"{path}: not a token shard ({e})") from None
        if file_dtype != dtype or fortran_order or shape != (expected,):
            raise ShardFormatError(f"{path}: holds {file_dtype} {shape}, the index says {dtype} "
                                   f"({expected},): the folder was changed after it was written")
        offset = f.tell()
        if os.fstat(f.fileno()).st_size != offset + expected * dtype.itemsize:
            raise ShardFormatError(f"{path}: {os.fstat(f.fileno()).st_size} bytes, expected "
                                   f"{offset + expected * dtype.itemsize}: truncated or changed")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, dtype=dtype, count=expected, offset=offset), mapped, offset


def _allow_open_files(count: int) -> None:
    """Each mapped shard keeps a file descriptor; raise the soft limit when the default (often
    1024) is too low for a folder of many shards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 256
    needed = count + open_now + 64
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ShardFormatError(f"{count} shards to map, but this process may open only {hard} files "
                                   f"(ulimit -n): raise the limit, or prepare larger shards (--unit-mb)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
