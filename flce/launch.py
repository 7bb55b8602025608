"""Launching the loss's Triton kernels with less host time than `kernel[grid](...)`.

At a few thousand tokens the loss is bound by the host: Triton's `JITFunction.run` binds and
specializes every argument, builds a cache key from them and the options, and reads its knobs on
each call (tens of microseconds for the row kernel's 34 arguments, about what the kernel itself
takes at 2048 tokens). `Launcher` does that work once per kind of call: it keys the compiled kernel on what
Triton specializes on (each tensor's dtype and 16-byte alignment; each int's divisibility by 16,
being 1 and its integer width; the constexpr values and the launch options) and then calls the
compiled kernel's launcher directly, as `CompiledKernel.__getitem__` does (the same call in
Triton 3.6-3.9). The key is at least as fine as Triton's, so a cached kernel is the one Triton
would have picked (tests/test_flce_launch.py checks this on CUDA). Anything else (the
interpreter, launch hooks such as a profiler's, a Triton whose compiled kernels lack that
launcher) goes through `kernel[grid](...)` as before.
"""

import inspect

import torch
import triton.language as tl
from torch import Tensor
from triton import knobs
from triton.runtime import driver

_I32, _I64 = 1 << 31, 1 << 63


def _spec(arg):
    """What Triton specializes a runtime argument on, or finer."""
    if isinstance(arg, Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return arg % 16 == 0, arg == 1, -_I32 <= arg < _I32, -_I64 <= arg < _I64
    if isinstance(arg, float):
        return float
    return arg  # anything else keys by its value (hashable, or the call fails loudly)


class Launcher:
    """`Launcher(kernel)(grid, *runtime_args, num_warps=4, **constexprs)`: the kernel's runtime
    arguments positionally in signature order (the first a tensor), then its constexpr
    parameters by name (they follow the runtime ones in the signature)."""

    def __init__(self, kernel):
        self.kernel = kernel
        signature = inspect.signature(kernel.fn).parameters
        params = list(signature)
        constexprs = [name for name, p in signature.items() if _is_constexpr(p.annotation)]
        n_runtime = len(params) - len(constexprs)
        if params[n_runtime:] != constexprs:
            raise TypeError(f"{kernel.fn.__name__}: constexpr parameters must come last")
        self.constexprs = tuple(constexprs)
        self.n_runtime = n_runtime
        self.compiled = {}
        self._stream = None

    def __call__(self, grid, *args, num_warps=4, **constexprs):
        if len(args) != self.n_runtime:
            raise TypeError(f"{self.kernel.fn.__name__} takes {self.n_runtime} runtime "
                            f"arguments, got {len(args)}")
        consts = tuple(constexprs[name] for name in self.constexprs)
        device = torch.cuda.current_device() if args[0].is_cuda else None
        key = (device, num_warps, consts, tuple(map(_spec, args)))
        hit = self.compiled.get(key) if device is not None else None
        if hit is None or _hooked():
            compiled = self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            if device is not None and hit is None and _launchable(compiled):
                self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = hit
        if self._stream is None:
            self._stream = driver.active.get_current_stream
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        run(grid[0], grid_y, grid_z, self._stream(device), function, metadata, None, None, None,
            *args, *consts)


def _is_constexpr(annotation) -> bool:
    return annotation is tl.constexpr or annotation in ("tl.constexpr", "constexpr")


def _hooked() -> bool:
    """A launch hook (e.g. Triton's profiler) wants each launch's metadata: launch as Triton.
    The hooks are chains (`knobs.HookChain`), empty unless something added a hook."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _launchable(compiled) -> bool:
    if hasattr(compiled, "result"):  # a compile still under way (asynchronous compilation)
        return False
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))
