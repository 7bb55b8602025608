"""Llama-3 model: shapes, causality, attention and RoPE against float64 references, init, counts."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from models import (FLAVORS, Llama, LlamaArgs, apply_rope, build_rope_cache, flops_per_token,
                    num_params, param_count_for, rope_frequencies)
from models.llama import Attention

DEBUG = FLAVORS["debug"]


def _built(args: LlamaArgs = DEBUG, seed: int = 0, seq_len: int | None = 64) -> Llama:
    """The way a trainer builds it: on meta, then materialized and initialized."""
    with torch.device("meta"):
        model = Llama(args, seq_len=seq_len)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("batch,seq_len", [(1, 1), (3, 17), (2, 63)])
def test_output_shapes(batch, seq_len):
    model = _built()
    tokens = torch.randint(0, 259, (batch, seq_len))
    hidden = model(tokens)
    assert hidden.shape == (batch, seq_len, DEBUG.dim) and hidden.dtype == torch.float32
    assert model.logits(hidden).shape == (batch, seq_len, DEBUG.vocab_size)


def test_causal_masking():
    model = _built()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 259, (2, 20), generator=g)
    t = 7
    with torch.no_grad():
        hidden = model(tokens)
        future_changed = tokens.clone()
        future_changed[:, t + 1:] = (tokens[:, t + 1:] + 1) % 259
        hidden_future = model(future_changed)
        present_changed = tokens.clone()
        present_changed[:, t] = (tokens[:, t] + 1) % 259
        hidden_present = model(present_changed)
    torch.testing.assert_close(hidden_future[:, :t + 1], hidden[:, :t + 1], rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden_present[:, :t], hidden[:, :t], rtol=0, atol=1e-6)
    change = (hidden_present[:, t:] - hidden[:, t:]).abs().amax(dim=-1)
    assert (change > 1e-4).all(), "a token must influence its own and every later position"


def _reference_attention(attention: Attention, x: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """float64, explicit repeat of kv heads, RoPE in Meta's complex form, an explicit mask."""
    batch, seq_len, _ = x.shape
    x = x.double()
    q, k, v = (x @ lin.weight.double().T for lin in (attention.wq, attention.wk, attention.wv))
    q, k, v = (t.view(batch, seq_len, -1, args.head_dim) for t in (q, k, v))
    freqs = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2).double() / args.head_dim)
    angles = torch.arange(seq_len).double()[:, None] * freqs
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None]  # [T, 1, head_dim / 2]
    q, k = (torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (-1, 2))) * rotation)
            .flatten(-2) for t in (q, k))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    n_rep = args.n_heads // args.n_kv_heads
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(args.head_dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(batch, seq_len, -1) @ attention.wo.weight.double().T


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])  # multi-query, grouped, plain multi-head
def test_attention_matches_float64_repeat_kv_reference(n_kv_heads):
    args = dataclasses.replace(DEBUG, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    attention = Attention(args)
    for lin in (attention.wq, attention.wk, attention.wv, attention.wo):
        torch.nn.init.normal_(lin.weight, std=0.1)  # scores far from uniform: the mask matters
    x = torch.randn(2, 13, args.dim)
    with torch.no_grad():
        out = attention(x, build_rope_cache(args, 13))
    expected = _reference_attention(attention, x, args)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_rope_preserves_norm():
    args = FLAVORS["llama_1b"]
    x = torch.randn(2, 1000, 3, args.head_dim)
    rotated = apply_rope(x, build_rope_cache(args, 1000))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(rotated[:, 0], x[:, 0])  # position 0 is not rotated


@pytest.mark.parametrize("flavor", ["debug", "llama_1b"])
def test_rope_score_depends_only_on_distance(flavor):
    args = FLAVORS[flavor]
    seq_len = 48
    rope_cache = build_rope_cache(args, seq_len)
    q, k = torch.randn(2, args.head_dim)
    # The same q and k placed at every position: scores[m, n] = <R(m) q, R(n) k>.
    q_at = apply_rope(q.expand(1, seq_len, 1, -1), rope_cache)[0, :, 0]
    k_at = apply_rope(k.expand(1, seq_len, 1, -1), rope_cache)[0, :, 0]
    scores = q_at @ k_at.T
    for offset in range(-seq_len + 1, seq_len):
        diagonal = scores.diagonal(offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=0, atol=1e-4)
    assert scores.diagonal(0)[0] != scores.diagonal(1)[0]  # and does depend on it


def _meta_scaled_frequency(freq: float, args: LlamaArgs) -> float:
    """Meta's scalar loop (llama-models apply_scaling), for the band in between."""
    low_freq_wavelen = args.rope_original_max_pos / args.rope_low_freq_factor
    high_freq_wavelen = args.rope_original_max_pos / args.rope_high_freq_factor
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
        return freq
    if wavelen > low_freq_wavelen:
        return freq / args.rope_scaling_factor
    smooth = ((args.rope_original_max_pos / wavelen - args.rope_low_freq_factor)
              / (args.rope_high_freq_factor - args.rope_low_freq_factor))
    return (1 - smooth) * freq / args.rope_scaling_factor + smooth * freq


@pytest.mark.parametrize("flavor", ["llama_1b", "llama_8b"])
def test_llama3_rope_scaling(flavor):
    args = FLAVORS[flavor]
    base = rope_frequencies(dataclasses.replace(args, rope_scaling_factor=None))
    scaled = rope_frequencies(args)
    wavelen = 2 * math.pi / base
    high = wavelen < args.rope_original_max_pos / args.rope_high_freq_factor
    low = wavelen > args.rope_original_max_pos / args.rope_low_freq_factor
    between = ~high & ~low
    assert high.any() and low.any() and between.any()
    assert torch.equal(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / args.rope_scaling_factor,
                               rtol=1e-12, atol=0)
    assert ((scaled[between] < base[between])
            & (scaled[between] > base[between] / args.rope_scaling_factor)).all()
    expected = torch.tensor([_meta_scaled_frequency(f, args) for f in base.tolist()],
                            dtype=torch.float64)
    torch.testing.assert_close(scaled, expected, rtol=1e-12, atol=0)


def test_tied_embeddings_share_storage_and_count_once():
    tied = dataclasses.replace(DEBUG, tie_embeddings=True)
    model = _built(tied)  # to_empty would untie them without Llama._apply
    assert model.output.weight is model.tok_embeddings.weight
    model.to(torch.float64)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied_total = param_count_for(DEBUG, exclude_embedding=False)
    vocab_matrix = DEBUG.vocab_size * DEBUG.dim
    assert num_params(model, exclude_embedding=False) == untied_total - vocab_matrix
    # The shared matrix is still the output projection's matmul, so it stays in the FLOP count.
    assert num_params(model, exclude_embedding=True) == untied_total - vocab_matrix
    assert param_count_for(tied, exclude_embedding=True) == untied_total - vocab_matrix


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_gives_finite_values(tie):
    args = dataclasses.replace(DEBUG, tie_embeddings=tie)
    model = _built(args)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device.type == "cpu" and torch.isfinite(tensor).all(), name
    assert model.rope_cache.dtype == torch.float32
    torch.testing.assert_close(model.rope_cache, build_rope_cache(args, 64), rtol=0, atol=0)
    hidden = model(torch.randint(0, 259, (2, 64)))
    assert torch.isfinite(model.logits(hidden)).all()


def test_bfloat16_model_keeps_a_float32_rope_table():
    model = _built().to(torch.bfloat16)
    assert model.rope_cache.dtype == torch.float32
    torch.testing.assert_close(model.rope_cache, build_rope_cache(DEBUG, 64), rtol=0, atol=0)
    hidden = model(torch.randint(0, 259, (2, 9)))
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(hidden).all()


def test_init_is_deterministic_and_seed_dependent():
    first, again, other = _built(seed=0), _built(seed=0), _built(seed=1)
    with torch.device("cpu"):
        torch.manual_seed(123)
        built_on_cpu = Llama(DEBUG, seq_len=64)  # default init consumes the RNG differently
    torch.manual_seed(0)
    built_on_cpu.init_weights()
    for name, param in first.named_parameters():
        assert torch.equal(param, again.get_parameter(name)), name
        assert torch.equal(param, built_on_cpu.get_parameter(name)), name
        if "norm" not in name:  # norms are ones for every seed
            assert not torch.equal(param, other.get_parameter(name)), name


@pytest.mark.parametrize("tie", [False, True])
def test_init_touches_every_parameter_and_buffer(tie):
    model = _built(dataclasses.replace(DEBUG, tie_embeddings=tie))
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))
    params_before = {name: p for name, p in model.named_parameters()}
    model.init_weights()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.isnan().any(), f"{name} was not initialized"
    for name, param in model.named_parameters():
        assert param is params_before[name], f"{name} was replaced, not initialized in place"


