"""Sampling from a Llama: greedy or temperature with top-k / top-p, through a KV cache."""

import torch
from torch import Tensor

from models.llama import KVCache, Llama


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> int:
    """One id from the logits [vocab] of the next position.

    temperature 0 is greedy (argmax). Otherwise the logits are divided by temperature, then only
    the top_k most likely ids (0: all) and, of those, the smallest set whose probabilities sum to
    at least top_p (1: all) stay candidates."""
    if temperature == 0:
        return int(logits.argmax())
    # shifted so that the largest is 0 before the division: at a tiny temperature the others go
    # to -inf (greedy in the limit) instead of the largest to +inf (softmax NaN: 1e-38 failed)
    logits = logits.float()
    logits = (logits - logits.max()) / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop an id once the ids more likely than it already reach top_p (the first stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 0")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature}: expected a finite number >= 0 (0: greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: expected >= 0 (0: no limit)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: expected 0 < top_p <= 1 (1: no limit)")


@torch.no_grad()
def generate(model: Llama, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             logit_scale: float = 1.0, softcap: float | None = None,
             vocab_limit: int | None = None) -> list[int]:
    """The ids sampled after `prompt`, at most max_new_tokens; generation stops at eos_id, which
    is not returned.

    use_cache: each step runs only the new token, reading the earlier positions' keys and values
    from a KVCache; False recomputes the whole sequence each step (the training forward), which
    gives the same tokens. logit_scale and softcap turn the output projection into the logits the
    model was trained with ([loss] logit_scale, softcap). vocab_limit: ids from it on (the
    padding rows of a vocabulary larger than the tokenizer's) are never sampled.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
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
    weight = model.output.weight
    cache = KVCache(model.args, 1, total, weight.device, weight.dtype) if use_cache else None
    sequence = torch.tensor([prompt], device=weight.device)
    step_input = sequence
    new = []
    for _ in range(max_new_tokens):
        hidden = model(step_input, cache) if use_cache else model(sequence)
        logits = model.logits(hidden[0, -1]).float() * logit_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if vocab_limit is not None and vocab_limit < vocab:
            logits[vocab_limit:] = float("-inf")
        token = sample_next(logits, temperature, top_k, top_p, generator)
        if token == eos_id:
            break
        new.append(token)
        step_input = torch.tensor([[token]], device=weight.device)
        sequence = torch.cat([sequence, step_input], dim=1)
    return new
