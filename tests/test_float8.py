"""Float8 linear layers through torchao: `[model] converters = ["quantize.linear.float8"]`.

On the CPU, torchao's `emulate` rounds every GEMM operand to float8 with its scale exactly as on
an fp8 GPU and multiplies in float32, so the float8 numerics and their composition with FSDP,
TP, activation checkpointing and checkpoints are tested here: the config keys; which layers
convert and which stay (named); the same initial weights as the plain model; gradients within
float8's error of the plain model's; under gloo, FSDP's float8 all-gather (with precomputed
scales, across a resume) equal to the high-precision all-gather, FSDP and TP matching one
process. Not here: tensor parallelism's float8 styles across two processes (they all-gather
float8 tensors, and gloo has no float8 types: "Invalid scalar type"; on one process they are
tested), real fp8 GEMMs and compile: the CUDA tests at the end.
"""

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import forked_ranks
import train
from components.config.schema import ConfigError, Float8, Loss
from components.config.parse import is_config_error, load_config
from components.config.toml_out import to_toml
from components.float8_linear import check_fp8_device, convert_to_float8, has_fp8, is_float8_linear
from models import Llama, LlamaArgs
from parallelisms.build import build_model, model_args
from parallelisms.mesh import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate",
          "true"]
BASE = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--training.seq_len", "64", "--loss.impl", "unfused", "--metrics.log_freq", "1",
        "--job.print_config", "false", "--validation.enable", "false",
        "--lr_scheduler.warmup_steps", "2", "--training.steps", "5", "--data.synthetic", "true"]
GLOBAL_BATCH = 4


# --- config ------------------------------------------------------------------------------------

def test_float8_section_parses_overrides_and_round_trips(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nconverters = ["quantize.linear.float8"]\n'
                    '[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n'
                    'precompute_float8_dynamic_scale_for_fsdp = true\n'
                    'filter_fqns = ["output", "wk"]\n')
    cfg = load_config(["--config", str(toml), "--quantize.linear.float8.emulate", "true",
                       "--quantize.linear.float8.filter_fqns=output,layers.0."])
    f8 = cfg.quantize.linear.float8
    assert cfg.model.converters == ["quantize.linear.float8"]
    assert f8 == Float8(recipe_name="tensorwise", filter_fqns=["output", "layers.0."],
                        enable_fsdp_float8_all_gather=True,
                        precompute_float8_dynamic_scale_for_fsdp=True, emulate=True)
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(to_toml(cfg))
    assert load_config(["--config", str(resolved)]) == cfg
    assert tomllib.loads(resolved.read_text())["quantize"]["linear"]["float8"]["emulate"] is True
    assert "[quantize]\n" not in resolved.read_text()  # only the section that holds keys
    rowwise = load_config(["--quantize.linear.float8.recipe_name", "rowwise"])
    assert rowwise.quantize.linear.float8.recipe_name == "rowwise"
    assert load_config([]).quantize.linear.float8 == Float8()  # the defaults, float8 off
    assert load_config([]).model.converters == [] and Float8().filter_fqns == ["output"]


