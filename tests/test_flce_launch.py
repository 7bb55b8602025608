"""flce/launch.py: the cached launcher of the loss's Triton kernels picks the kernel Triton would."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from flce.launch import Launcher, _spec  # noqa: E402  (needs triton)


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, n, stride, scale, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src_ptr + offs * stride, mask=mask).to(tl.float32) * scale
    if SQUARE:
        v = v * v
    tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=mask)


def test_the_key_tells_apart_what_triton_specializes_on():
    """Ints by divisibility by 16, being 1, and width; tensors by dtype and 16-byte alignment."""
    assert _spec(32) != _spec(33) and _spec(1) != _spec(17) and _spec(2**31) != _spec(16)
    assert _spec(2**63) != _spec(2**62) and _spec(2.5) == _spec(-1.0)
    t = torch.zeros(8)
    assert _spec(t) != _spec(t[1:]) and _spec(t) != _spec(t.double()) and _spec(t) == _spec(t[4:])


def test_constexpr_parameters_are_found_and_must_come_last():
    launcher = Launcher(_scaled_copy)
    assert launcher.constexprs == ("BLOCK", "SQUARE") and launcher.n_runtime == 5
    with pytest.raises(TypeError, match="takes 5 runtime arguments, got 4"):
        launcher((1,), torch.zeros(1), torch.zeros(1), 1, 1, BLOCK=16, SQUARE=False)


def test_a_launch_hook_or_a_compile_under_way_sends_the_launch_through_triton():
    from triton import knobs
    from flce.launch import _hooked, _launchable
    assert not _hooked()  # Triton's hook chains start empty
    hook = lambda *args: None
    knobs.runtime.launch_exit_hook.add(hook)
    try:
        assert _hooked()
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    assert not _hooked()
    assert not _launchable(None)  # the interpreter returns no compiled kernel

    class Pending:  # what an asynchronous compile returns until it is done
        run = function = packed_metadata = None

        def result(self):
            return self
    assert not _launchable(Pending())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernels)")
def test_a_cached_kernel_is_the_one_triton_picks_and_computes_the_same():
    """Over calls differing in each thing Triton specializes on, two calls share a cached
    kernel only if Triton compiled them to the same kernel; every call (cached or not, on the
    current stream or another) computes what PyTorch does."""
    launcher = Launcher(_scaled_copy)
    base = torch.randn(1024 * 16 + 64, device="cuda")
    side = torch.cuda.Stream()
    by_key = {}
    for dtype, offset, n, stride, square, on_side in itertools.product(
            (torch.float32, torch.bfloat16), (0, 1, 8), (1, 16, 17, 1000, 2**31 + 16),
            (1, 2, 16), (False, True), (False, True)):
        grid = (triton.cdiv(min(n, 1000), 256),)
        count = min(n, grid[0] * 256)  # the elements the kernel writes
        src = base.to(dtype)[offset:]
        dst = torch.full((grid[0] * 256,), float("nan"), device="cuda", dtype=dtype)
        # the side stream must not launch before the current one has filled dst with NaN
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side if on_side else torch.cuda.current_stream()):
            launcher(grid, src, dst, n, stride, 0.5, BLOCK=256, SQUARE=square)
            # the same options as the launcher passes: Triton keys its cache on them as given
            compiled = _scaled_copy[grid](src, dst, n, stride, 0.5, BLOCK=256, SQUARE=square,
                                          num_warps=4)
        torch.cuda.synchronize()
        want = src[: count * stride: stride].float() * 0.5
        want = (want * want if square else want).to(dtype)
        torch.testing.assert_close(dst[:count], want, rtol=0, atol=0)
        assert dst[count:].isnan().all()
        key = (torch.cuda.current_device(), 4, (256, square),
               tuple(map(_spec, (src, dst, n, stride, 0.5))))
        assert launcher.compiled[key][1] == compiled.function
        by_key.setdefault(key, set()).add(id(compiled))
    assert all(len(kernels) == 1 for kernels in by_key.values())
    assert len(by_key) > 8  # the calls did reach several specializations


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernels)")
def test_a_launch_hook_sees_every_launch():
    """With a launch hook (Triton's profiler adds one) a cached kernel launches through Triton,
    which calls the hook."""
    from triton import knobs
    launcher = Launcher(_scaled_copy)
    src, dst = torch.randn(300, device="cuda"), torch.empty(300, device="cuda")
    launch = lambda: launcher((2,), src, dst, 300, 1, 2.0, BLOCK=256, SQUARE=False)
    launch()  # compiles and caches
    calls = []
    hook = lambda *args: calls.append(args)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch()
        launch()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launch()
    torch.cuda.synchronize()
    assert len(calls) == 2 and torch.equal(dst, src * 2)
