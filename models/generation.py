"""Sampling from a Llama: greedy or temperature with top-k / top-p, through a KV cache; several
samples of one prompt decode together as the rows of one batch."""

from collections.abc import Sequence

import torch
from torch import Tensor

from models.args import LlamaArgs
from models.llama import KVCache, Llama


def sample_rows(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generators: Sequence[torch.Generator | None] | None = None) -> Tensor:
    """One id per row of logits [rows, vocab] (the next position's), as a [rows] tensor.

    temperature 0 is greedy (argmax). Otherwise the logits are divided by temperature, then only
    the top_k most likely ids (0: all) and, of those, the smallest set whose probabilities sum to
    at least top_p (1: all) stay candidates. generators: one per row, row i drawing only from its
    own (None: the global one), so that a sample does not depend on the batch it is drawn in."""
    if temperature == 0:
        return logits.argmax(-1)
    # shifted so that the largest is 0 before the division: at a tiny temperature the others go
    # to -inf (greedy in the limit) instead of the largest to +inf (softmax NaN: 1e-38 failed)
    logits = logits.float()
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop an id once the ids more likely than it already reach top_p (the first stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    generators = [None] * len(probs) if generators is None else generators
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> int:
    """One id from the logits [vocab] of the next position (sample_rows for one row)."""
    return int(sample_rows(logits[None], temperature, top_k, top_p, [generator])[0])


def row_generators(seed: int, count: int, device: torch.device | str = "cpu"
                   ) -> list[torch.Generator]:
    """A generator for each of `count` samples: sample i's depends only on seed and i (not on
    count or the batch size), and seeds 0 and 1 share no sample's stream (seed + i would)."""
    seeds = torch.randint(2**62, (count,), generator=torch.Generator().manual_seed(seed))
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 0")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature}: expected a finite number >= 0 (0: greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: expected >= 0 (0: no limit)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: expected 0 < top_p <= 1 (1: no limit)")


def _widen(prompt_cache: KVCache, args: LlamaArgs, rows: int, max_len: int) -> KVCache:
    """The one-row prompt cache copied into each of `rows` rows of a cache of max_len positions:
    the prompt runs once whatever the number of samples."""
    keys = prompt_cache.keys[0]
    cache = KVCache(args, rows, max_len, keys.device, keys.dtype)
    for wide, one in zip(cache.keys + cache.values, prompt_cache.keys + prompt_cache.values):
        wide[:, :, :prompt_cache.length] = one  # broadcast over the rows
    cache.length = prompt_cache.length
    return cache


@torch.no_grad()
def generate_batch(model: Llama, prompt: list[int], max_new_tokens: int, num_samples: int, *,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   eos_id: int | None = None,
                   generators: Sequence[torch.Generator | None] | None = None,
                   use_cache: bool = True, logit_scale: float = 1.0, softcap: float | None = None,
                   vocab_limit: int | None = None) -> list[list[int]]:
    """num_samples continuations of `prompt` decoded as one batch: for each, the ids sampled
    after the prompt, at most max_new_tokens; a row stops at its own eos_id (not returned), and
    decoding stops once every row has.

    The prompt runs once, its keys and values copied into each row's cache; then every step
    runs one token of each row still going, reading the earlier positions from a KVCache of
    those rows (a row that stops leaves the batch and its cache). use_cache False recomputes the
    whole sequences each step (the training forward), which gives the same tokens.
    generators: one per row (see sample_rows). logit_scale and softcap turn the output
    projection into the logits the model was trained with ([loss] logit_scale, softcap).
    vocab_limit: ids from it on (the padding rows of a vocabulary larger than the tokenizer's)
    are never sampled. Logits that hold NaN or inf raise a ValueError naming the token.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: expected >= 1")
    if generators is not None and len(generators) != num_samples:
        raise ValueError(f"{len(generators)} generators for {num_samples} samples")
    if not prompt:
        raise ValueError("the prompt has no tokens (the caller puts bos first)")
    vocab = model.args.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary "
                         f"0..{vocab - 1}")
    total = len(prompt) + max(max_new_tokens - 1, 0)  # the last new token is never fed back
    if total > model.rope_cache.shape[0]:
        raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens need {total} "
                         f"positions, more than the {model.rope_cache.shape[0]} this model was "
                         "built for")
    new: list[list[int]] = [[] for _ in range(num_samples)]
    if max_new_tokens == 0:
        return new
    weight = model.output.weight
    sequence = torch.tensor([prompt], device=weight.device)
    cache = KVCache(model.args, 1, len(prompt), weight.device, weight.dtype) if use_cache else None
    hidden = model(sequence, cache)  # the prompt, once for every row
    if cache is not None:
        cache = _widen(cache, model.args, num_samples, total)
    rows = list(range(num_samples))  # the sample each row of the batch decodes
    for step in range(max_new_tokens):
        logits = model.logits(hidden[:, -1]).float() * logit_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        # Finite weights can still give NaN or inf logits (an overflow in bfloat16, say):
        # torch.multinomial then failed (a device-side assert on CUDA) and argmax drew garbage.
        # Checked on the device, with no sync of its own: such a row samples from zeros and its
        # token becomes -1, read with the tokens below.
        finite = torch.isfinite(logits).all(-1, keepdim=True)
        logits = logits.masked_fill(~finite, 0.0)
        if vocab_limit is not None and vocab_limit < vocab:
            logits[:, vocab_limit:] = float("-inf")
        # after the prompt one row of logits, the same for every sample: each draws its own
        tokens = sample_rows(logits.expand(len(rows), -1), temperature, top_k, top_p,
                             None if generators is None else [generators[r] for r in rows])
        drawn = torch.where(finite[:, 0], tokens, -1).tolist()
        if -1 in drawn:
            raise ValueError(f"the logits of new token {step + 1} (position {len(prompt) + step}) "
                             f"hold NaN or inf: an overflow in {weight.dtype} (float32 has more "
                             "range), or a model that diverged")
        going = [i for i, token in enumerate(drawn) if token != eos_id]
        for i in going:
            new[rows[i]].append(drawn[i])
        if not going or step == max_new_tokens - 1:
            break  # the last tokens drawn are never fed back
        if cache is None:
            sequence = torch.cat([sequence.expand(len(rows), -1), tokens[:, None]], dim=1)
        if len(going) < len(rows):
            keep = torch.tensor(going, device=tokens.device)
            tokens, rows = tokens[keep], [rows[i] for i in going]
            if cache is None:
                sequence = sequence[keep]
            else:
                cache.keep_rows(keep)
        hidden = model(sequence) if cache is None else model(tokens[:, None], cache)
    return new


def generate(model: Llama, prompt: list[int], max_new_tokens: int, *,
             generator: torch.Generator | None = None, **kwargs) -> list[int]:
    """The ids sampled after `prompt`, at most max_new_tokens; generation stops at eos_id, which
    is not returned. generate_batch for one sample (the same keyword arguments)."""
    return generate_batch(model, prompt, max_new_tokens, 1, generators=[generator], **kwargs)[0]
