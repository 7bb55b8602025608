"""Llama-3: RoPE with Llama-3 frequency scaling, grouped-query attention, SwiGLU, RMSNorm.

Module names follow torchtitan (tok_embeddings, layers.N.attention.wq, ..., norm, output) so
that sharding plans written for torchtitan address the same modules. forward() stops at the final
norm: the loss (fused or not) applies `output` itself.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.args import LlamaArgs


def rope_frequencies(args: LlamaArgs) -> Tensor:
    """Radians per position for each pair of head dimensions, float64, [head_dim // 2]."""
    freqs = args.rope_theta ** -(torch.arange(0, args.head_dim, 2, dtype=torch.float64)
                                 / args.head_dim)
    if args.rope_scaling_factor is None:
        return freqs
    # Llama 3.1 long-context scaling: pairs that turn many times within the original context
    # encode local order and are kept; pairs whose wavelength exceeds that context are slowed by
    # `factor` so that longer contexts map onto angles seen in training; a linear ramp in
    # between avoids a discontinuity.
    factor, low, high = (args.rope_scaling_factor, args.rope_low_freq_factor,
                         args.rope_high_freq_factor)
    original = args.rope_original_max_pos
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    ramp = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(wavelen < original / high, freqs,
                       torch.where(wavelen > original / low, freqs / factor, ramp))


def build_rope_cache(args: LlamaArgs, seq_len: int, device=None) -> Tensor:
    """cos and sin of every position's angles, float32, [seq_len, head_dim // 2, 2]."""
    freqs = rope_frequencies(args).to(device)
    # Angles in float64: at position 1e5, float32 would be off by ~0.01 rad.
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def apply_rope(x: Tensor, rope_cache: Tensor) -> Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of x [B, T, H, head_dim] by its position's angle.

    Adjacent pairs, as Meta's complex formulation, so Meta/torchtitan checkpoints load unpermuted.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = rope_cache[:, None, :, 0], rope_cache[:, None, :, 1]  # broadcast over heads
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def _trunc_normal_(weight: Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal_(linear.weight, 0.02)
        _trunc_normal_(self.wo.weight, out_std)

    def forward(self, x: Tensor, rope_cache: Tensor, kv_cache: "KVCache | None" = None,
                layer_id: int = 0) -> Tensor:
        batch, seq_len, _ = x.shape
        # Head counts are read from the projections' outputs (-1), not from args, so the same code
        # runs on a tensor-parallel rank holding a slice of the heads.
        q = apply_rope(self.wq(x).view(batch, seq_len, -1, self.head_dim), rope_cache)
        k = apply_rope(self.wk(x).view(batch, seq_len, -1, self.head_dim), rope_cache)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        mask, causal = None, True
        if kv_cache is not None:
            start = kv_cache.length
            k, v = kv_cache.append(layer_id, k, v)  # every position so far
            if start:
                # query i sits at position start + i and sees keys 0..start + i (is_causal
                # would align the triangle to key 0); a single query sees every key
                causal = False
                if seq_len > 1:
                    mask = torch.ones(seq_len, k.shape[2], dtype=torch.bool,
                                      device=q.device).tril(diagonal=start)
        # enable_gqa: query head h reads kv head h // (n_heads / n_kv_heads), without
        # materializing repeated keys and values.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        _trunc_normal_(self.w1.weight, 0.02)
        # torchtitan scales w3 with w2: both multiply into what w2 writes to the residual stream.
        for linear in (self.w2, self.w3):
            _trunc_normal_(linear.weight, out_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def init_weights(self) -> None:
        # Deeper blocks write smaller updates, so the residual stream's variance does not grow
        # with depth at init (torchtitan's depth_init).
        out_std = 0.02 / math.sqrt(2 * (self.layer_id + 1))
        self.attention_norm.reset_parameters()
        self.attention.init_weights(out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(out_std)

    def forward(self, x: Tensor, rope_cache: Tensor, kv_cache: "KVCache | None" = None) -> Tensor:
        x_norm = self.attention_norm(x)
        # without a cache exactly the training call: TP's input plan covers these two inputs
        h = x + (self.attention(x_norm, rope_cache) if kv_cache is None
                 else self.attention(x_norm, rope_cache, kv_cache, self.layer_id))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """tokens [B, T] -> final-norm hidden states [B, T, dim]; `logits(hidden)` for logits.

    seq_len is the longest sequence this instance will see (RoPE is tabulated up to it); it
    defaults to args.max_seq_len, which for the long-context flavors is a 131072-row table.
    """

    def __init__(self, args: LlamaArgs, seq_len: int | None = None):
        super().__init__()
        seq_len = args.max_seq_len if seq_len is None else seq_len
        if not 0 < seq_len <= args.max_seq_len:
            raise ValueError(f"seq_len={seq_len}: expected 1..max_seq_len={args.max_seq_len}")
        self.args = args
        self.seq_len = seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed "0".."n-1" rather than a list, so that dropping layers (e.g. a pipeline
        # stage) keeps the remaining ones' names and checkpoint keys.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args)
                                     for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from args, so not saved in checkpoints; float32 whatever the model's dtype.
        self.register_buffer("rope_cache", build_rope_cache(args, seq_len), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # Module._apply (to_empty, to, cuda) gives each module its own copy of a shared
        # parameter when it cannot convert in place (meta -> real device): tie again.
        super()._apply(fn, recurse)
        if (self.args.tie_embeddings and self.tok_embeddings is not None
                and self.output is not None):
            self.output.weight = self.tok_embeddings.weight
        # model.to(bfloat16) would round cos/sin to 8 bits: rebuild the table in float32.
        if self.rope_cache.dtype != torch.float32:
            self.rope_cache = build_rope_cache(self.args, self.seq_len, self.rope_cache.device)
        return self

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialize every parameter and buffer in place, in definition order.

        Deterministic given the global seed. In-place nn.init calls on the existing parameters, so
        it works after sharding (DTensor parameters). Modules set to None are skipped.
        """
        output_std = self.args.dim ** -0.5
        if self.tok_embeddings is not None:
            if self.args.tie_embeddings:
                # The shared matrix also projects to logits, where std 1 would give logits of
                # scale sqrt(dim); the output's init suits both uses.
                _trunc_normal_(self.tok_embeddings.weight, output_std)
            else:
                nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_embeddings:
            _trunc_normal_(self.output.weight, output_std)
        device = self.rope_cache.device if buffer_device is None else buffer_device
        self.rope_cache = build_rope_cache(self.args, self.seq_len, device)

    def forward(self, tokens: Tensor, kv_cache: "KVCache | None" = None) -> Tensor:
        """kv_cache (inference): tokens continue the sequence the cache holds; their keys and
        values are added to it. Without one (training), tokens start at position 0."""
        start = 0 if kv_cache is None else kv_cache.length
        end = start + tokens.shape[1]
        if end > self.rope_cache.shape[0]:
            raise ValueError(f"sequence of {end} tokens: this model was built for at most "
                             f"seq_len={self.rope_cache.shape[0]}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope_cache = self.rope_cache[start:end]
        for layer in self.layers.values():
            # without a cache exactly the training call (wrappers and compile see two inputs)
            h = layer(h, rope_cache) if kv_cache is None else layer(h, rope_cache, kv_cache)
        if kv_cache is not None:
            kv_cache.length = end
        return self.norm(h) if self.norm is not None else h

    def logits(self, hidden: Tensor) -> Tensor:
        return self.output(hidden)


class KVCache:
    """Keys and values of every layer for the positions generated so far (inference only).

    One buffer per layer of [batch, n_kv_heads, max_len, head_dim], filled from position 0;
    `length` counts the positions held. Pass it to every Llama.forward of one sequence.
    """

    def __init__(self, args: LlamaArgs, batch_size: int, max_len: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        shape = (batch_size, args.n_kv_heads, max_len, args.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype)
                       for _ in range(args.n_layers)]
        self.max_len = max_len
        self.length = 0

    def keep_rows(self, rows: Tensor) -> None:
        """Only these rows of the batch (indices, in their new order) stay: the others' sequences
        have ended, and the next forwards run without them."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]

    def append(self, layer_id: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions' k, v [B, kv_heads, T, head_dim]; return all positions'."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions, {end} needed")
        self.keys[layer_id][:, :, self.length:end] = k
        self.values[layer_id][:, :, self.length:end] = v
        return self.keys[layer_id][:, :, :end], self.values[layer_id][:, :, :end]


def num_params(model: nn.Module, exclude_embedding: bool = True) -> int:
    """Parameters of a built model, a shared (tied) parameter once.

    exclude_embedding drops the token-embedding table (a lookup costs no FLOPs) unless it is tied
    to the output projection, whose matmul does. DTensor parameters count their global size.
    """
    total = sum(p.numel() for p in model.parameters())
    embedding = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    if exclude_embedding and embedding is not None:
        if output is None or output.weight is not embedding.weight:
            total -= embedding.weight.numel()
    return total
