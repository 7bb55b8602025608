"""The optimizer's parameter groups and implementations; the lr schedule against its formula."""

import copy
import math

import pytest
import torch

from components.config.schema import LRScheduler, Optimizer
from components.optim import (build_lr_schedule, build_optimizer, fit_lr_schedule,
                              hyperparameters, lr_multiplier, restore_hyperparameters)

LR = 1e-3


def adamw(model: torch.nn.Module, **settings) -> torch.optim.AdamW:
    """build_optimizer with [optimizer] settings (lr: LR unless given)."""
    return build_optimizer(model, Optimizer(**({"lr": LR} | settings)))


def schedule(optimizer, total_steps: int, **settings):
    """build_lr_schedule with [lr_scheduler] settings."""
    return build_lr_schedule(optimizer, LRScheduler(**settings), total_steps)


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(11, 4)
        self.norm = torch.nn.LayerNorm(4)  # 1-D weight and bias
        self.proj = torch.nn.Linear(4, 3)  # 2-D weight, 1-D bias
        self.frozen = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.embedding(ids)))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.arange(6)).square().mean().backward()
    optimizer.step()


def _lrs_seen_by_steps(warmup: int, total: int, **kwargs) -> list[float]:
    """lr of each optimizer.step(), 1..total, through the real LambdaLR."""
    optimizer = adamw(TinyModel())
    scheduler = schedule(optimizer, total, warmup_steps=warmup, **kwargs)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


# --- optimizer -------------------------------------------------------------------------------

def test_weight_decay_only_on_matrices():
    model = TinyModel()
    optimizer = adamw(model, weight_decay=0.05)
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.05 and not_decayed["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert ids(decayed) == {id(model.embedding.weight), id(model.proj.weight)}
    assert ids(not_decayed) == {id(model.norm.weight), id(model.norm.bias), id(model.proj.bias)}
    assert all(p.ndim == 1 for p in not_decayed["params"])


def test_frozen_parameters_and_empty_groups_are_left_out():
    optimizer = adamw(torch.nn.Linear(3, 3, bias=False))
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["weight_decay"] == 0.1
    model = TinyModel()
    all_params = {id(p) for g in adamw(model).param_groups for p in g["params"]}
    assert id(model.frozen) not in all_params


@pytest.mark.parametrize("implementation,fused,foreach", [
    ("auto", True, False),  # fused, also on the CPU: it skips non-finite steps without a sync
    ("foreach", False, True),
    ("for-loop", False, False),
    ("fused", True, False),  # torch has a fused AdamW for CPU too
])
def test_implementation_and_one_step_changes_every_parameter(implementation, fused, foreach):
    torch.manual_seed(0)
    model = TinyModel()
    optimizer = adamw(model, implementation=implementation)
    assert optimizer.defaults["fused"] == fused and optimizer.defaults["foreach"] == foreach
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _train_step(model, optimizer)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == (name == "frozen"), name


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    model = TinyModel()
    optimizer = adamw(model)
    scheduler = schedule(optimizer, 10, warmup_steps=2)
    for _ in range(3):
        _train_step(model, optimizer)
        scheduler.step()

    resumed_model = copy.deepcopy(model)
    resumed_optimizer = adamw(resumed_model)
    resumed_scheduler = schedule(resumed_optimizer, 10, warmup_steps=2)
    resumed_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    resumed_scheduler.load_state_dict(copy.deepcopy(scheduler.state_dict()))
    assert resumed_scheduler.last_epoch == 3

    for _ in range(3):
        for m, o, s in ((model, optimizer, scheduler),
                        (resumed_model, resumed_optimizer, resumed_scheduler)):
            _train_step(m, o)
            s.step()
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


def test_resumed_state_keeps_the_new_configs_hyperparameters():
    """Loading a checkpoint brings back its run's lr, betas, eps, weight decay, implementation
    and the schedule's base lrs; restore_hyperparameters puts the resumed config's back and keeps
    the moment estimates and step counts."""
    torch.manual_seed(0)
    model = TinyModel()
    optimizer = adamw(model)
    scheduler = schedule(optimizer, 10, warmup_steps=2)
    for _ in range(3):
        _train_step(model, optimizer)
        scheduler.step()
    saved = copy.deepcopy(optimizer.state_dict())

    new_lr = 1e-5
    resumed = adamw(model, lr=new_lr, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01,
                    implementation="for-loop")
    resumed_scheduler = schedule(resumed, 10, warmup_steps=2, decay_type="linear")
    configured = hyperparameters(resumed)
    resumed.load_state_dict(copy.deepcopy(saved))
    resumed_scheduler.load_state_dict(copy.deepcopy(scheduler.state_dict()))
    assert resumed.param_groups[0]["betas"] == (0.9, 0.95)  # what loading alone leaves
    restore_hyperparameters(resumed, resumed_scheduler, configured)

    decayed, not_decayed = resumed.param_groups
    assert decayed["betas"] == not_decayed["betas"] == (0.8, 0.99)
    assert decayed["eps"] == 1e-6 and decayed["weight_decay"] == 0.01
    assert not_decayed["weight_decay"] == 0.0
    assert decayed["foreach"] is False and decayed["fused"] is False
    assert resumed_scheduler.last_epoch == 3
    expected = new_lr * lr_multiplier(4, 2, 10, "linear")
    assert [g["lr"] for g in resumed.param_groups] == pytest.approx([expected] * 2)
    assert resumed_scheduler.get_last_lr() == pytest.approx([expected] * 2)
    for key, state in resumed.state_dict()["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name], saved["state"][key][name]), (key, name)
    _train_step(model, resumed)
    resumed_scheduler.step()
    expected = new_lr * lr_multiplier(5, 2, 10, "linear")
    assert resumed.param_groups[0]["lr"] == pytest.approx(expected)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=0.0), r"\[optimizer\] lr = 0.0"),
    (dict(lr=-1e-3), r"\[optimizer\] lr"),
    (dict(lr=float("nan")), r"\[optimizer\] lr"),
    (dict(lr=LR, beta1=1.0), r"\[optimizer\] beta1"),
    (dict(lr=LR, beta2=-0.1), r"\[optimizer\] beta2"),
    (dict(lr=LR, eps=0.0), r"\[optimizer\] eps"),
    (dict(lr=LR, weight_decay=-0.1), r"\[optimizer\] weight_decay"),
    (dict(lr=LR, implementation="apex"), r"\[optimizer\] implementation = 'apex'.*fused"),
])
def test_optimizer_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adamw(TinyModel(), **kwargs)


