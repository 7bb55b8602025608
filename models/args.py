"""Llama-3 hyperparameters, the named flavors, and parameter/FLOP/activation counts computed from
them."""

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int  # hidden size of the SwiGLU FFN, given explicitly rather than derived from dim
    max_seq_len: int  # the longest context the architecture supports; a run builds RoPE for less
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama-3 RoPE frequency scaling; None leaves the frequencies as they are.
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
                     "max_seq_len", "rope_original_max_pos"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive int")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd: RoPE rotates pairs of dimensions")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps={self.norm_eps}: expected > 0")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta}: expected > 0")
        if self.rope_scaling_factor is not None:
            if self.rope_scaling_factor < 1:
                raise ValueError(f"rope_scaling_factor={self.rope_scaling_factor}: expected >= 1 "
                                 "(it stretches wavelengths) or None for no scaling")
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(
                    f"rope_low_freq_factor={self.rope_low_freq_factor}, rope_high_freq_factor="
                    f"{self.rope_high_freq_factor}: expected 0 < low < high")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


_LLAMA3_VOCAB = 128256

FLAVORS: dict[str, LlamaArgs] = {
    # Trains in seconds on a laptop CPU; the vocab covers the 259-id byte tokenizer.
    "debug": LlamaArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=384,
                       max_seq_len=2048, rope_theta=10000.0),
    "llama_150m": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                            vocab_size=_LLAMA3_VOCAB, ffn_dim=2048, max_seq_len=8192),
    # Llama-3.2-1B's shapes, untied like torchtitan's 1B-shaped model (1.50B parameters).
    "llama_1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                          vocab_size=_LLAMA3_VOCAB, ffn_dim=8192, max_seq_len=131072,
                          rope_scaling_factor=32.0),
    # Llama-3.2-3B's shapes (the released checkpoint ties its embeddings; this flavor does not).
    "llama_3b": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                          vocab_size=_LLAMA3_VOCAB, ffn_dim=8192, max_seq_len=131072,
                          rope_scaling_factor=32.0),
    "llama_8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          vocab_size=_LLAMA3_VOCAB, ffn_dim=14336, max_seq_len=131072,
                          rope_scaling_factor=8.0),
}


def with_context(args: LlamaArgs, max_seq_len: int = 0,
                 rope_scaling_factor: float = 0.0) -> LlamaArgs:
    """args with the context length and the Llama-3 RoPE scaling factor a run sets ([model]
    max_seq_len and rope_scaling_factor; 0 keeps the flavor's).

    A factor given to a flavor without scaling adds Llama-3 scaling from the flavor's own length
    (its max_seq_len becomes original_max_position_embeddings, low/high_freq_factor stay 1 and
    4, as Llama 3.1 extended Llama 3's 8192): the way a Hugging Face config says that a model was
    extended past the context it was first trained at."""
    changes = {}
    if max_seq_len:
        changes["max_seq_len"] = max_seq_len
    if rope_scaling_factor:
        changes["rope_scaling_factor"] = float(rope_scaling_factor)
        if args.rope_scaling_factor is None:
            changes["rope_original_max_pos"] = args.max_seq_len
    return dataclasses.replace(args, **changes) if changes else args


def param_count_for(args: LlamaArgs, exclude_embedding: bool = True) -> int:
    """Parameters of `Llama(args)` without building it; a tied weight counts once.

    exclude_embedding drops the token-embedding table, which costs no FLOPs (a lookup), unless
    it is tied to the output projection, whose matmul does cost FLOPs.
    """
    kv_dim = args.n_kv_heads * args.head_dim
    attention = 2 * args.dim * args.dim + 2 * args.dim * kv_dim  # wq, wo + wk, wv
    feed_forward = 3 * args.dim * args.ffn_dim
    block = attention + feed_forward + 2 * args.dim  # + attention_norm, ffn_norm
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = args.n_layers * block + args.dim + embedding + output  # + final norm
    if exclude_embedding and not args.tie_embeddings:
        total -= embedding
    return total


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), torchtitan's formula for MFU.

    6 per matmul parameter (2 forward, 4 backward) plus the attention scores and the weighted
    sum over the full T x T square (no discount for the causal mask, as torchtitan and PaLM).
    """
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * param_count_for(args, exclude_embedding=True) + attention)


def saved_values_per_token(args: LlamaArgs) -> int:
    """Values one block of `Llama(args)` keeps for backward per token (each a float32 on the
    CPU): each of its two RMSNorms' input, rms, input x rms and output (3 dim + 1 each); q, k, v,
    the attention's output (also wo's input) and log-sum-exp per head (flash attention's, on the
    CPU as on CUDA); SwiGLU's w1 and w3 outputs, silu's and the product (4 ffn). Counted from
    the tensors autograd saves (tests/test_host_memory.py)."""
    kv_dim = args.n_kv_heads * args.head_dim
    return 8 * args.dim + 2 * kv_dim + args.n_heads + 2 + 4 * args.ffn_dim
