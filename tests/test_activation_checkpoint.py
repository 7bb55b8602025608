"""parallelisms/activation_checkpoint.py: what each mode recomputes in backward (counted from the
ops that run), that the gradients stay those of no checkpointing, and the per-op policy's choice
for float8's matmuls."""

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from models.args import FLAVORS
from models.llama import Llama
from op_counts import OpCounts
from parallelisms.activation_checkpoint import (ALWAYS_SAVED, _per_op_policy,
                                                apply_activation_checkpointing)
from parallelisms.compile import compile_blocks

aten = torch.ops.aten
PROJECTIONS = 7  # wq, wk, wv, wo, w1, w2, w3: a block's matmuls in forward


def attention_ops(counts: Counter) -> int:
    return sum(n for op, n in counts.items() if op in ALWAYS_SAVED and op is not aten.max.default)


def grads_by_name(model) -> dict:
    """Each parameter's gradient under its plain name: the checkpoint wrapper's and compile's
    modules sit between a block and its parameters."""
    return {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.grad
            for n, p in model.named_parameters()}


def _run(model, tokens):
    hidden = model(tokens)
    with OpCounts() as backward:
        hidden.square().mean().backward()
    return backward.counts, grads_by_name(model)


@pytest.mark.parametrize("mode,option,recomputed_mms,recomputed_attention", [
    # the whole block again, but for w2: backward needs its input, not its output, and the
    # recomputation stops once it has what backward needs
    ("full", "2", PROJECTIONS - 1, 1),
    ("selective", "2", PROJECTIONS - 1, 1),   # every other block
    ("selective", "op", 3, 0),                # wk, wo, w3; the attention's output is kept
])
def test_backward_recomputes_what_the_mode_says(mode, option, recomputed_mms,
                                                recomputed_attention, rng):
    torch.manual_seed(rng.randrange(2**31))
    model = Llama(FLAVORS["debug"], seq_len=32)
    model.init_weights()
    tokens = torch.randint(0, model.args.vocab_size, (2, 32))
    plain_counts, plain_grads = _run(copy.deepcopy(model), tokens)
    layers = apply_activation_checkpointing(model, mode, option)
    every = 2 if option == "2" and mode == "selective" else 1
    assert layers == -(-model.args.n_layers // every) and layers >= 2
    counts, grads = _run(model, tokens)
    assert counts[aten.mm.default] - plain_counts[aten.mm.default] == recomputed_mms * layers
    assert attention_ops(counts) - attention_ops(plain_counts) == recomputed_attention * layers
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_per_op_policy_counts_float8_matmuls_as_matmuls():
    """torchao's float8 layers run aten._scaled_mm: the per-op policy keeps every other one,
    alternating with aten.mm, in forward and the same again when it recomputes."""
    for is_recompute in (False, True):
        ctx, matmuls = SimpleNamespace(is_recompute=is_recompute), Counter()
        calls = [aten._scaled_mm.default, aten.mm.default, aten.silu.default,
                 aten._scaled_mm.default, aten.max.default, aten.mul.Tensor,
                 aten._scaled_dot_product_flash_attention.default, aten._scaled_mm.default]
        got = [_per_op_policy(matmuls, ctx, func) == CheckpointPolicy.MUST_SAVE for func in calls]
        assert got == [True, False, False, True, True, False, True, False]


def test_a_bad_selective_option_is_a_clear_error():
    model = Llama(FLAVORS["debug"], seq_len=8)
    with pytest.raises(ValueError, match=r"selective_ac_option = 'ops': expected 'op' \(per op\)"):
        apply_activation_checkpointing(model, "selective", "ops")


@pytest.mark.slow
def test_per_op_checkpointing_inside_compiled_blocks(rng):
    """The trainer's order (AC, then each block compiled with fullgraph): the policy goes into
    the compiled graphs (they keep less for backward than the compiled blocks without it), and
    the gradients stay those of the eager model without checkpointing."""
    torch.manual_seed(rng.randrange(2**31))
    model = Llama(FLAVORS["debug"], seq_len=32)
    model.init_weights()
    tokens = torch.randint(0, model.args.vocab_size, (2, 32))
    _, plain_grads = _run(copy.deepcopy(model), tokens)
    torch._dynamo.reset()
    unwrapped = copy.deepcopy(model)
    compile_blocks(unwrapped)
    kept_without, _ = _saved_bytes(unwrapped, tokens)
    torch._dynamo.reset()
    apply_activation_checkpointing(model, "selective", "op")
    compile_blocks(model)
    kept, loss = _saved_bytes(model, tokens)
    assert kept < 0.9 * kept_without, (kept, kept_without)
    loss.backward()
    grads = grads_by_name(model)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _saved_bytes(model, tokens) -> tuple[int, torch.Tensor]:
    """(Bytes of the storages autograd keeps for backward, the parameters' left out; the loss)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).square().mean()
    return sum(saved.values()), loss


@pytest.mark.slow
def test_memory_budget_keeps_less_and_changes_no_gradient(rng, monkeypatch):
    """mode = "memory_budget": at budget 0 the compiled blocks keep less for backward than at 1
    (nothing recomputed), with the gradients of the eager model."""
    monkeypatch.setattr(torch._functorch.config, "activation_memory_budget", 1.0)
    seed = rng.randrange(2**31)
    torch.manual_seed(seed)
    reference = Llama(FLAVORS["debug"], seq_len=32)
    reference.init_weights()
    tokens = torch.randint(0, reference.args.vocab_size, (2, 32))
    _, plain_grads = _run(copy.deepcopy(reference), tokens)
    kept = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        model = copy.deepcopy(reference)
        assert apply_activation_checkpointing(model, "memory_budget", memory_budget=budget) == 0
        assert torch._functorch.config.activation_memory_budget == budget
        compile_blocks(model)
        kept[budget], loss = _saved_bytes(model, tokens)
        loss.backward()
        for name, g in grads_by_name(model).items():
            torch.testing.assert_close(g, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert kept[0.0] < 0.8 * kept[1.0], kept
    apply_activation_checkpointing(model, "none")  # the other modes put the budget back
    assert torch._functorch.config.activation_memory_budget == 1.0
