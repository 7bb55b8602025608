"""AdamW with weight decay on matrices only, and the warmup-then-decay learning-rate schedule."""

import dataclasses
import functools
import math
import typing

import torch

from components.config.schema import DecayType, LRScheduler, Optimizer, OptimizerImplementation

IMPLEMENTATIONS = typing.get_args(OptimizerImplementation)
DECAY_TYPES = typing.get_args(DecayType)
DEFAULT_WSD_DECAY_RATIO = 0.1


def _check_range(name: str, value: float, low: float, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False) -> None:
    """Raise a ValueError naming the config key unless value is a finite number in the range."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low)
    ok = ok and (value < high if high_open else value <= high)
    if not ok:
        closed = not high_open and math.isfinite(high)  # inf itself is never allowed
        interval = ("(" if low_open else "[") + f"{low}, {high}" + ("]" if closed else ")")
        raise ValueError(f"{name} = {value!r}: must be a finite number in {interval}")


# [optimizer] name -> the class (config.OptimizerName lists the names)
OPTIMIZERS = {"AdamW": torch.optim.AdamW}


def check_optimizer_settings(cfg: Optimizer) -> None:
    """Raise a ValueError naming the [optimizer] key of the first bad setting (no model needed:
    the trainer checks them before it builds one)."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"[optimizer] name = {cfg.name!r}: expected one of "
                         f"{', '.join(OPTIMIZERS)}")
    _check_range("[optimizer] lr", cfg.lr, 0.0, low_open=True)
    _check_range("[optimizer] beta1", cfg.beta1, 0.0, 1.0, high_open=True)
    _check_range("[optimizer] beta2", cfg.beta2, 0.0, 1.0, high_open=True)
    _check_range("[optimizer] eps", cfg.eps, 0.0, low_open=True)
    _check_range("[optimizer] weight_decay", cfg.weight_decay, 0.0)
    if cfg.implementation not in IMPLEMENTATIONS:
        raise ValueError(f"[optimizer] implementation = {cfg.implementation!r}: expected one of "
                         f"{', '.join(IMPLEMENTATIONS)}")


