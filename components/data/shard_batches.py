"""Batches from token shards: windows of seq_len + 1 tokens in a seeded shuffled order, the same
global batches for any data-parallel layout, resumable from one integer; weighted mixtures.

Everything is a function of the global window index g (how many windows every rank together
has consumed before it), as for synthetic data: window j of rank r's micro-batch that starts at
global window G is g = G + r * local_batch_size + j. So 2 ranks of batch 2 read the windows of 1
rank of batch 4, any layout can resume from any rank's state ({"global_windows": G}), and nothing
has to be remembered but G.

From g to tokens: the mixture assigns g to a source and numbers it among that source's windows
(n); a source's windows are its token stream cut at multiples of seq_len, each seq_len + 1 long
(the last token of one is the first of the next: every token but the first is a label once per
epoch); epoch n // W of a source visits its W windows in the order of a seeded permutation of its
own, so no window repeats within an epoch and every epoch is shuffled anew.
"""

import hashlib
import warnings

import numpy as np
import torch

from components.config.schema import Data, Training
from components.data.shards import (ShardFormatError, TokenShards, check_tokenizer, is_shard_folder,
                                    read_index)
from components.rank_warnings import SameOnEveryRank

MIXTURE_BLOCK = 4096  # mixture weights are met exactly in every block of this many windows
PERMUTED_BLOCK = 4096  # a source's permutation is evaluated (and kept) this many windows at a time
FEISTEL_ROUNDS = 6
VALIDATION_SEED = 0  # validation reads the same windows whatever [training] seed is
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _keys(*what) -> np.ndarray:
    digest = hashlib.blake2b("/".join(map(str, what)).encode(), digest_size=8 * FEISTEL_ROUNDS).digest()
    return np.frombuffer(digest, dtype="<u8")


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    z = (x + key) * _M1
    z = (z ^ (z >> np.uint64(30))) * _M2
    z = (z ^ (z >> np.uint64(27))) * _M3
    return z ^ (z >> np.uint64(31))


