"""Pre-train a Llama with the fused linear cross-entropy (or the unfused baseline).

    python train.py --config configs/debug.toml                       # CPU is fine
    torchrun --nproc_per_node 8 train.py --config configs/llama_1b.toml --training.steps 300

Reads top to bottom: config -> distributed setup -> tokenizer and data -> the model
(parallelisms/build.py: on the meta device, parallelised, initialised) -> optimizer -> the loop
(gradient accumulation with the loss divided by the global token count, clipping, a sync-free
skip of non-finite steps, metrics, validation: components/validation.py).
"""

import dataclasses
import datetime
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

if __name__ == "__main__":  # before the imports below: a stop signal during them is kept
    from components.stop_request import remember_stop_signals
    remember_stop_signals()

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from components.allocator import default_allocator_settings
from components.bad_steps import BadSteps, too_many_bad_steps
from components.checkpoint import Checkpointer, TrainState
from components.checkpoint_folders import (ResumePoint, check_resumed_tokenizer, find_resume_point,
                                           list_checkpoints)
from components.config.checks import resolve_global_batch
from components.config.docs import help_text
from components.config.parse import (check_config_not_overwritten, config_checks, is_config_error,
                                     load_config, refusal_line, wants_help)
from components.config.schema import ConfigError, JobConfig
from components.config.toml_out import config_changes, to_toml
from components.data.build import build_data
from components.float8_linear import CONVERTER as FLOAT8_CONVERTER, check_fp8_device
from components.host_memory import available_bytes, check_run_fits_on_cpu
from components.initial_load import other_tokenizer_warning, take_settings_from_initial_load
from components.lock import dump_folder_lock
from components.loss import IGNORE_INDEX, TrainingLoss
from components.metrics import MetricsLogger, StepMeter, check_metrics_backends, peak_flops
from components.optim import (build_lr_schedule, build_optimizer, check_optimizer_settings,
                              fit_lr_schedule, hyperparameters, restore_hyperparameters)
from components.process import (all_reduce_sum, back_to_init_timeout,
                                deterministic_mode_restored, exit_process, init_timeout_phase,
                                make_traces_folder, process_group, start_train_timeout)
from components.profiling import maybe_profile
from components.rank_warnings import said_by_rank_zero
from components.stop_request import StopRequest
from components.tokenizer import Tokenizer, build_tokenizer
from components.validation import Validation, validate_the_resumed_step
from models import LlamaArgs, flops_per_token
from models.hf import load_hf_weights
from models.sdpa import check_sdpa_backend
from parallelisms.activation_checkpoint import check_settings as check_ac_settings
from parallelisms.build import build_model, model_args
from parallelisms.context_parallel import NoSharding, SequenceSharding
from parallelisms.fsdp import precompute_float8_scales
from parallelisms.mesh import ParallelDims
from parallelisms.tp import check_loss_parallel


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


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


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


# The tensor- and context-parallel ranks of a data-parallel rank all read the same batch
# (dims.same_batch = tp x cp of them), so a sum over the world counts what each of them holds
# whole that many times, and a device trains on its share of the batch's tokens:
# - the labels: every one of them holds all of the batch's, so token counts are divided by
#   dims.same_batch (shard.degree, the cp degree, where the tp repeats cancel in a ratio);
# - the loss: each tp rank ends with the whole loss of its part of the sequences (the parallel
#   loss styles reduce over tp), and the cp ranks' parts add up, so the loss is divided by dims.tp.
def once_per_batch(total, shared_by: int):
    """total counted once where shared_by ranks each counted it (see above); an int stays one."""
    return total // shared_by if isinstance(total, int) else total / shared_by