def test_no_trainable_parameters_is_an_error():
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        adamw(model)


# --- schedule --------------------------------------------------------------------------------

def _cosine(progress: float, min_ratio: float) -> float:
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "wsd"])
def test_warmup_starts_near_zero_and_reaches_lr(decay_type):
    lrs = _lrs_seen_by_steps(4, 40, decay_type=decay_type)
    assert lr_multiplier(0, 4, 40, decay_type) == 0.0
    assert lrs[:4] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR])  # steps 1..4


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "sqrt", "wsd"])
def test_without_warmup_the_first_step_gets_the_full_lr(decay_type):
    """With warmup_steps = 0 the decay began at step 0: step 1 already had less than the peak
    (0.978 of it at 10 steps, cosine), and no step ever trained at the configured lr."""
    lrs = _lrs_seen_by_steps(0, 10, decay_type=decay_type, min_lr_factor=0.1,
                             **({"decay_ratio": 1.0} if decay_type == "wsd" else {}))
    assert lrs[0] == LR and lrs[-1] == pytest.approx(0.1 * LR)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # then the decay, over steps 2..10


def test_cosine_values():
    warmup, total, min_ratio = 10, 110, 0.1
    lrs = _lrs_seen_by_steps(warmup, total, decay_type="cosine", min_lr_factor=min_ratio)
    for step in (1, 5, warmup, 35, 60, 85, total):
        expected = step / warmup if step <= warmup else _cosine((step - warmup) / 100, min_ratio)
        assert lrs[step - 1] == pytest.approx(LR * expected), step
    assert lrs[60 - 1] == pytest.approx(LR * (1 + min_ratio) / 2)  # halfway through the decay
    assert lrs[-1] == pytest.approx(LR * min_ratio)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))


def test_linear_values():
    warmup, total, min_ratio = 10, 110, 0.0
    lrs = _lrs_seen_by_steps(warmup, total, decay_type="linear", min_lr_factor=min_ratio)
    for step in (11, 35, 60, 85, total):
        assert lrs[step - 1] == pytest.approx(LR * (1 - (step - warmup) / 100)), step
    assert lrs[-1] == pytest.approx(0.0, abs=1e-15)