def permute(indices: np.ndarray, size: int, keys: np.ndarray) -> np.ndarray:
    """A pseudo-random bijection of [0, size), evaluated at `indices`: a balanced Feistel network
    on the smallest even number of bits that holds size, cycle-walked back into range (each walk
    lands in range with probability > 1/4). O(1) memory, whatever the size."""
    half = max(1, (int(size - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    x = np.asarray(indices, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        y = x[todo]
        left, right = y >> shift, y & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        x[todo] = (left << shift) | right
        todo[todo] = x[todo] >= size
    return x.astype(np.int64)


class Mixture:
    """Which source each global window comes from. Every block of MIXTURE_BLOCK windows holds each
    source's quota of windows (its weight, rounded; at least one) at seeded random places, so a
    window's source and its number among that source's windows follow from g alone."""

    def __init__(self, weights: list[float], seed: int):
        if not weights or min(weights) <= 0:
            raise ValueError(f"mixture weights {weights}: need at least one, all > 0")
        if len(weights) > MIXTURE_BLOCK:
            raise ValueError(f"{len(weights)} mixture sources: at most {MIXTURE_BLOCK}")
        self.seed = seed
        self.quotas = _largest_remainder(np.asarray(weights, dtype=np.float64), MIXTURE_BLOCK)
        self._slots = np.repeat(np.arange(len(weights)), self.quotas)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def realized_weights(self) -> list[float]:
        return (self.quotas / MIXTURE_BLOCK).tolist()

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        # never read back from the cache after writing it: the prefetch thread may clear it
        found = self._blocks.get(block)
        if found is None:
            order = permute(np.arange(MIXTURE_BLOCK), MIXTURE_BLOCK, _keys(self.seed, "mixture", block))
            source = self._slots[order]
            number = np.empty(MIXTURE_BLOCK, dtype=np.int64)
            for s in range(len(self.quotas)):
                places = np.flatnonzero(source == s)
                number[places] = np.arange(places.size)
            found = source, number
            if len(self._blocks) > 4:
                self._blocks.clear()
            self._blocks[block] = found
        return found

    def counts(self, windows: int) -> np.ndarray:
        """How many of global windows [0, windows) each source gets."""
        if len(self.quotas) == 1:
            return np.array([windows])
        blocks, rest = divmod(windows, MIXTURE_BLOCK)
        counts = blocks * self.quotas
        if rest:
            counts = counts + np.bincount(self._block(blocks)[0][:rest], minlength=len(self.quotas))
        return counts

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For global windows g: their sources, and their numbers among their sources' windows."""
        g = np.asarray(g, dtype=np.int64)
        if len(self.quotas) == 1:
            return np.zeros_like(g), g
        blocks, places = np.divmod(g, MIXTURE_BLOCK)
        source = np.empty(blocks.shape, dtype=np.int64)
        number = np.empty(blocks.shape, dtype=np.int64)
        for block in np.unique(blocks):
            here = blocks == block
            block_source, block_number = self._block(int(block))
            source[here] = block_source[places[here]]
            number[here] = int(block) * self.quotas[source[here]] + block_number[places[here]]
        return source, number


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    exact = weights / weights.sum() * total
    quotas = np.maximum(np.floor(exact).astype(np.int64), 1)
    while quotas.sum() < total:
        quotas[np.argmax(exact - quotas)] += 1
    while quotas.sum() > total:  # only when minimums of 1 pushed it over
        quotas[np.argmax(np.where(quotas > 1, quotas - exact, -np.inf))] -= 1
    return quotas


class ShardBatches:
    """([B, seq_len], [B, seq_len]) torch.long batches of this rank, forever. The state is the
    global window count G at this rank's next micro-batch: the same on every rank, whatever the
    layout."""

    def __init__(self, sources: list[TokenShards], weights: list[float], seq_len: int,
                 local_batch_size: int, seed: int, dp_rank: int = 0, dp_world: int = 1,
                 max_token_id: int | None = None):
        """max_token_id: the model's vocab size; a batch holding an id as large (a shard changed
        after its index.json was written, which vouches for it) is an error naming the shard,
        not an index error in the embedding."""
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len={seq_len}, local_batch_size={local_batch_size}: both must be >= 1")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank}, dp_world={dp_world}: need 0 <= dp_rank < dp_world")
        if len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        self.sources = sources
        self.max_token_id = max_token_id
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.windows_per_epoch = []
        for source in sources:
            windows = (source.tokens - 1) // seq_len
            if windows < 1:
                raise ShardFormatError(f"{source.folder}: its {source.split} split holds {source.tokens} "
                                       f"tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
            self.windows_per_epoch.append(windows)
        self.mixture = Mixture(weights, seed)
        self._global = 0
        self._permuted: dict[tuple[int, int, int], np.ndarray] = {}

    def __iter__(self) -> "ShardBatches":
        return self

    def _starts(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sources of global windows g and where in them (token index) each window starts."""
        source, number = self.mixture.locate(g)
        start = np.empty_like(number)
        for s in np.unique(source):
            here = source == s
            windows = self.windows_per_epoch[s]
            epochs, within = np.divmod(number[here], windows)
            picked = np.empty_like(within)
            for epoch in np.unique(epochs):
                same = epochs == epoch
                picked[same] = self._permute(int(s), int(epoch), within[same])
            start[here] = picked * self.seq_len
        return source, start

    def _permute(self, source: int, epoch: int, within: np.ndarray) -> np.ndarray:
        """Epoch `epoch`'s permutation of the source's windows at `within`, computed a block of
        consecutive positions at a time (the next batches need the next positions)."""
        blocks, places = np.divmod(within, PERMUTED_BLOCK)
        out = np.empty_like(within)
        for block in np.unique(blocks).tolist():
            key = (source, epoch, block)
            if key not in self._permuted:
                if len(self._permuted) >= 4 * len(self.sources):
                    self._permuted.clear()
                first = block * PERMUTED_BLOCK
                positions = np.arange(first, min(first + PERMUTED_BLOCK, self.windows_per_epoch[source]))
                self._permuted[key] = permute(positions, self.windows_per_epoch[source],
                                              _keys(self.seed, source, epoch))
            here = blocks == block
            out[here] = self._permuted[key][places[here]]
        return out

    def _rank_windows(self, first: int) -> np.ndarray:
        return first + self.dp_rank * self.local_batch_size + np.arange(self.local_batch_size)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        source, start = self._starts(self._rank_windows(self._global))
        windows = np.empty((self.local_batch_size, self.seq_len + 1), dtype=np.int64)
        for j in range(self.local_batch_size):
            self.sources[source[j]].read(int(start[j]), int(start[j]) + self.seq_len + 1, windows[j])
        if self.max_token_id is not None and int(windows.max()) >= self.max_token_id:
            j, k = (int(i) for i in np.argwhere(windows >= self.max_token_id)[0])
            shards = self.sources[source[j]]
            raise ShardFormatError(
                f"{shards.file_at(int(start[j]) + k)}: token id {int(windows[j, k])}, out of range "
                f"for the model's vocab size {self.max_token_id} (its index.json says at most "
                f"{shards.index['max_token_id']}): the shard was changed or damaged after it was "
                "written; prepare the folder again")
        self._global += self.dp_world * self.local_batch_size
        # The next batch's pages are read by the kernel while this one trains.
        next_source, next_start = self._starts(self._rank_windows(self._global))
        for s, a in zip(next_source.tolist(), next_start.tolist()):
            self.sources[s].will_need(a, a + self.seq_len + 1)
        windows = torch.from_numpy(windows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"global_windows": self._global, "seq_len": self.seq_len,
                "windows_per_epoch": list(self.windows_per_epoch), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if "global_windows" not in state:
            raise ValueError("the data state was saved from another kind of source (not token shards)")
        saved = (state.get("seq_len"), state.get("windows_per_epoch"), state.get("seed"))
        if saved != (self.seq_len, self.windows_per_epoch, self.seed):
            warnings.warn(f"data: the checkpoint read windows of seq_len {saved[0]} from {saved[1]} windows "
                          f"per source with seed {saved[2]}; now seq_len {self.seq_len}, "
                          f"{self.windows_per_epoch}, seed {self.seed}: continuing after global window "
                          f"{state['global_windows']} of the new order, which may repeat or skip "
                          "windows", SameOnEveryRank)
        self._global = int(state["global_windows"])

    def read_more_than_once(self, state: dict) -> list[str]:
        """The sources ("folder (split)") of which more windows were read, by all ranks together
        up to the state, than one pass over them holds."""
        read = self.mixture.counts(int(state["global_windows"]))
        return [f"{s.folder} ({s.split})" for s, n, w in zip(self.sources, read, self.windows_per_epoch)
                if n > w]

    def epochs(self, state: dict) -> dict[str, int]:
        """{"folder (split)": the epoch of its last window read, by all ranks, up to the state}."""
        read = self.mixture.counts(int(state["global_windows"]))
        return {f"{s.folder} ({s.split})": max(0, int(n) - 1) // w
                for s, n, w in zip(self.sources, read, self.windows_per_epoch)}

    def resume_at_batch(self, n_batches: int) -> None:
        """After n_batches micro-batches of this layout (a rank without a state of its own)."""
        self._global = n_batches * self.dp_world * self.local_batch_size

    def describe(self) -> str:
        parts = [f"{s.folder} ({s.split}: {s.tokens:,} tokens, {w:,} windows"
                 + (f", weight {r:.4f}" if len(self.sources) > 1 else "") + ")"
                 for s, w, r in zip(self.sources, self.windows_per_epoch, self.mixture.realized_weights)]
        return "data: token shards " + "; ".join(parts)

    def close(self) -> None:
        pass


def build_shard_batches(data: Data, training: Training, *, split: str, tokenizer,
                        dp_rank: int = 0, dp_world: int = 1,
                        max_token_id: int | None = None) -> ShardBatches:
    """The [data] section's token shard folder, or its [[data.mixture]] of them, as batches of
    [training] seq_len and local_batch_size, shuffled with its seed."""
    for part in data.mixture:
        if not is_shard_folder(part.source):
            raise ValueError(f"[[data.mixture]] source {part.source!r}: not a token shard folder (a "
                             f"mixture mixes folders made by scripts.prepare_data)")
    sources = [(m.source, m.weight) for m in data.mixture] or [(data.source, 1.0)]
    shards = []
    for folder, _ in sources:
        index = read_index(folder)
        check_tokenizer(index, tokenizer, folder)
        if max_token_id is not None and index["max_token_id"] >= max_token_id:
            raise ShardFormatError(f"{folder}: holds token id {index['max_token_id']}, out of range for "
                                   f"the model's vocab size {max_token_id}")
        if split != "train" and not index["splits"].get(split, {}).get("tokens"):
            raise ShardFormatError(f"{folder}: no {split} documents (prepared with --val-every "
                                   f"{index['val_every']}); prepare with a held-out split, or "
                                   "go without one ([validation] enable = false when training, "
                                   "--split train for scripts.evaluate)")
        shards.append(TokenShards(folder, split, index))
    return ShardBatches(shards, [w for _, w in sources], training.seq_len,
                        training.local_batch_size,
                        training.seed if split == "train" else VALIDATION_SEED, dp_rank, dp_world,
                        max_token_id)
