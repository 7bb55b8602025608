"""Pre-train a Llama with the fused linear cross-entropy (or the unfused baseline).

    python train.py --config configs/debug.toml                       # CPU is fine
    torchrun --nproc_per_node 8 train.py --config configs/llama_1b.toml --training.steps 300

Reads top to bottom: config -> distributed setup -> tokenizer and data -> model on the meta
device -> parallelise -> initialise -> optimizer -> the loop (gradient accumulation with the
loss divided by the global token count, clipping, a sync-free skip of non-finite steps,
metrics, validation).
"""

import dataclasses
import os
import signal
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from components.checkpoint import Checkpointer
from components.config import JobConfig, load_config, to_toml
from components.data import build_data
from components.float8 import CONVERTER as FLOAT8, convert_to_float8, ignored_settings
from components.loss import IGNORE_INDEX, ModelWithLoss, TrainingLoss
from components.metrics import MetricsLogger, StepMeter, peak_flops
from components.optim import build_lr_schedule, build_optimizer
from components.profiling import maybe_profile
from components.tokenizer import build_tokenizer
from models import FLAVORS, Llama, flops_per_token
from models.sdpa import set_sdpa_backend
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import compile_blocks
from parallelisms.fsdp import apply_fsdp, precompute_float8_scales
from parallelisms.init import init_as_on_one_device
from parallelisms.mesh import ParallelDims
from parallelisms.teardown import exit_without_teardown
from parallelisms.tp import apply_tp


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def init_distributed(device_type: str = "auto") -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` is one process. On CUDA even one
    process gets a (single-rank) process group: FSDP then handles bf16 parameters uniformly.
    device_type is [training] device: "auto" takes CUDA when there is one."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("[training] device = \"cuda\", but torch sees no CUDA device")
    cuda = device_type != "cpu" and torch.cuda.is_available()
    if "RANK" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        return dist.get_rank(), dist.get_world_size(), device
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        return 0, 1, torch.device("cuda", 0)
    return 0, 1, torch.device("cpu")


def build_model(cfg: JobConfig, vocab_floor: int, device: torch.device, dims: ParallelDims):
    if cfg.model.flavor not in FLAVORS:
        raise ValueError(f"[model] flavor = {cfg.model.flavor!r}: expected one of {list(FLAVORS)}")
    args = FLAVORS[cfg.model.flavor]
    args = dataclasses.replace(args, vocab_size=cfg.model.vocab_size or args.vocab_size)
    if cfg.training.seq_len > args.max_seq_len:
        raise ValueError(f"[training] seq_len = {cfg.training.seq_len} exceeds the "
                         f"{cfg.model.flavor} flavor's max_seq_len {args.max_seq_len}")
    if args.vocab_size < vocab_floor:
        raise ValueError(f"[model] vocab_size {args.vocab_size} is smaller than the tokenizer's "
                         f"{vocab_floor} ids")
    set_sdpa_backend(cfg.model.sdpa_backend, device)  # before compile traces the attention
    with torch.device("meta"):
        model = ModelWithLoss(Llama(args, seq_len=cfg.training.seq_len), TrainingLoss(cfg.loss))
    # torchtitan's order: float8 swaps the linear layers that TP's plan then shards (with
    # float8 styles); the plan names the blocks' submodules, so it goes before the checkpoint
    # wrapper renames them; compile wraps what AC built; FSDP comes last.
    mesh = dims.build_mesh(device.type) if dist.is_initialized() else None
    float8 = cfg.quantize.linear.float8
    if FLOAT8 in cfg.model.converters:
        # the loss takes output.weight itself: a Float8Linear there would never run as one
        done = convert_to_float8(model.model, float8, device, fsdp=mesh is not None,
                                 keep={"output": "the loss reads its weight directly"})
        log(done.summary())
    elif ignored_settings(float8):
        log(f"warning: [quantize.linear.float8] sets {', '.join(ignored_settings(float8))}, but "
            f"[model] converters does not list {FLOAT8!r}: float8 is off")
    if mesh is not None and dims.tp > 1:
        apply_tp(model, mesh["tp"], cfg.loss.parallel)
    apply_activation_checkpointing(model.model, cfg.activation_checkpoint.mode,
                                   cfg.activation_checkpoint.selective_ac_option)
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
    return model, args


def grad_norm_and_clip(params: list, max_norm: float) -> torch.Tensor:
    """Total gradient norm, clipping in place when max_norm > 0. No host sync.

    Under FSDP + TP the gradients are DTensors on different meshes and placements (TP-sharded
    blocks, the replicated output weight): each such group's norm is reduced over its own mesh,
    then the groups are combined."""
    groups = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            groups[(g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None].append(g)
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def evaluate(model, batches, steps: int, device) -> float:
    """Mean token loss over `steps` held-out batches (all ranks)."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    one = torch.ones((), device=device)
    with torch.no_grad():
        for _ in range(steps):
            inputs, labels = next(batches)
            labels = labels.to(device)
            total[0] += model(inputs.to(device), labels, one).double()
            total[1] += (labels != IGNORE_INDEX).sum()
    model.train()
    total = all_reduce_sum(total)
    return (total[0] / total[1].clamp(min=1)).item()


def train_step(model, micro, optimizer, scheduler, params, max_norm: float, tp: int, device):
    """One optimizer step over the micro-batches. Returns the loss, the gradient norm and
    whether either is non-finite, as device tensors: nothing here waits for the GPU."""
    # The loss is a sum over tokens divided by the global count of non-ignored tokens, so
    # micro-batches and ranks add up to the exact global mean (one all-reduce a step).
    count = sum((labels != IGNORE_INDEX).sum() for _, labels in micro).to(device).float()
    normalizer = (all_reduce_sum(count) / tp).clamp(min=1)
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, labels) in enumerate(micro):
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP: reduce on the last micro-batch
            model.set_requires_gradient_sync(i == len(micro) - 1)
        loss = model(inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True),
                     normalizer)
        loss.backward()
        loss_sum += loss.detach()
    norm = grad_norm_and_clip(params, max_norm)
    bad = ~(torch.isfinite(norm) & torch.isfinite(loss_sum))
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = bad.float()  # fused AdamW skips the update on the device
        optimizer.step()
    elif not bad.item():  # the other AdamW implementations need the host to decide
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, norm, bad


def too_many_bad_steps(n_bad: int, step: int, cfg: JobConfig) -> bool:
    """[training] nan_policy: "stop" at the first non-finite step, "skip" until max_bad_steps in a
    row. Skipped steps leave the weights untouched, so no checkpoint holds a NaN."""
    if n_bad and (cfg.training.nan_policy == "stop" or n_bad >= cfg.training.max_bad_steps):
        log(f"stopping at step {step}: {n_bad} consecutive step(s) with a non-finite loss or "
            f"gradient norm ([training] nan_policy = {cfg.training.nan_policy!r}, max_bad_steps = "
            f"{cfg.training.max_bad_steps})")
        return True
    if n_bad:
        log(f"warning: step {step}: non-finite loss or gradient norm; the optimizer step was "
            f"skipped ({n_bad} in a row)")
    return False


class StopRequest:
    """SIGTERM / SIGUSR1 (what SLURM sends before a time limit) ask for a save and a clean exit.
    Ranks agree on when to stop at log steps (one all-reduce there, no extra host sync)."""

    def __init__(self):
        self.signal_name = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    def agreed(self, device) -> bool:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signal_name is not None
        flag = torch.tensor(float(self.signal_name is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def main(argv=None) -> int:
    cfg = load_config(argv)
    rank, world, device = init_distributed(cfg.training.device)
    finished = False
    try:
        exit_code = train(cfg, rank, world, device)
        finished = True
        return exit_code
    finally:  # also after an error: the next main() in this process can initialise again
        if dist.is_initialized():
            if finished:  # no rank tears gloo down while another still talks to it (seen to abort)
                dist.barrier()
            dist.destroy_process_group()


def train(cfg: JobConfig, rank: int, world: int, device: torch.device) -> int:
    dims = ParallelDims.resolve(cfg.parallelism.data_parallel_replicate_degree,
                                cfg.parallelism.data_parallel_shard_degree,
                                cfg.parallelism.tensor_parallel_degree, world)
    torch.use_deterministic_algorithms(cfg.training.deterministic)
    dump = Path(cfg.job.dump_folder)
    if rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "config.toml").write_text(to_toml(cfg))
        if cfg.job.print_config:
            print(to_toml(cfg), flush=True)

    tokenizer = build_tokenizer(cfg.tokenizer.name, cfg.tokenizer.path or None,
                                cfg.tokenizer.bos_token or None, cfg.tokenizer.eos_token or None)
    model, args = build_model(cfg, tokenizer.vocab_size, device, dims)
    params = [p for p in model.parameters() if p.requires_grad]
    log(f"model {cfg.model.flavor}: {sum(p.numel() for p in params):,} parameters, loss "
        f"{cfg.loss.impl}, world {world} (dp_replicate {dims.dp_replicate}, dp_shard "
        f"{dims.dp_shard}, tp {dims.tp}), device {device.type}")
    optimizer = build_optimizer(model, cfg.optimizer.lr, (cfg.optimizer.beta1, cfg.optimizer.beta2),
                                cfg.optimizer.eps, cfg.optimizer.weight_decay,
                                # fused (CPU and CUDA) can skip a non-finite step without a sync
                                "fused" if cfg.optimizer.implementation == "auto"
                                else cfg.optimizer.implementation)
    scheduler = build_lr_schedule(optimizer, cfg.lr_scheduler.warmup_steps, cfg.training.steps,
                                  cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_ratio,
                                  cfg.lr_scheduler.decay_ratio)
    data_kwargs = dict(source=cfg.data.source, tokenizer=tokenizer, seq_len=cfg.training.seq_len,
                       local_batch_size=cfg.training.local_batch_size,
                       dp_rank=dims.dp_rank(rank), dp_world=dims.dp, synthetic=cfg.data.synthetic,
                       seed=cfg.training.seed, max_token_id=args.vocab_size,
                       streaming=cfg.data.streaming, text_field=cfg.data.text_field,
                       val_every=cfg.data.val_every, cache_dir=cfg.data.cache_dir)
    train_batches = build_data(split="train", **data_kwargs)
    val_batches = build_data(split="validation", **data_kwargs) if cfg.validation.enable else None
    train_iter = iter(train_batches)
    # Every evaluation scores the same held-out batches, so validation losses are comparable.
    val_start = val_batches.state_dict() if val_batches is not None else None

    accum = cfg.training.gradient_accumulation_steps
    ckpt = Checkpointer(cfg.checkpoint, dump, model, optimizer, scheduler, train_batches, accum,
                        rank, to_toml(cfg))
    start_step, tokens_seen = 1, 0
    if cfg.checkpoint.enable_checkpoint or cfg.checkpoint.initial_load_path:
        resumed = ckpt.load()
        if resumed is not None:
            start_step, tokens_seen = resumed.step + 1, resumed.tokens_seen
            log(f"resumed from {ckpt.folder}/step-{resumed.step}")
    stop = StopRequest()
    # Not an optimizer step hook: loading a checkpoint runs a dummy optimizer step before the
    # weights are loaded, which would leave scales of the old weights for the first step.
    precompute_float8 = (FLOAT8 in cfg.model.converters
                         and cfg.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)

    metrics = MetricsLogger(dump, rank, cfg.training.steps, cfg.metrics.enable_wandb,
                            cfg.metrics.wandb_project, cfg.metrics.wandb_run_name or None,
                            cfg.metrics.wandb_mode, cfg.metrics.enable_tensorboard, cfg.to_dict())
    meter = StepMeter(device, world, flops_per_token(args, cfg.training.seq_len), peak_flops(device))
    bad_run = torch.zeros((), device=device)  # consecutive non-finite steps, kept on the device
    exit_code = 0
    with maybe_profile(cfg.profiling, dump, rank) as profiler:
        for step in range(start_step, cfg.training.steps + 1):
            with meter.waiting_for_data():
                micro = [next(train_iter) for _ in range(accum)]
            loss, norm, bad = train_step(model, micro, optimizer, scheduler, params,
                                         cfg.training.max_norm, dims.tp, device)
            if precompute_float8:  # the next float8 all-gathers' scales, in one all-reduce
                precompute_float8_scales(model)
            bad_run = (bad_run + 1) * bad
            step_tokens = sum(inputs.numel() for inputs, _ in micro) // dims.tp
            meter.step_done(step_tokens)
            tokens_seen += step_tokens * world
            if profiler is not None:
                profiler.step()

            last = step == cfg.training.steps
            log_step = step % cfg.metrics.log_freq == 0 or step == start_step or last
            if log_step:
                metrics.log(step, {"loss": all_reduce_sum(loss).item() / dims.tp,
                                   "grad_norm": norm.item(), "lr": scheduler.get_last_lr()[0],
                                   **meter.read()})
                if too_many_bad_steps(int(bad_run.item()), step, cfg):
                    exit_code = 1
                    break
            if cfg.checkpoint.enable_checkpoint and (step % cfg.checkpoint.interval == 0 or last):
                ckpt.save(step, tokens_seen)
                meter.reset()
            if (log_step or world == 1) and stop.agreed(device):
                if cfg.checkpoint.enable_checkpoint and not (step % cfg.checkpoint.interval == 0 or last):
                    ckpt.save(step, tokens_seen)
                log(f"received {stop.signal_name or 'a stop request on another rank'}: stopped "
                    f"after step {step}" + (f", checkpoint in {ckpt.folder}/step-{step}; the same "
                                            "command resumes" if cfg.checkpoint.enable_checkpoint else ""))
                break
            if val_batches is not None and (step % cfg.validation.freq == 0 or last):
                val_batches.load_state_dict(val_start)
                metrics.log(step, {"val_loss": evaluate(model, val_batches, cfg.validation.steps,
                                                        device)})
                meter.reset()  # evaluation time is not training time
    ckpt.wait()
    metrics.close()
    return exit_code


if __name__ == "__main__":
    exit_without_teardown(main())  # everything is written and closed by now
