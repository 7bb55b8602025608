"""The model a run trains: its shape from the config (model_args, checked against the parallel
degrees), and the model built with its loss, converted to float8, parallelised and initialised
(build_model)."""

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from components.config.schema import ConfigError, JobConfig
from components.float8_linear import (CONVERTER as FLOAT8_CONVERTER, convert_to_float8,
                                       ignored_settings)
from components.loss import ModelWithLoss, TrainingLoss
from models import FLAVORS, Llama, LlamaArgs, with_context
from models.sdpa import set_sdpa_backend
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import compile_blocks
from parallelisms.context_parallel import check_context_parallel
from parallelisms.fsdp import apply_fsdp
from parallelisms.init import init_as_on_one_device
from parallelisms.mesh import ParallelDims
from parallelisms.tp import apply_tp, check_tp_degree


def model_args(cfg: JobConfig, vocab_floor: int = 0, dims: ParallelDims | None = None
               ) -> LlamaArgs:
    """The model a run trains: the flavor's shape with [model] vocab_size, max_seq_len and
    rope_scaling_factor (scripts/lib/checkpoints.py rebuilds a run's model with it), checked
    against seq_len, the tokenizer's vocab_floor ids and, given dims, the TP and CP degrees."""
    if cfg.model.flavor not in FLAVORS:
        raise ConfigError(f"[model] flavor = {cfg.model.flavor!r}: expected one of the "
                          f"{cfg.model.name} flavors {list(FLAVORS)}")
    args = FLAVORS[cfg.model.flavor]
    args = with_context(dataclasses.replace(args,
                                            vocab_size=cfg.model.vocab_size or args.vocab_size),
                        cfg.model.max_seq_len, cfg.model.rope_scaling_factor)
    if dims is not None:
        check_tp_degree(args, cfg.model.flavor, dims.tp, cfg.training.seq_len)
        check_context_parallel(dims.cp, dims.tp, cfg.training.seq_len, cfg.model.sdpa_backend)
    if cfg.training.seq_len > args.max_seq_len:
        whose = "" if cfg.model.max_seq_len else f" (the {cfg.model.flavor} flavor's)"
        raise ConfigError(f"[training] seq_len = {cfg.training.seq_len} exceeds [model] "
                          f"max_seq_len = {args.max_seq_len}{whose}: set [model] max_seq_len = "
                          f"{cfg.training.seq_len} or more to train longer sequences")
    if args.vocab_size < vocab_floor:
        whose = "" if cfg.model.vocab_size else f" (the {cfg.model.flavor} flavor's)"
        raise ConfigError(f"[model] vocab_size {args.vocab_size}{whose} is smaller than the "
                          f"tokenizer's {vocab_floor} ids: set --model.vocab_size {vocab_floor} "
                          "or more")
    return args


def build_model(cfg: JobConfig, args: LlamaArgs, device: torch.device, dims: ParallelDims,
                mesh=None, *, log: Callable[[str], None]) -> ModelWithLoss:
    """The model of args (model_args(): checked) with the configured loss, converted, parallelised
    and initialised in torchtitan's order. log: where the float8 conversion's line goes."""
    set_sdpa_backend(cfg.model.sdpa_backend, device)  # before compile traces the attention
    with torch.device("meta"):
        model = ModelWithLoss(Llama(args, seq_len=cfg.training.seq_len), TrainingLoss(cfg.loss))
    # torchtitan's order: float8 swaps the linear layers that TP's plan then shards (with
    # float8 styles); the plan names the blocks' submodules, so it goes before the checkpoint
    # wrapper renames them; compile wraps what AC built; FSDP comes last.
    if mesh is None and dist.is_initialized():
        mesh = dims.build_mesh(device.type)
    float8 = cfg.quantize.linear.float8
    if FLOAT8_CONVERTER in cfg.model.converters:
        # the loss takes output.weight itself: a Float8Linear there would never run as one
        done = convert_to_float8(model.model, float8, device, fsdp=mesh is not None,
                                 keep={"output": "the loss reads its weight directly"})
        log(done.summary())
    elif ignored_settings(float8):
        log(f"warning: [quantize.linear.float8] sets {', '.join(ignored_settings(float8))}, but "
            f"[model] converters does not list {FLOAT8_CONVERTER!r}: float8 is off")
    if mesh is not None and dims.tp > 1:
        apply_tp(model, mesh["tp"], cfg.loss.parallel)
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model.model, ac.mode, ac.selective_ac_option, ac.memory_budget)
    if cfg.compile.enable and "model" in cfg.compile.components:
        compile_blocks(model.model)
    if cfg.compile.enable and "loss" in cfg.compile.components:
        model.loss.compile()  # matters for the unfused loss; the fused one is a custom op
    if mesh is not None:
        bf16 = device.type == "cuda" and cfg.training.mixed_precision_param == "bfloat16"
        reduce_bf16 = device.type == "cuda" and cfg.training.mixed_precision_reduce == "bfloat16"
        apply_fsdp(model, mesh, dims, torch.bfloat16 if bf16 else torch.float32,
                   reduce_dtype=torch.bfloat16 if reduce_bf16 else torch.float32,
                   reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward)
    model.to_empty(device=device)
    torch.manual_seed(cfg.training.seed)
    init_as_on_one_device(model, model.model.init_weights)  # the same weights for any layout
    return model