@pytest.mark.parametrize("argv,match", [
    (["--model.converters", "float8"],
     r"\[model\] converters: 'float8' is not one of 'quantize.linear.float8'"),
    (["--model.converters", "quantize.linear.float8,quantize.linear.float8"], r"twice"),
    (["--quantize.linear.float8.recipe_name", "blockwise"],
     r"\[quantize.linear.float8\] recipe_name = 'blockwise': expected one of"),
    (["--quantize.linear.float8.recipe_name", "rowwise",
      "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true"],
     r"enable_fsdp_float8_all_gather needs recipe_name = \"tensorwise\", not 'rowwise'"),
    (["--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true"],
     r"precompute_float8_dynamic_scale_for_fsdp needs enable_fsdp_float8_all_gather = true"),
    (["--quantize.linear.float8.recipe", "rowwise"],
     r"unknown config key \[quantize.linear.float8\] recipe \(did you mean 'recipe_name'\?\)"),
    (["--quantize.linear.fp8.emulate", "true"],
     r"unknown config section \[quantize.linear.fp8\] \(did you mean 'quantize.linear.float8'"),
    (["--quantize.linear.float8", "true"], r"\[quantize.linear.float8\] is a section, not a key"),
    (["--training.steps.max", "3"], r"\[training\] steps is a key, not a section"),
    (["--quantize.linear.float8.emulate", "yes"], r"\[quantize.linear.float8\] emulate: expected"),
])
def test_float8_config_errors_name_the_key(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(argv)


@pytest.mark.parametrize("text,match", [
    ('[quantize.linear.float8]\nfilter_fqns = "output"\n', r"filter_fqns: expected a list"),
    ('[quantize.linear]\nfloat9 = {emulate = true}\n', r"section \[quantize.linear.float9\]"),
    ('[quantize]\nlinear = 8\n', r"\[quantize.linear\] is a section, not a key"),
])
def test_float8_toml_errors(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(["--config", str(path)])


def test_float8_settings_without_the_converter_warn(capsys):
    cfg = load_config(["--quantize.linear.float8.recipe_name", "rowwise"])
    dims = ParallelDims.resolve(1, -1, 1, 1)
    model = build_model(cfg, model_args(cfg, 259, dims), CPU, dims, log=print)
    assert not any(is_float8_linear(m) for m in model.modules())
    assert ("warning: [quantize.linear.float8] sets recipe_name, but [model] converters does not "
            "list 'quantize.linear.float8': float8 is off") in capsys.readouterr().out


# --- conversion --------------------------------------------------------------------------------

def _meta_llama(args: LlamaArgs) -> Llama:
    with torch.device("meta"):
        return Llama(args, seq_len=32)


def test_conversion_skips_and_names_layers():
    # ffn_dim 200 is not a multiple of 16: the FFN stays; "wk" is filtered; output always stays
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, ffn_dim=200,
                     max_seq_len=64)
    model = _meta_llama(args)
    done = convert_to_float8(model, Float8(filter_fqns=["wk"], emulate=True), CPU, fsdp=False,
                             keep={"output": "the loss reads its weight directly"})
    assert done.converted == [f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wv", "wo")]
    assert done.skipped == {
        **{f"layers.{i}.attention.wk": "filter_fqns" for i in range(2)},
        **{f"layers.{i}.feed_forward.{w}": f"{shape}: fp8 GEMMs need dimensions that are "
           "multiples of 16" for i in range(2) for w, shape in (("w1", "64x200"), ("w2", "200x64"),
                                                                ("w3", "64x200"))},
        "output": "the loss reads its weight directly"}
    for name, module in model.named_modules():
        if name in done.skipped:
            assert type(module) is nn.Linear, name
    assert all(is_float8_linear(model.get_submodule(name)) for name in done.converted)
    summary = done.summary()
    assert summary.startswith("float8 (tensorwise, emulated): 6 linear layers converted; kept")
    assert "layers.1.feed_forward.w2 (200x64: fp8 GEMMs need" in summary
    # the output stays even when filter_fqns no longer names it
    model = _meta_llama(args)
    done = convert_to_float8(model, Float8(filter_fqns=[], emulate=True), CPU, fsdp=False,
                             keep={"output": "the loss reads its weight directly"})
    assert type(model.output) is nn.Linear and "output" in done.skipped


def test_float8_needs_fp8_hardware_unless_emulated(tmp_path):
    assert [has_fp8(c) for c in ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))] == [
        False, False, False, True, True, True, True]
    with pytest.raises(ValueError, match=r"needs a CUDA GPU with fp8 \(compute capability >= "
                                           r"8.9\), but this run is on the cpu; set "
                                           r"\[quantize.linear.float8\] emulate = true"):
        check_fp8_device(Float8(), CPU)
    check_fp8_device(Float8(emulate=True), CPU)
    # through the trainer, too: a config error before anything is built or recorded (it was a
    # RuntimeError's traceback after config.toml, the tokenizer and the data)
    with pytest.raises(ValueError, match="needs a CUDA GPU") as error:
        train.main(BASE + ["--model.converters", "quantize.linear.float8",
                           "--job.dump_folder", str(tmp_path)])
    assert is_config_error(error.value) and not (tmp_path / "config.toml").exists()