def test_wsd_values():
    warmup, total, min_ratio, decay_ratio = 10, 100, 0.2, 0.2  # decays over steps 81..100
    lrs = _lrs_seen_by_steps(warmup, total, decay_type="wsd", min_lr_factor=min_ratio,
                             decay_ratio=decay_ratio)
    assert lrs[warmup - 1:80] == [LR] * (80 - warmup + 1)  # stable: exactly flat
    for step in (81, 90, 95, total):
        assert lrs[step - 1] == pytest.approx(LR * (1 - (1 - min_ratio) * (step - 80) / 20)), step
    assert lrs[-1] == pytest.approx(LR * min_ratio)


def test_wsd_default_decay_ratio_is_a_tenth():
    lrs = _lrs_seen_by_steps(5, 50, decay_type="wsd", min_lr_factor=0.0)
    assert lrs[44] == LR and lrs[45] < LR  # steps 46..50 decay
    assert lrs[-1] == pytest.approx(0.0, abs=1e-15)


def test_sqrt_values():
    warmup, total, factor = 10, 110, 0.1
    lrs = _lrs_seen_by_steps(warmup, total, decay_type="sqrt", min_lr_factor=factor)
    for step in (11, 35, 60, 85, total):
        shape = 1 - math.sqrt((step - warmup) / 100)
        assert lrs[step - 1] == pytest.approx(LR * (factor + (1 - factor) * shape)), step


@pytest.mark.parametrize("decay_type,shape", [
    ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ("sqrt", lambda p: 1 - math.sqrt(p)), ("linear", lambda p: 1 - p)])
def test_decay_ratio_makes_any_decay_warmup_stable_decay(decay_type, shape):
    """torchtitan's decay_ratio: a stable lr, then the decay type's shape over the last share
    (refused with every type but "wsd" before: a torchtitan config did not load)."""
    warmup, total, factor = 7, 60, 0.2  # decay_ratio 0.25: steps 46..60
    lrs = _lrs_seen_by_steps(warmup, total, decay_type=decay_type, min_lr_factor=factor,
                             decay_ratio=0.25)
    assert lrs[warmup - 1:45] == [LR] * (45 - warmup + 1)
    for step in range(46, total + 1):
        expected = factor + (1 - factor) * shape((step - 45) / 15)
        assert lrs[step - 1] == pytest.approx(LR * expected), step


def test_total_steps_spans_the_schedule_apart_from_the_run():
    """[lr_scheduler] total_steps: a 10-step run follows the first 10 steps of a 40-step cosine;
    a 30-step run of a 20-step schedule holds min_lr_factor after step 20."""
    long = _lrs_seen_by_steps(4, 40, decay_type="cosine", min_lr_factor=0.1)
    optimizer = adamw(TinyModel())
    scheduler = build_lr_schedule(optimizer, LRScheduler(4, "cosine", 0.1, total_steps=40), 10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(long[:10])
    optimizer = adamw(TinyModel())
    scheduler = build_lr_schedule(optimizer, LRScheduler(4, "linear", 0.3, total_steps=20), 30)
    for _ in range(30):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.3 * LR)
    fitted, warning = fit_lr_schedule(LRScheduler(25, "cosine", total_steps=20), 100)
    assert fitted.warmup_steps == 19 and "in [lr_scheduler] total_steps = 20" in warning