def test_init_scales():
    model = _built()
    # A normal truncated at +-3 std has std 0.9866 * std.
    truncated = 0.9866

    def assert_std(tensor, expected):
        assert abs(tensor.std().item() / expected - 1) < 0.05, (tensor.std().item(), expected)

    assert_std(model.tok_embeddings.weight, 1.0)
    for i, layer in model.layers.items():
        out_std = 0.02 / math.sqrt(2 * (int(i) + 1)) * truncated
        assert_std(layer.attention.wq.weight, 0.02 * truncated)
        assert_std(layer.attention.wo.weight, out_std)
        assert_std(layer.feed_forward.w1.weight, 0.02 * truncated)
        assert_std(layer.feed_forward.w2.weight, out_std)
        assert torch.equal(layer.attention_norm.weight, torch.ones(DEBUG.dim))
    output_std = DEBUG.dim ** -0.5
    assert_std(model.output.weight, output_std * truncated)
    assert model.output.weight.abs().max() <= 3 * output_std


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
@pytest.mark.parametrize("tie", [False, True])
def test_param_count_from_args_matches_built_model(flavor, tie):
    args = dataclasses.replace(FLAVORS[flavor], tie_embeddings=tie)
    with torch.device("meta"):
        model = Llama(args, seq_len=16)
    for exclude in (False, True):
        assert num_params(model, exclude) == param_count_for(args, exclude), (flavor, exclude)


