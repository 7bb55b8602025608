"""Float8 linear layers through torchao: `[model] converters = ["quantize.linear.float8"]`.

Swaps the chosen nn.Linear layers for torchao's Float8Linear, which casts its input, weight and
output gradient to float8 with dynamic scales and runs the three GEMMs of a linear layer in
float8 (torch._scaled_mm). The swap keeps parameter names, shapes and values, so a converted
model initialises to the same weights as the plain one and reads and writes the same
checkpoints. It runs on the meta-device model, before tensor parallelism, activation
checkpointing, compile and FSDP (torchtitan's order): the TP plan then picks torchao's float8
styles for these layers (parallelisms/tp.py), and with `enable_fsdp_float8_all_gather` FSDP
all-gathers their weights in float8.
"""

import dataclasses
import importlib.metadata
import logging
import sys
import typing
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from components.config.schema import Converter, Float8

(CONVERTER,) = typing.get_args(Converter)  # [model] converters' one value: this module
MIN_TORCHAO = (0, 16)  # tests pass with 0.16 to 0.18; 0.15 fails to import with torch 2.13
FP8_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) are the first GPUs with fp8 tensor cores
INSTALL_HINT = "pip install 'flce-recipes[float8]' (or: pip install torchao)"


def has_fp8(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of this compute capability (major, minor) has fp8 GEMMs."""
    return tuple(capability) >= FP8_CAPABILITY


def check_fp8_device(cfg: Float8, device: torch.device) -> None:
    """A clear error (ValueError: the config asks for what this device lacks) where float8 GEMMs
    cannot run, unless they are emulated."""
    if cfg.emulate:
        return
    fix = ("; set [quantize.linear.float8] emulate = true to test the float8 numerics without "
           "fp8 hardware (slow)")
    if device.type != "cuda":
        raise ValueError(f"float8 training needs a CUDA GPU with fp8 (compute capability >= "
                           f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}), but this run is on the "
                           f"{device.type}{fix}")
    capability = torch.cuda.get_device_capability(device)
    if not has_fp8(capability):
        raise ValueError(
            f"float8 training needs compute capability >= {FP8_CAPABILITY[0]}."
            f"{FP8_CAPABILITY[1]} (Ada, Hopper or newer), but {torch.cuda.get_device_name(device)}"
            f" has {capability[0]}.{capability[1]}{fix}")


class _QuietImport(logging.Filter):
    """Drops two harmless messages torchao logs at import: its CUDA kernels failing to load
    where there is no CUDA (the float8 training code is pure Python), and torch's notice that
    torchao registers an enum as a pytree constant."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "is an Enum subclass" in message:
            return False
        return torch.cuda.is_available() or not message.startswith("Failed to load")


def import_torchao_float8():
    """torchao.float8, or an error that says what to install."""
    need = f"[model] converters lists {CONVERTER!r}, which needs torchao"
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version and tuple(int(part) for part in version.split(".")[:2]) < MIN_TORCHAO:
        raise ImportError(f"{need} >= {'.'.join(map(str, MIN_TORCHAO))}, found {version}: "
                          f"{INSTALL_HINT}")
    if "torchao.float8" not in sys.modules:
        quiet = _QuietImport()
        loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError) and e.name == "torchao":
                raise ImportError(f"{need}: {INSTALL_HINT} ({e})") from e
            raise ImportError(f"{need}; torchao {version} failed to import ({e}): is it a build "
                              f"for this torch {torch.__version__}?") from e
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
    return sys.modules["torchao.float8"]


@dataclass
class Float8Conversion:
    """What convert_to_float8 did."""
    cfg: Float8
    converted: list[str]  # names of the layers now Float8Linear
    skipped: dict[str, str]  # name of a linear layer left as it was -> why
    fsdp_float8_all_gather: bool

    def summary(self) -> str:
        kept = "; ".join(f"{name} ({why})" for name, why in self.skipped.items()) or "none"
        all_gather = ""
        if self.fsdp_float8_all_gather:
            all_gather = ", FSDP all-gathers their weights in float8"
        elif self.cfg.enable_fsdp_float8_all_gather:
            all_gather = " (enable_fsdp_float8_all_gather has no effect: no FSDP in this run)"
        return (f"float8 ({self.cfg.recipe_name}{', emulated' if self.cfg.emulate else ''}): "
                f"{len(self.converted)} linear layers converted{all_gather}; kept in high "
                f"precision: {kept}")