def train_step(model, micro, optimizer, scheduler, params, max_norm: float, same_batch: int,
               device, shard=NoSharding()):
    """One optimizer step over the micro-batches. Returns the loss, the gradient norm and
    whether either is non-finite, as device tensors: nothing here waits for the GPU.
    same_batch: ranks that read each batch (tensor x context parallel); shard: context
    parallelism's, around each forward and backward."""
    # The loss is a sum over tokens divided by the global count of non-ignored tokens, so
    # micro-batches and ranks add up to the exact global mean (one all-reduce a step).
    count = sum((labels != IGNORE_INDEX).sum() for _, labels in micro).to(device).float()
    normalizer = once_per_batch(all_reduce_sum(count), same_batch).clamp(min=1)
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, labels) in enumerate(micro):
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP: reduce on the last micro-batch
            model.set_requires_gradient_sync(i == len(micro) - 1)
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with shard(inputs, labels) as (inputs, labels):  # context parallelism: this rank's part
            loss = model(inputs, labels, normalizer)
            loss.backward()
        loss_sum += loss.detach()
    norm = grad_norm_and_clip(params, max_norm)
    # Every rank must decide alike: a rank skipping its update alone leaves its FSDP shards
    # behind the others'. The norm is global, but a rank's loss (its part of the batch's) may be
    # non-finite with finite gradients (a softmax gradient is bounded), so one more tiny
    # all-reduce, no host sync.
    bad = all_reduce_max((~(torch.isfinite(norm) & torch.isfinite(loss_sum))).float()) > 0
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = bad.float()  # fused AdamW skips the update on the device
        optimizer.step()
    elif not bad.item():  # the other AdamW implementations need the host to decide
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, norm, bad


def log_resume(path: Path, cfg: JobConfig) -> None:
    """Say where the run resumes from and how its config differs from the one that wrote the
    checkpoint (this run's values are used)."""
    log(f"resumed from {path}")
    saved = path / "config.toml"
    if not saved.is_file():
        log(f"  ({saved} is missing: cannot list config changes)")
        return
    try:
        changes = config_changes(saved.read_text(), cfg)
    except (OSError, ValueError) as e:  # only informative: the run goes on
        log(f"  warning: {saved} cannot be read ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}): not listing the config changes since it")
        return
    if changes:
        log("config changes since the checkpoint (this run's values are used):")
        for change in changes:
            log(f"  {change}")


def log_summary(cfg: JobConfig, started: float, first_step: int, last_step: int,
                tokens: int, tokens_seen: int, metrics: MetricsLogger, ckpt: Checkpointer,
                stopped: bool = False) -> None:
    """What the run did and where its outputs are, after the last step (rank 0); stopped: the
    run gave up (too many bad steps), which its last step may be too."""
    wall = datetime.timedelta(seconds=round(time.monotonic() - started))
    if last_step < first_step:
        log(f"done: no step left to train (resumed after step {last_step} of "
            f"{cfg.training.steps}) in {wall}; config.toml is the run's that trained")
    else:
        steps = f"steps {first_step}-{last_step}" if last_step > first_step else f"step {last_step}"
        resumed = f" ({tokens_seen:,} since step 1)" if tokens_seen != tokens else ""
        ended = "done" if last_step == cfg.training.steps and not stopped else "stopped"
        log(f"{ended}: {steps} of "
            f"{cfg.training.steps} in {wall}, {tokens:,} tokens{resumed}")
    if cfg.job.description:
        log(f"  run: {cfg.job.description}")
    at = lambda step_value: f"{step_value[1]:.4f} (step {step_value[0]})"  # noqa: E731
    results = [f"{what} {at(table[key])}" for what, table, key in (
        ("final loss", metrics.last, "loss"), ("validation loss", metrics.last, "val_loss"),
        ("best", metrics.lowest, "val_loss")) if key in table]
    if results:
        log("  " + ", ".join(results))
    log(f"  metrics: {metrics.jsonl_path}")
    saved = sorted(list_checkpoints(ckpt.folder)) if cfg.checkpoint.enable else []
    if saved:
        log(f"  checkpoints: {ckpt.folder} (latest step-{saved[-1]})")
    if metrics.wandb_dir is not None:
        log(f"  wandb ({cfg.metrics.wandb_mode}): {metrics.wandb_dir}"
            + (f"; upload it with: wandb sync {metrics.wandb_dir}"
               if cfg.metrics.wandb_mode == "offline" else ""))
    if metrics.tensorboard_dir is not None:
        log(f"  tensorboard: tensorboard --logdir {metrics.tensorboard_dir}")