def test_flavor_param_counts():
    assert param_count_for(FLAVORS["llama_1b"], exclude_embedding=False) == 1_498_482_688
    assert param_count_for(FLAVORS["llama_1b"], exclude_embedding=True) == 1_235_814_400
    assert param_count_for(FLAVORS["llama_8b"], exclude_embedding=False) == 8_030_261_248
    assert FLAVORS["llama_1b"].rope_scaling_factor == 32 and not FLAVORS["llama_1b"].tie_embeddings


def test_flops_per_token():
    seq_len = 2048
    expected = 6 * param_count_for(DEBUG) + 12 * 4 * 4 * 32 * seq_len
    assert flops_per_token(DEBUG, seq_len) == expected


@pytest.mark.parametrize("change,match", [
    (dict(dim=130), "dim=130 is not divisible by n_heads=4"),
    (dict(n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
    (dict(dim=12, n_heads=4), "head_dim=3 is odd"),
    (dict(n_layers=0), "n_layers=0"),
    (dict(ffn_dim=1.5), "ffn_dim=1.5"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_scaling_factor=0.5), "rope_scaling_factor=0.5"),
    (dict(rope_scaling_factor=8.0, rope_low_freq_factor=4.0), "expected 0 < low < high"),
])
def test_bad_args(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(DEBUG, **change)


def test_sequence_longer_than_built_for():
    with pytest.raises(ValueError, match="seq_len=4096"):
        Llama(DEBUG, seq_len=4096)
    model = _built(seq_len=16)
    with pytest.raises(ValueError, match="at most seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_one_sgd_step_lowers_the_loss():
    model = _built()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 259, (4, 33), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss() -> torch.Tensor:
        logits = model.logits(model(inputs))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    before = loss()
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = loss()
    assert after < before - 1e-3, (before.item(), after.item())