def convert_to_float8(model: nn.Module, cfg: Float8, device: torch.device, fsdp: bool,
                      keep: dict[str, str]) -> Float8Conversion:
    """Swap model's nn.Linear layers for torchao's Float8Linear, in place.

    fsdp: whether FSDP will wrap the model (float8 all-gather takes effect only then). keep:
    names of layers that must stay nn.Linear (exact names) -> why, e.g. a layer whose weight is
    read directly rather than called. Layers named by cfg.filter_fqns (substrings, as torchtitan)
    and layers with a dimension that is not a multiple of 16 stay too."""
    check_fp8_device(cfg, device)
    float8 = import_torchao_float8()
    all_gather = cfg.enable_fsdp_float8_all_gather and fsdp
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(cfg.recipe_name),
                                 emulate=cfg.emulate, enable_fsdp_float8_all_gather=all_gather)
    if cfg.recipe_name != "tensorwise":
        # The rowwise recipes' power-of-2 scales come out differently when compiled code
        # recomputes them (activation checkpointing) unless inductor rounds as eager does
        # (pytorch/pytorch#150859); torchtitan sets the same.
        import torch._inductor.config
        torch._inductor.config.emulate_precision_casts = True
    skipped: dict[str, str] = {}

    def convertible(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if name in keep:
            skipped[name] = keep[name]
        elif any(pattern in name for pattern in cfg.filter_fqns):
            skipped[name] = "filter_fqns"
        elif module.in_features % 16 or module.out_features % 16:
            skipped[name] = (f"{module.in_features}x{module.out_features}: fp8 GEMMs need "
                             "dimensions that are multiples of 16")
        return name not in skipped

    float8.convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    converted = [name for name, module in model.named_modules() if is_float8_linear(module)]
    return Float8Conversion(cfg, converted, skipped, all_gather)


def is_float8_linear(module: nn.Module) -> bool:
    # Without torchao imported (nothing was converted in this process) there is none.
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    return float8_linear is not None and isinstance(module, float8_linear.Float8Linear)


def is_float8_tensorwise(module: nn.Module) -> bool:
    """A Float8Linear whose input, weight and output gradient each have one dynamic scale: the
    kind torchao's float8 tensor-parallel styles and FSDP float8 all-gather are built for."""
    if not is_float8_linear(module):
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType
    c = module.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output,
             c.cast_config_input_for_grad_weight, c.cast_config_weight_for_grad_input,
             c.cast_config_grad_output_for_grad_weight)
    return all(cast.scaling_type is ScalingType.DYNAMIC
               and cast.scaling_granularity is ScalingGranularity.TENSORWISE for cast in casts)


def ignored_settings(cfg: Float8) -> list[str]:
    """The [quantize.linear.float8] keys set to something other than their default."""
    return [f.name for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(Float8(), f.name)]


@torch.no_grad()
def plain_weights(state_dict: dict) -> dict:
    """The state dict with FSDP's float8 all-gather weights (torchao's
    WeightWithDynamicFloat8CastTensor, inside DTensors) replaced by the plain tensors they wrap,
    sharing their storage: checkpoints then hold ordinary tensors, which load without torchao and
    into a model with or without float8, and loading in place still updates the weights."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:  # torchao not imported: nothing was converted
        return state_dict
    wrapper = fsdp_utils.WeightWithDynamicFloat8CastTensor

    def plain(value):
        if isinstance(value, DTensor) and isinstance(value.to_local(), wrapper):
            return DTensor.from_local(value.to_local()._tensor.detach(), value.device_mesh,
                                      value.placements, run_check=False, shape=value.shape,
                                      stride=value.stride())
        return value._tensor.detach() if isinstance(value, wrapper) else value

    return {name: plain(value) for name, value in state_dict.items()}