def test_min_lr_holds_after_total_steps_and_without_warmup():
    assert lr_multiplier(150, 10, 100, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_multiplier(150, 10, 100, "wsd", 0.1) == pytest.approx(0.1)
    lrs = _lrs_seen_by_steps(0, 4, decay_type="linear", min_lr_factor=0.0)
    assert lrs == pytest.approx([LR, 2 / 3 * LR, 1 / 3 * LR, 0.0])


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(decay_type="step"), ValueError,
     r"\[lr_scheduler\] decay_type = 'step'.*cosine, linear, sqrt, wsd"),
    (dict(warmup_steps=20), ValueError, r"\[lr_scheduler\] warmup_steps = 20 must be smaller"),
    (dict(warmup_steps=10), ValueError, r"\[lr_scheduler\] warmup_steps = 10 must be smaller"),
    (dict(warmup_steps=-1), ValueError, r"\[lr_scheduler\] warmup_steps = -1"),
    (dict(warmup_steps=2.5), TypeError, r"\[lr_scheduler\] warmup_steps = 2.5: must be an int"),
    (dict(total_steps=0, warmup_steps=0), ValueError, r"\[training\] steps = 0"),
    (dict(min_lr_factor=1.5), ValueError, r"\[lr_scheduler\] min_lr_factor"),
    (dict(decay_ratio=1.5), ValueError, r"\[lr_scheduler\] decay_ratio = 1.5"),
    (dict(decay_type="cosine", decay_ratio=0.9), ValueError, "exceed"),
    (dict(total_steps=10, schedule_steps=0), ValueError, r"\[lr_scheduler\] total_steps = 0"),
    (dict(total_steps=10, schedule_steps=5, warmup_steps=5), ValueError,
     r"warmup_steps = 5 must be smaller than \[lr_scheduler\] total_steps = 5"),
    (dict(decay_type="wsd", decay_ratio=0.0), ValueError, r"\[lr_scheduler\] decay_ratio"),
    (dict(decay_type="wsd", decay_ratio=0.5, warmup_steps=6), ValueError, "exceed"),
])
def test_schedule_errors(kwargs, error, match):
    arguments = dict(warmup_steps=2, total_steps=10) | kwargs
    if "schedule_steps" in arguments:  # [lr_scheduler] total_steps, apart from [training] steps
        arguments["total_steps"], training_steps = arguments.pop("schedule_steps"), arguments["total_steps"]
    else:
        training_steps = arguments.pop("total_steps")
    optimizer = adamw(TinyModel())
    with pytest.raises(error, match=match):
        build_lr_schedule(optimizer, LRScheduler(**arguments), training_steps)


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "wsd"])
@pytest.mark.parametrize("warmup,total", [(20, 20), (20, 3), (5, 1), (3, 4), (0, 1)])
def test_a_warmup_too_long_for_the_run_is_fitted_into_it(decay_type, warmup, total):
    """As torchtitan 0.2 clamps its warmup (and wsd decay) to the run, with one warning line;
    here the warmup ends a step before the run, so the last step still lands on min_lr."""
    fitted_cfg, warning = fit_lr_schedule(LRScheduler(warmup, decay_type, 0.1), total)
    fitted, decay_ratio = fitted_cfg.warmup_steps, fitted_cfg.decay_ratio
    assert fitted == min(warmup, total - 1)
    wsd_decay = max(1, round(0.1 * total))  # wsd's default decay_ratio 0.1, at least a step
    fits = warmup < total and (decay_type != "wsd" or warmup + wsd_decay <= total)
    assert (warning is None) == fits
    if warmup >= total:
        assert warning.startswith(f"warning: [lr_scheduler] warmup_steps = {warmup} does not fit "
                                  f"in [training] steps = {total}: warming up over {total - 1} ")
        assert "\n" not in warning
    lrs = _lrs_seen_by_steps(fitted, total, decay_type=decay_type, decay_ratio=decay_ratio)
    assert lrs[-1] == pytest.approx(0.1 * LR)
    assert lrs[:fitted] == pytest.approx([LR * (step + 1) / fitted for step in range(fitted)])


def test_wsd_decay_is_shortened_to_the_steps_left():
    fitted, warning = fit_lr_schedule(LRScheduler(6, "wsd", 0.0, decay_ratio=0.5), 10)
    warmup, decay_ratio = fitted.warmup_steps, fitted.decay_ratio
    assert (warmup, decay_ratio) == (6, 0.4)
    assert warning.endswith("the decay ([lr_scheduler] decay_ratio = 0.5) takes the last "
                            "4 step(s), those after the 6 of warmup")
    # a long run too, where the decay asked for overlaps the warmup: not "a short run"
    assert fit_lr_schedule(LRScheduler(2000, "linear", decay_ratio=1.0), 100000)[1] == (
        "warning: the decay ([lr_scheduler] decay_ratio = 1.0) takes the last 98000 step(s), "
        "those after the 2000 of warmup")
    lrs = _lrs_seen_by_steps(warmup, 10, decay_type="wsd", min_lr_factor=0.0,
                             decay_ratio=decay_ratio)
    assert lrs == pytest.approx([LR * m for m in (1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1,
                                                  0.75, 0.5, 0.25, 0.0)])


@pytest.mark.parametrize("kwargs,match", [
    (dict(warmup_steps=-1), r"\[lr_scheduler\] warmup_steps = -1"),
    (dict(total_steps=0), r"\[training\] steps = 0"),
    (dict(decay_type="cosine", decay_ratio=0.0), r"\[lr_scheduler\] decay_ratio = 0.0"),
    (dict(min_lr_factor=-0.1), r"\[lr_scheduler\] min_lr_factor"),
])
def test_fitting_still_rejects_wrong_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        arguments = dict(warmup_steps=2, total_steps=10) | kwargs
        total_steps = arguments.pop("total_steps")
        fit_lr_schedule(LRScheduler(**arguments), total_steps)