def main(argv=None) -> int:
    """Train with the config that argv (default: the command line) gives; -h / --help prints
    every config key. A bad config raises ConfigError (the command line shows it as one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_help(argv):
        print(help_text(__doc__.split("\n", 1)[0]), end="", flush=True)
        return 0
    cfg = load_config(argv)
    check_config_not_overwritten(argv, cfg)
    default_allocator_settings()
    # From here on a stop signal is remembered: it takes effect after the first training step.
    # said_by_rank_zero: torchrun's RANK, read before the process group that takes it
    with deterministic_mode_restored(), said_by_rank_zero(int(os.environ.get("RANK", "0"))), \
            StopRequest(saves=cfg.checkpoint.enable) as stop, \
            process_group(cfg.training.device, cfg.comm,
                          cfg.job.dump_folder) as (rank, world, device), \
            dump_folder_lock(cfg.job.dump_folder, rank,  # before anything is written there
                             cfg.checkpoint.folder if cfg.checkpoint.enable else None):
        make_traces_folder(cfg.comm, cfg.job.dump_folder, device)
        return train(cfg, rank, world, device, stop)


def check_before_building(cfg: JobConfig, rank: int, world: int, device: torch.device
                          ) -> tuple[ParallelDims, Tokenizer, LlamaArgs, object, ResumePoint]:
    """What would otherwise fail only after the model is built, as config errors (one line, exit
    2): the parallel degrees, the tokenizer, the optimizer and schedule settings, the checkpoint
    to resume (and that it was trained with this tokenizer), the metrics backends, the model's
    shape (and, on the CPU, that this machine can hold it), the loss, activation checkpointing,
    attention and float8 settings. The config is written to <dump_folder>/config.toml only once
    the data and the checkpoint to resume were opened too (in train(), after the
    MetricsLogger): a refused run leaves the config of the run that wrote the folder's metrics
    in place."""
    with config_checks():
        dims = ParallelDims.resolve(cfg.parallelism.data_parallel_replicate_degree,
                                    cfg.parallelism.data_parallel_shard_degree,
                                    cfg.parallelism.tensor_parallel_degree, world,
                                    cfg.parallelism.context_parallel_degree)
        batch_note = resolve_global_batch(cfg, dims.dp)
    if cfg.training.deterministic:
        # cuBLAS shares its workspace across streams unless told its size: under deterministic
        # algorithms torch then refuses the first CUDA matmul (a RuntimeError asking for this
        # variable). Set before any cuBLAS call, as torchtitan sets it; a user's value stays.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(cfg.training.deterministic)
    with config_checks():  # before config.toml records the settings
        take_settings_from_initial_load(cfg, log)
    dump = Path(cfg.job.dump_folder)
    with config_checks():
        tokenizer = build_tokenizer(cfg.tokenizer.name, cfg.tokenizer.path or None,
                                    cfg.tokenizer.bos_token or None,
                                    cfg.tokenizer.eos_token or None, log=log)
        check_optimizer_settings(cfg.optimizer)
        schedule, schedule_note = fit_lr_schedule(cfg.lr_scheduler, cfg.training.steps)
        resume = find_resume_point(cfg.checkpoint, dump / cfg.checkpoint.folder)
        if resume.step is not None:
            check_resumed_tokenizer(resume.found[resume.step], tokenizer.fingerprint())
        elif rank == 0 and (note := other_tokenizer_warning(cfg.checkpoint.initial_load_path,
                                                            tokenizer.fingerprint())):
            log(note)  # read by rank 0 alone, which says it
        check_metrics_backends(cfg.metrics)
        args = model_args(cfg, tokenizer.vocab_size, dims)
        if device.type == "cpu":  # too large there, the kernel kills it without a word
            refusal = None
            try:
                tokens = cfg.training.local_batch_size * cfg.training.seq_len // dims.same_batch
                check_run_fits_on_cpu(cfg, args, world // dims.dp_replicate, tokens,
                                      available_bytes())
            except ConfigError as e:
                refusal = e
            raise_on_every_rank(refusal)  # ranks read the free memory at different moments
        TrainingLoss(cfg.loss)
        if dims.tp > 1:
            check_loss_parallel(cfg.loss.parallel, cfg.loss.impl, cfg.loss.memory_lean,
                                cfg.loss.float8)
        if cfg.loss.memory_lean and cfg.loss.impl != "flce":
            log(f"warning: [loss] memory_lean = true applies to impl = \"flce\" only; "
                f"impl = {cfg.loss.impl!r} ignores it")
        if cfg.loss.chunk_size and cfg.loss.impl == "unfused":
            log(f"warning: [loss] chunk_size = {cfg.loss.chunk_size} applies to impl = \"flce\" "
                "and \"torch_chunked\"; impl = 'unfused' ignores it")
        if cfg.loss.parallel == "vocab" and cfg.parallelism.tensor_parallel_degree == 1:
            log("warning: [loss] parallel = \"vocab\" shards the output layer over the tensor-"
                "parallel ranks; with [parallelism] tensor_parallel_degree = 1 it does nothing")
        check_ac_settings(cfg.activation_checkpoint.mode,
                          cfg.activation_checkpoint.selective_ac_option)
        check_sdpa_backend(cfg.model.sdpa_backend, device)
        if FLOAT8_CONVERTER in cfg.model.converters:
            check_fp8_device(cfg.quantize.linear.float8, device)
    if rank == 0 and cfg.job.print_config:
        print(to_toml(cfg), flush=True)
    for note in (batch_note, schedule_note):
        if note:
            log(note)
    return dims, tokenizer, args, schedule, resume


def log_run(cfg: JobConfig, params: list, world: int, dims: ParallelDims, device) -> None:
    if cfg.job.description:
        log(f"run: {cfg.job.description}")
    log(f"model {cfg.model.name} {cfg.model.flavor}: {sum(p.numel() for p in params):,} "
        f"parameters, loss {cfg.loss.impl}, world {world} (dp_replicate {dims.dp_replicate}, dp_shard "
        f"{dims.dp_shard}, tp {dims.tp}" + (f", cp {dims.cp}" if dims.cp > 1 else "")
        + f"), device {device.type}")


def nan_loss_at_test_steps(model: torch.nn.Module, scheduler) -> None:
    """Test-only fault injection (tests/test_train_non_finite.py): FLCE_TEST_NAN_STEPS=2,5 makes
    the training loss NaN at those steps, as a bad batch would. Without it (always outside the
    tests) nothing is installed. The step is the schedule's: scheduler.step() runs once a step,
    bad steps too. FLCE_TEST_NAN_RANK=r: only rank r's loss, and only its value (its gradients
    stay finite)."""
    steps = {int(s) for s in os.environ.get("FLCE_TEST_NAN_STEPS", "").split(",") if s.strip()}
    rank = os.environ.get("FLCE_TEST_NAN_RANK")
    if not steps:
        return
    if rank is None:
        model.register_forward_hook(lambda module, args, loss: loss * float("nan") if (
            module.training and scheduler.last_epoch + 1 in steps) else None)
    elif dist.get_rank() == int(rank):
        # + NaN: the value is NaN, the gradient (1 x upstream) is not
        model.register_forward_hook(lambda module, args, loss: loss + float("nan") if (
            module.training and scheduler.last_epoch + 1 in steps) else None)


def injected_stalls(rank: int) -> dict[str, float]:
    """Test-only fault injection (tests/test_comm_timeouts.py), read once:
    FLCE_TEST_STALL=<rank>:<where>@<step>:<seconds>[,...] makes that rank sleep there, as a hung
    or slow rank would; where is "step" (before the step's work) or "save" (right after its
    checkpoint save, where rank 0 commits and prunes alone). {"<where>@<step>": seconds} of this
    rank; empty (always outside the tests) when unset."""
    stalls = {}
    for point in filter(None, os.environ.get("FLCE_TEST_STALL", "").split(",")):
        who, _, rest = point.partition(":")
        here, _, seconds = rest.partition(":")
        if int(who) == rank:
            stalls[here] = float(seconds)
    return stalls


def resume_run(cfg: JobConfig, ckpt: Checkpointer, resume: ResumePoint, optimizer,
               scheduler) -> TrainState:
    """The state after the resumed checkpoint (its step, the tokens seen, its metrics' first
    line's time), if any; initial_load_path's weights start at step 1 (TrainState())."""
    if not (cfg.checkpoint.enable or cfg.checkpoint.initial_load_path):
        return TrainState()
    configured = hyperparameters(optimizer)
    with config_checks():  # e.g. an initial_load_path of another vocabulary
        resumed = ckpt.load(resume)
    if resumed is None:
        return TrainState()
    # The checkpoint brings back its run's lr, betas, eps, weight decay and base lrs with the
    # optimizer state; this run's config wins (the moments and step counts stay).
    restore_hyperparameters(optimizer, scheduler, configured)
    log_resume(ckpt.folder / f"step-{resumed.step}", cfg)
    return resumed


def build_datasets(cfg: JobConfig, tokenizer: Tokenizer, args: LlamaArgs, dims: ParallelDims,
                   rank: int, device, shard) -> tuple:
    """This rank's training batches, and the validation when [validation] enable."""
    share = dict(tokenizer=tokenizer, dp_rank=dims.dp_rank(rank), dp_world=dims.dp,
                 max_token_id=args.vocab_size)
    failure = train_batches = validation = None
    try:
        with config_checks():  # data mistakes (a wrong path, shards of another tokenizer) too
            train_batches = build_data(cfg.data, cfg.training, split="train", **share)
            validation = (Validation(cfg, build_data(cfg.data, cfg.training, split="validation",
                                                     **share),
                                     tokenizer, args.vocab_size, device, shard, log)
                          if cfg.validation.enable else None)
    except Exception as e:
        failure = e
    raise_on_every_rank(failure)  # a rank's share may be empty while the others' are not
    log(train_batches.describe())
    return train_batches, validation


def raise_on_every_rank(error: BaseException | None) -> None:
    """After a setup step that may fail on some ranks alone, every rank raises the first failing
    rank's error (the failing rank its own), so that local rank 0 prints it in one line. Before,
    rank 0 went on into a collective and said only that gloo's peer had closed the connection."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else (" ".join(str(error).split()), is_config_error(error),
                                       getattr(error, "user_error", False))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if error is not None:
        raise error
    rank, failed = next(((r, e) for r, e in enumerate(everyone) if e is not None), (None, None))
    if failed is None:
        return
    message, from_config, user_error = failed
    agreed = (ValueError if from_config or user_error else RuntimeError)(f"rank {rank}: {message}")
    agreed.from_config, agreed.user_error = from_config, user_error
    raise agreed


def train(cfg: JobConfig, rank: int, world: int, device: torch.device, stop: StopRequest) -> int:
    started = time.monotonic()
    dims, tokenizer, args, schedule, resume = check_before_building(cfg, rank, world, device)
    mesh = dims.build_mesh(device.type) if dist.is_initialized() else None
    model = build_model(cfg, args, device, dims, mesh, log=log)
    shard = (SequenceSharding(mesh["cp"], model.model, cfg.parallelism.context_parallel_rotate_method)
             if dims.cp > 1 else NoSharding())
    params = [p for p in model.parameters() if p.requires_grad]
    log_run(cfg, params, world, dims, device)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_lr_schedule(optimizer, schedule, cfg.training.steps)
    nan_loss_at_test_steps(model, scheduler)
    train_batches, validation = build_datasets(cfg, tokenizer, args, dims, rank, device, shard)
    train_iter = iter(train_batches)
    ckpt = Checkpointer(cfg, model, optimizer, scheduler, train_batches, rank, dims.dp_rank(rank),
                        read_hf_folder=lambda folder: {
                            f"model.{k}": v for k, v in load_hf_weights(folder, args).items()},
                        tokenizer={"fingerprint": tokenizer.fingerprint(),
                                   "vocab_size": tokenizer.vocab_size})
    resumed = resume_run(cfg, ckpt, resume, optimizer, scheduler)
    start_step, tokens_seen = resumed.step + 1, resumed.tokens_seen
    # Not an optimizer step hook: loading a checkpoint runs a dummy optimizer step before the
    # weights are loaded, which would leave scales of the old weights for the first step.
    precompute_float8 = (FLOAT8_CONVERTER in cfg.model.converters
                         and cfg.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)
    dump = Path(cfg.job.dump_folder)
    # A resume with no step left writes over nothing the run that trained wrote: its
    # config.toml says what made the metrics, and a wandb run or a TensorBoard file of this
    # one's would hold no step (a validation of the resumed step still goes to metrics.jsonl).
    nothing_left = start_step > cfg.training.steps
    backends = (dataclasses.replace(cfg.metrics, enable_wandb=False, enable_tensorboard=False)
                if nothing_left else cfg.metrics)
    metrics = MetricsLogger(dump, rank, cfg.training.steps, backends, config=cfg.to_dict(),
                            notes=cfg.job.description, first_step=start_step,
                            timeline=resumed.metrics_started,
                            outputs=(cfg.profiling.save_traces_folder,
                                     cfg.profiling.save_memory_snapshot_folder))
    if rank == 0 and not (nothing_left and (dump / "config.toml").is_file()):
        (dump / "config.toml").write_text(to_toml(cfg))  # after the logger set any earlier aside
    if validation is not None:
        with init_timeout_phase():
            validate_the_resumed_step(validation, model, resumed.step, metrics)
    meter = StepMeter(device, world, flops_per_token(args, cfg.training.seq_len), peak_flops(device))
    bad_steps = BadSteps(device, start_step)
    exit_code, run_tokens, step = 0, 0, start_step - 1
    stalls = injected_stalls(rank)
    # [comm] timeouts (components/process.py): the first step (compilation, warm-up) runs under
    # init_timeout_seconds, the later ones under train_timeout_seconds, except where ranks may
    # wait on slow work without anything being wrong, which go back to the init timeout:
    # - a checkpoint save: the ranks wait on each other's DCP writes, then on rank 0 alone
    #   committing and pruning (an async save's own collectives keep their group's timeout,
    #   components/checkpoint.py);
    # - an evaluation: the first one compiles the model's eval graphs, on every rank;
    # - the end of the run: the last async save, rank 0 alone closing wandb / TensorBoard and
    #   writing the summary while the others wait in the final barrier.
    # Nowhere else does a rank work alone while the others wait: rank 0's logging is a line to
    # metrics.jsonl and stdout and a call queueing it for wandb / TensorBoard; every rank writes
    # its own traces and memory snapshots; resuming and loading weights (rank 0 alone reads a
    # Hugging Face folder) come before the first step.
    with maybe_profile(cfg.profiling, dump, rank, device, log, start_step,
                       cfg.training.steps) as profiler:
        for step in range(start_step, cfg.training.steps + 1):
            if stalls and f"step@{step}" in stalls:
                time.sleep(stalls[f"step@{step}"])
            with meter.waiting_for_data():
                micro = [next(train_iter) for _ in range(cfg.training.gradient_accumulation_steps)]
            lr = optimizer.param_groups[0]["lr"]  # this step's (train_step moves the schedule on)
            loss, norm, bad = train_step(model, micro, optimizer, scheduler, params,
                                         cfg.training.max_norm, dims.same_batch, device, shard)
            if precompute_float8:  # the next float8 all-gathers' scales, in one all-reduce
                precompute_float8_scales(model)
            bad_steps.update(bad, step)
            step_tokens = once_per_batch(sum(x.numel() for x, _ in micro), dims.same_batch)
            meter.step_done(step_tokens)
            tokens_seen += step_tokens * world
            run_tokens += step_tokens * world
            if profiler is not None:
                profiler.step(step)
            logs = metrics.logs_at(step)
            stopping = stop.agreed(device, ranks_talk=logs)  # all-reduces on log steps only
            saves = ckpt.saves_at(step, stopping)
            # The host waits for the device on these steps only, and every rank takes part in
            # their collectives (bad step counts, a failed async save): the same steps on all.
            if logs or saves or stopping:
                counts = bad_steps.read(step)
                metrics.log(step, {"loss": once_per_batch(all_reduce_sum(loss).item(), dims.tp),
                                   "grad_norm": norm.item(), "lr": lr, **meter.read(),
                                   "bad_steps": counts["total"],
                                   "skipped_steps_since_last_log": counts["since_read"]})
                if too_many_bad_steps(counts, step, cfg.training, log):
                    exit_code = 1
                    break
                ckpt.raise_if_async_save_failed(device)
            if saves:
                with init_timeout_phase():
                    ckpt.save(step, tokens_seen, metrics.started)
                    if stalls and f"save@{step}" in stalls:
                        time.sleep(stalls[f"save@{step}"])
                meter.reset()
            if stopping:
                log(stop.stopped_line(step, ckpt.folder / f"step-{step}" if saves else None))
                break
            if validation is not None and validation.due(step):
                with init_timeout_phase():
                    validation.run(model, step, metrics)
                meter.reset()  # evaluation time is not training time
            if step == start_step:  # its compilation and warm-up are done, on every rank
                start_train_timeout()
        back_to_init_timeout()
    ckpt.wait()
    metrics.close()
    train_batches.close()  # its thread and tokenizer workers
    if validation is not None:
        validation.batches.close()
    if rank == 0:
        log_summary(cfg, started, start_step, step, run_tokens, tokens_seen, metrics, ckpt,
                    stopped=exit_code != 0)
    return exit_code


def command_line() -> int:
    """main() for `python3 train.py` / torchrun: a config error, or another refusal the user
    caused (a dump folder in use, data that cannot be read), is one line on stderr (once per
    node: every rank has the same command line) and exit status 2, without a traceback."""
    try:
        return main()
    except Exception as e:
        line = refusal_line(e)
        if line is None:
            raise
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(line, file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    exit_process(command_line())  # everything is written and closed by now