def _without_torchao(code: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter where importing torchao fails, as where it is not
    installed."""
    blocker = textwrap.dedent("""
        import importlib.abc, sys
        class NoTorchao(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "torchao":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoTorchao())
    """)
    # Keep the caller's PYTHONPATH: packages installed with --target (as on the GPU machine)
    # are found only through it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", blocker + textwrap.dedent(code)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_missing_torchao_is_a_clear_error(tmp_path):
    result = _without_torchao(f"""
        import train
        try:
            train.main({BASE + FLOAT8 + ["--job.dump_folder", str(tmp_path)]!r})
        except ImportError as e:
            print("ERROR", e)
    """)
    assert result.returncode == 0, result.stderr
    assert ("ERROR [model] converters lists 'quantize.linear.float8', which needs torchao: pip "
            "install 'flce-recipes[float8]' (or: pip install torchao) (No module named 'torchao')"
            in result.stdout)


# --- numerics on one process -------------------------------------------------------------------

def _build(*overrides):
    cfg = load_config(["--training.seq_len", "64", "--loss.impl", "unfused", *overrides])
    dims = ParallelDims.resolve(1, -1, 1, 1)
    return build_model(cfg, model_args(cfg, 259, dims), CPU, dims, log=print)


def test_emulate_rounds_operands_to_float8():
    """What the CPU tests rest on: an emulated tensorwise Float8Linear computes x_q @ w_q^T with
    each operand rounded to e4m3 under the scale 448 / max|.|, as fp8 tensor cores would."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 32, bias=False))
    x = torch.randn(8, 48) * 3
    w = model[0].weight.detach().clone()
    convert_to_float8(model, Float8(emulate=True), CPU, fsdp=False, keep={})
    got = model(x).double()
    torch.testing.assert_close(got, _fp8_round(x) @ _fp8_round(w).T, rtol=1e-5, atol=1e-5)
    assert (got - x.double() @ w.double().T).abs().max() > 1e-2  # float8, not float32


def _fp8_round(t: torch.Tensor) -> torch.Tensor:
    """t rounded to e4m3 under a tensorwise scale (float32, as torchao), back in float64."""
    scale = torch.finfo(torch.float8_e4m3fn).max / t.abs().max().double()
    return (t * scale.float()).to(torch.float8_e4m3fn).double() / scale.float().double()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_same_initial_weights_and_gradients_within_float8_error(recipe):
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 259, (2, 2, 64))
    plain = _build()
    float8 = _build(*FLOAT8, "--quantize.linear.float8.recipe_name", recipe)
    assert plain.state_dict().keys() == float8.state_dict().keys()  # checkpoints interchange
    for (name, p), q in zip(plain.state_dict().items(), float8.state_dict().values()):
        assert torch.equal(p, q), name  # the same seed draws the same weights
    losses = [m(tokens, labels, torch.tensor(128.0)) for m in (plain, float8)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-3
    for (name, p), q in zip(plain.named_parameters(), float8.parameters()):
        error = ((q.grad - p.grad).norm() / p.grad.norm()).item()
        converted = is_float8_linear(float8.get_submodule(name.rsplit(".", 1)[0]))
        # e4m3 / e5m2 keep 3 / 2 mantissa bits: gradients move by a few percent (those of
        # the layers before converted ones too, through their float8 gradient GEMMs)
        assert error < 0.25 and (error > 0.01 or not converted), (name, error)


@pytest.mark.slow
def test_tp_float8_styles_on_one_process():
    """Tensorwise float8 layers get torchao's float8 TP styles: wq/wk/wv and w1/w3 receive
    their input already in float8 (so it is all-gathered in float8), and the result equals the
    float8 model without TP. Rowwise layers and groups with a high-precision layer keep the
    plain styles. One process: gloo cannot all-gather float8 between two."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from components.loss import ModelWithLoss, TrainingLoss
    from parallelisms.init import init_as_on_one_device
    from parallelisms.tp import apply_tp

    args = LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128,
                     max_seq_len=32)

    def build(cfg: Float8, tp: bool):
        with torch.device("meta"):
            model = ModelWithLoss(Llama(args, seq_len=32),
                                  TrainingLoss(Loss(impl="unfused")))
        convert_to_float8(model.model, cfg, CPU, fsdp=False, keep={"output": "loss"})
        if tp:
            apply_tp(model, init_device_mesh("cpu", (1,)), "sequence")
        model.to_empty(device=CPU)
        torch.manual_seed(0)
        init_as_on_one_device(model, model.model.init_weights)
        return model

    def inputs_in_float8(model) -> dict[str, bool]:
        seen = {}

        def record(name):
            def hook(module, args):
                x = args[0]
                local = x._local_tensor if isinstance(x, DTensor) else x
                seen[name] = isinstance(local, Float8TrainingTensor)
            return hook
        for name, module in model.model.layers["0"].named_modules():
            if name.endswith(("wq", "wk", "wo", "w1", "w2")):
                module.register_forward_pre_hook(record(name))
        return seen

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tokens, labels = torch.randint(0, 256, (2, 2, 32))
        ref = build(Float8(emulate=True), tp=False)
        model = build(Float8(emulate=True), tp=True)
        seen = inputs_in_float8(model)
        losses = [m(tokens, labels, torch.tensor(64.0)) for m in (ref, model)]
        for loss in losses:
            loss.backward()
        assert seen == {"attention.wq": True, "attention.wk": True, "attention.wo": True,
                        "feed_forward.w1": True, "feed_forward.w2": True}
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
            torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
        for cfg, expected in (
                (Float8(recipe_name="rowwise", emulate=True), dict.fromkeys(seen, False)),
                # wk and w3 stay nn.Linear: wq and w1 share their input, so it stays in high
                # precision; wo and w2 read theirs alone
                (Float8(filter_fqns=["wk", "w3"], emulate=True),
                 {"attention.wq": False, "attention.wk": False, "attention.wo": True,
                  "feed_forward.w1": False, "feed_forward.w2": True})):
            model = build(cfg, tp=True)
            seen = inputs_in_float8(model)
            model(tokens, labels, torch.tensor(64.0)).backward()
            assert seen == expected, cfg
    finally:
        dist.destroy_process_group()


# --- two processes (gloo) ----------------------------------------------------------------------

def _torchrun(dump: Path, *overrides) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = forked_ranks.run(  # its ranks forked from a process that imported torch already
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "train.py"), *BASE, *FLOAT8, "--job.dump_folder", str(dump), *overrides],
        cwd=ROOT, env=env, timeout=400, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _metrics(dump: Path) -> dict[int, dict]:
    rows = map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if "loss" in r}


def _assert_same_curves(got: dict, ref: dict, tolerance: float) -> None:
    assert sorted(got) == sorted(ref) and got
    for step in got:
        for key in ("loss", "grad_norm"):
            assert abs(got[step][key] - ref[step][key]) <= tolerance, (step, key)


@pytest.mark.slow
def test_fsdp_float8_all_gather_with_precomputed_scales(tmp_path):
    """FSDP=2 all-gathering float8 weights (scales precomputed after each optimizer step, with
    activation checkpointing) trains exactly as FSDP=2 all-gathering fp32 weights and casting
    them: the same scales, the same float8 weights. Its checkpoints hold plain tensors (they
    load without torchao, equal to the other run's), and a resume continues exactly: the
    scales are not left over from before the checkpoint was loaded."""
    ckpt = ["--training.steps", "4", "--checkpoint.enable_checkpoint", "true",
            "--checkpoint.interval", "2", "--training.local_batch_size", str(GLOBAL_BATCH // 2)]
    all_gather = ["--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true",
                  "--activation_checkpoint.mode", "full"]
    _torchrun(tmp_path / "cast", *ckpt)
    out = _torchrun(tmp_path / "all_gather", *ckpt, *all_gather)
    assert "28 linear layers converted, FSDP all-gathers their weights in float8" in out
    _assert_same_curves(_metrics(tmp_path / "all_gather"), _metrics(tmp_path / "cast"), 1e-6)

    resumed = tmp_path / "resumed" / "checkpoint"
    resumed.mkdir(parents=True)
    os.rename(tmp_path / "all_gather" / "checkpoint" / "step-2", resumed / "step-2")
    _torchrun(tmp_path / "resumed", *ckpt, *all_gather)
    got = _metrics(tmp_path / "resumed")
    assert sorted(got) == [3, 4]
    _assert_same_curves(got, {s: _metrics(tmp_path / "all_gather")[s] for s in got}, 1e-6)

    result = _without_torchao(f"""
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        for run in ("cast", "all_gather"):
            dcp_to_torch_save({str(tmp_path)!r} + f"/{{run}}/checkpoint/step-4",
                              {str(tmp_path)!r} + f"/{{run}}.pt")
        a, b = (torch.load({str(tmp_path)!r} + f"/{{run}}.pt", weights_only=True)["model"]
                for run in ("cast", "all_gather"))
        assert a.keys() == b.keys() and "model.layers.0.attention.wq.weight" in a
        assert all(type(b[k]) is torch.Tensor and torch.equal(a[k], b[k]) for k in a)
        print("OK")
    """)
    assert result.stdout.strip() == "OK", result.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Metrics of 3 steps on one process, plain or with a float8 recipe (run once each)."""
    runs = {}

    def run(recipe: str) -> dict[int, dict]:
        if recipe not in runs:
            dump = tmp_path_factory.mktemp(recipe)
            float8 = FLOAT8 + ["--quantize.linear.float8.recipe_name", recipe]
            assert train.main(BASE + (float8 if recipe != "plain" else []) + [
                "--training.steps", "3", "--training.local_batch_size", str(GLOBAL_BATCH),
                "--job.dump_folder", str(dump)]) == 0
            runs[recipe] = _metrics(dump)
        return runs[recipe]
    return run


@pytest.mark.slow
def test_float8_trains_like_the_plain_model(one_process):
    plain, float8 = one_process("plain"), one_process("rowwise")
    assert sorted(float8) == [1, 2, 3]
    for step in float8:
        for key in ("loss", "grad_norm"):
            assert abs(float8[step][key] - plain[step][key]) < 2e-3, (step, key)
    # float8 moves them by ~2e-5 to 1e-4: more than the layouts below differ
    assert max(abs(float8[s]["loss"] - plain[s]["loss"]) for s in float8) > 2e-5


@pytest.mark.parametrize("layout,recipe", [
    # rowwise scales each row of an activation (token) on its own, so splitting the batch
    # across ranks changes none; tensorwise would scale each rank's half batch by its own max
    ("fsdp", "rowwise"),
    # TP's float8 layers cast DTensors: global scales, as one process
    ("tp", "rowwise_with_gw_hp"),
    # tensorwise under TP on gloo: torchao's float8 styles all-gathered float8, which gloo
    # cannot ("Invalid scalar type" at step 1); the plain styles gather in high precision
    ("tp", "tensorwise"),
])
@pytest.mark.slow
def test_layouts_match_one_process(tmp_path, one_process, layout, recipe):
    """Two processes train like one with float8, to 1e-5 over 3 steps (later, Adam's steps on
    near-zero gradients amplify a float8 rounding that went the other way)."""
    tp = layout == "tp"
    _torchrun(tmp_path, "--quantize.linear.float8.recipe_name", recipe, "--training.steps", "3",
              "--parallelism.tensor_parallel_degree", "2" if tp else "1",
              "--training.local_batch_size", str(GLOBAL_BATCH if tp else GLOBAL_BATCH // 2))
    _assert_same_curves(_metrics(tmp_path), one_process(recipe), 1e-5)


# --- CUDA: real fp8 GEMMs (run by hand on an fp8 GPU) -------------------------------------------

def _fp8_gpus() -> int:
    if not torch.cuda.is_available():
        return 0
    return sum(has_fp8(torch.cuda.get_device_capability(i))
               for i in range(torch.cuda.device_count()))


CUDA_BASE = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cuda",
             "--training.seq_len", "256", "--training.local_batch_size", "8",
             "--metrics.log_freq", "1", "--job.print_config", "false",
             "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2",
             "--training.steps", "30"]


@pytest.mark.skipif(_fp8_gpus() < 1, reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_float8_trains_like_bf16_with_compile(tmp_path, recipe):
    """Real fp8 GEMMs, per-block compile, bf16 FSDP on one GPU (tensorwise: float8 all-gather
    with precomputed scales): the loss curve follows the bf16 one's on real text."""
    compiled = ["--compile.enable", "true", "--compile.components", "model"]
    extra = ["--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
             "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
             "true"] if recipe == "tensorwise" else []
    assert train.main(CUDA_BASE + compiled + ["--job.dump_folder", str(tmp_path / "bf16")]) == 0
    assert train.main(CUDA_BASE + compiled + [
        "--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name",
        recipe, *extra, "--job.dump_folder", str(tmp_path / "float8")]) == 0
    bf16, float8 = _metrics(tmp_path / "bf16"), _metrics(tmp_path / "float8")
    assert sorted(float8) == list(range(1, 31))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in float8.values())
    assert float8[30]["loss"] < float8[1]["loss"] - 1.0  # it learns, as bf16 does
    for step in float8:
        assert abs(float8[step]["loss"] - bf16[step]["loss"]) < 0.02 * bf16[step]["loss"], step


@pytest.mark.skipif(_fp8_gpus() < 1, reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")
def test_cuda_float8_with_per_op_checkpointing_trains_as_without(tmp_path):
    """Per-op selective AC (its policy keeps every other aten._scaled_mm and the casts' amax)
    inside the compiled float8 blocks: the same curve as without checkpointing."""
    run = CUDA_BASE + ["--compile.enable", "true", "--model.converters", "quantize.linear.float8",
                       "--training.steps", "10"]
    assert train.main(run + ["--job.dump_folder", str(tmp_path / "none")]) == 0
    assert train.main(run + ["--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op",
                             "--job.dump_folder", str(tmp_path / "op")]) == 0
    _assert_same_curves(_metrics(tmp_path / "op"), _metrics(tmp_path / "none"), 5e-3)


@pytest.mark.skipif(_fp8_gpus() < 1, reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_cuda_fp8_gemms_match_emulation(recipe):
    """torch._scaled_mm on the GPU against torchao's emulation of it, forward and backward."""
    torch.manual_seed(0)
    outs = []
    for emulate in (False, True):
        linear = nn.Sequential(nn.Linear(256, 512, bias=False)).cuda().bfloat16()
        torch.manual_seed(1)
        nn.init.normal_(linear[0].weight, std=0.02)
        convert_to_float8(linear, Float8(recipe_name=recipe, emulate=emulate),
                          torch.device("cuda"), fsdp=False, keep={})
        assert is_float8_linear(linear[0])
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = linear(x)
        out.float().square().sum().backward()
        outs.append((out.float(), x.grad.float(), linear[0].weight.grad.float()))
    for got, ref in zip(*outs):
        assert ((got - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.skipif(_fp8_gpus() < 2, reason="needs 2 CUDA GPUs with fp8 (NCCL)")
def test_cuda_two_gpus_float8_fsdp_and_tp(tmp_path):
    """What gloo cannot run: TP=2 with torchao's float8 styles (float8 all-gathers of the
    sequence) matches one GPU; FSDP=2 with the float8 weight all-gather matches FSDP=2 without;
    TP=2 with the float8 weight all-gather too (its weight scales are then per TP rank, so it
    only follows the curve)."""
    float8 = CUDA_BASE + ["--training.steps", "10", "--model.converters",
                          "quantize.linear.float8"]
    all_gather = ["--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true"]

    def torchrun(dump, *overrides):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(ROOT / "train.py"), *float8,
                        "--job.dump_folder", str(dump), *overrides], check=True, cwd=ROOT,
                       timeout=600)
    assert train.main(float8 + ["--job.dump_folder", str(tmp_path / "one")]) == 0
    one = _metrics(tmp_path / "one")
    torchrun(tmp_path / "tp", "--parallelism.tensor_parallel_degree", "2")
    _assert_same_curves(_metrics(tmp_path / "tp"), one, 5e-3)
    torchrun(tmp_path / "tp_all_gather", "--parallelism.tensor_parallel_degree", "2", *all_gather)
    _assert_same_curves(_metrics(tmp_path / "tp_all_gather"), one, 0.05)
    half = ["--training.local_batch_size", "4"]
    torchrun(tmp_path / "cast", *half)
    torchrun(tmp_path / "all_gather", *half, *all_gather)
    _assert_same_curves(_metrics(tmp_path / "all_gather"), _metrics(tmp_path / "cast"), 1e-3)