def build_optimizer(model: torch.nn.Module, cfg: Optimizer) -> torch.optim.AdamW:
    """[optimizer] name (AdamW) over the model's trainable parameters, in two groups.

    Group 0 (weight_decay): parameters with 2 or more dims (linear weights, embeddings).
    Group 1 (no decay): 1-D parameters (norm scales, biases); decaying them pulls norm gains
    towards zero, which only hurts. An empty group is left out.

    implementation: "fused" (one kernel for all parameters; torch has it for the CPU and CUDA,
    and it skips a step with non-finite gradients on the device, without a host sync: the
    trainer relies on that), "foreach" (batched per-op kernels), "for-loop" (one parameter at a
    time; slowest, smallest peak memory) or "auto" (fused).

    Parameters may be DTensors (FSDP2, tensor parallel): only `.ndim` is read, which gives the
    global rank for a DTensor.
    """
    check_optimizer_settings(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"build_optimizer: {type(model).__name__} has no parameters with "
                         "requires_grad=True to optimize")
    decayed = [p for p in params if p.ndim >= 2]
    not_decayed = [p for p in params if p.ndim < 2]
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay},
              {"params": not_decayed, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    implementation = "fused" if cfg.implementation == "auto" else cfg.implementation
    return OPTIMIZERS[cfg.name](groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                fused=implementation == "fused",
                                foreach=implementation == "foreach")


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, decay_type: str = "cosine",
                  min_lr_factor: float = 0.1, decay_ratio: float | None = None) -> float:
    """The factor on the peak lr for training step `step`, counted from 1.

    Step 1 is the first optimizer.step() and gets 1/warmup_steps (step 0, before training, is 0:
    the ramp starts from zero). Warmup ends at the full lr on step warmup_steps (without warmup,
    on step 1, unless it is the run's only step: a decay that began at step 0 never gave the full
    lr); the lr then
    stays there until the decay's first step (the last `decay_ratio` share of total_steps; with
    decay_ratio None, right after warmup), and the decay reaches min_lr_factor exactly on step
    total_steps and stays there after it. Its shape over that span, progress p from 0 to 1:
      cosine: 0.5 (1 + cos(pi p)); linear: 1 - p; sqrt: 1 - sqrt(p) (torchtitan's three);
      wsd:    linear, over the last decay_ratio (None: 0.1) of the steps.
    Arguments are checked by build_lr_schedule, not here (this runs every step).
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return max(step, 0) / warmup_steps
    decay_start = total_steps - _decay_steps(total_steps, warmup_steps, decay_type, decay_ratio)
    if total_steps > 1:  # one step only: it is the last, on min_lr
        decay_start = max(decay_start, 1)
    if step <= decay_start:
        return 1.0
    progress = min((step - decay_start) / (total_steps - decay_start), 1.0)
    if decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 1.0 - progress
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def _decay_steps(total_steps: int, warmup_steps: int, decay_type: str,
                 decay_ratio: float | None) -> int:
    if decay_ratio is None and decay_type != "wsd":
        return total_steps - warmup_steps
    ratio = DEFAULT_WSD_DECAY_RATIO if decay_ratio is None else decay_ratio
    # At least one step, so that the last step always lands on the minimum.
    return max(1, round(ratio * total_steps))


def _lambda_for_scheduler(last_epoch: int, **schedule) -> float:
    # LambdaLR counts from 0 (its value at construction is the lr of the first optimizer.step()),
    # the schedule counts training steps from 1.
    return lr_multiplier(last_epoch + 1, **schedule)


def _schedule_steps(cfg: LRScheduler, training_steps: int) -> tuple[int, str]:
    """The steps the schedule spans and the key that set them."""
    if cfg.total_steps is None:
        return training_steps, "[training] steps"
    return cfg.total_steps, "[lr_scheduler] total_steps"


def _check_schedule(cfg: LRScheduler, training_steps: int) -> None:
    """The schedule's settings, each on its own (whether they fit together is checked apart)."""
    warmup_steps, decay_type, decay_ratio = cfg.warmup_steps, cfg.decay_type, cfg.decay_ratio
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"[lr_scheduler] decay_type = {decay_type!r}: expected one of "
                         f"{', '.join(DECAY_TYPES)}")
    total_steps, total_key = _schedule_steps(cfg, training_steps)
    for name, value in (("[training] steps", training_steps), (total_key, total_steps),
                        ("[lr_scheduler] warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} = {value!r}: must be an int")
    for name, value in (("[training] steps", training_steps), (total_key, total_steps)):
        if value < 1:
            raise ValueError(f"{name} = {value}: must be >= 1")
    if warmup_steps < 0:
        raise ValueError(f"[lr_scheduler] warmup_steps = {warmup_steps}: must be >= 0")
    _check_range("[lr_scheduler] min_lr_factor", cfg.min_lr_factor, 0.0, 1.0)
    if decay_ratio is not None:
        _check_range("[lr_scheduler] decay_ratio", decay_ratio, 0.0, 1.0, low_open=True)


def fit_lr_schedule(cfg: LRScheduler, training_steps: int) -> tuple[LRScheduler, str | None]:
    """Fit the warmup (and a decay_ratio's decay) into a schedule too short for them, e.g. a smoke
    run of `--training.steps 20` under a config with 20 warmup steps: ([lr_scheduler] with the
    fitted warmup_steps and decay_ratio, a one-line warning or None when they already fit), for
    build_lr_schedule.

    As torchtitan 0.2 does, the warmup is clamped and then the decay shortened to the steps
    left; unlike it, the warmup ends one step before the schedule does (torchtitan's can take
    the whole run), so the last step still lands on min_lr_factor, as in every schedule here.
    Settings that are wrong in themselves raise, naming the key."""
    _check_schedule(cfg, training_steps)
    total_steps, total_key = _schedule_steps(cfg, training_steps)
    warmup_steps, decay_ratio = cfg.warmup_steps, cfg.decay_ratio
    notes = []
    if warmup_steps >= total_steps:
        notes.append(f"[lr_scheduler] warmup_steps = {warmup_steps} does not fit in {total_key} "
                     f"= {total_steps}: warming up over {total_steps - 1} step(s)")
        warmup_steps = total_steps - 1
    decay_steps = _decay_steps(total_steps, warmup_steps, cfg.decay_type, decay_ratio)
    if warmup_steps + decay_steps > total_steps:  # only a decay_ratio's (or wsd's) decay can
        decay_steps = total_steps - warmup_steps
        ratio = DEFAULT_WSD_DECAY_RATIO if decay_ratio is None else decay_ratio
        notes.append(f"the decay ([lr_scheduler] decay_ratio = {ratio}) takes the last "
                     f"{decay_steps} step(s), those after the {warmup_steps} of warmup")
        decay_ratio = decay_steps / total_steps
    fitted = dataclasses.replace(cfg, warmup_steps=warmup_steps, decay_ratio=decay_ratio)
    # no "(a short run)": a decay_ratio of 1.0 overlaps any warmup, however long the run
    return fitted, ("warning: " + "; ".join(notes) if notes else None)


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: LRScheduler, training_steps: int
                      ) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following lr_multiplier; call scheduler.step() once after each optimizer.step().

    Right after construction the optimizer's lr is already the one for step 1 (lr/warmup_steps).
    state_dict() holds the step count and the base lrs, not the multiplier (a functools.partial,
    which LambdaLR does not save): after loading a checkpoint, restore_hyperparameters() puts the
    resumed config's base lrs back, so a resumed run follows the schedule of its own config.
    The schedule spans [lr_scheduler] total_steps, or training_steps when that is unset. A warmup
    (and decay) that does not fit in it is an error here: fit_lr_schedule() fits them first.
    """
    _check_schedule(cfg, training_steps)
    total_steps, total_key = _schedule_steps(cfg, training_steps)
    warmup_steps, decay_ratio = cfg.warmup_steps, cfg.decay_ratio
    if warmup_steps >= total_steps:
        raise ValueError(f"[lr_scheduler] warmup_steps = {warmup_steps} must be smaller than "
                         f"{total_key} = {total_steps}, to leave at least one step of decay")
    decay_steps = _decay_steps(total_steps, warmup_steps, cfg.decay_type, decay_ratio)
    if warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"[lr_scheduler] warmup_steps = {warmup_steps} plus the decay ({decay_steps} steps "
            f"from [lr_scheduler] decay_ratio = {decay_ratio}) exceed {total_key} = {total_steps}: "
            "lower one of them")
    schedule = functools.partial(_lambda_for_scheduler, warmup_steps=warmup_steps,
                                 total_steps=total_steps, decay_type=cfg.decay_type,
                                 min_lr_factor=cfg.min_lr_factor, decay_ratio=decay_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings without its parameters: lr, initial_lr (the schedule's peak),
    betas, eps, weight_decay and the implementation flags (fused, foreach, ...)."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


def restore_hyperparameters(optimizer: torch.optim.Optimizer,
                            scheduler: torch.optim.lr_scheduler.LambdaLR,
                            groups: list[dict]) -> None:
    """Put back the settings that hyperparameters() took before a checkpoint was loaded.

    Loading an optimizer's state dict also loads the saved run's param-group settings, and
    loading the schedule's its base lrs: a resumed run would silently keep the old lr, betas,
    eps and weight decay. The resumed config wins instead; what the checkpoint keeps is the
    optimizer's state (moment estimates, step counts) and the schedule's step count. Each group's
    lr is set to the resumed schedule's value for that step.
    """
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"restore_hyperparameters: {len(groups)} saved settings for "
                         f"{len(optimizer.param_groups)} param groups")
    for group, settings in zip(optimizer.param_groups, groups):
        group.update(settings)
    scheduler.base_lrs = [settings["initial_lr"] for settings in groups]
    lrs = [base * multiplier(scheduler.last_epoch)
           for base, multiplier in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() returns; LambdaLR sets it only in step()
