"""LinearLossParallel and VocabParallelLinearLoss on 2 gloo processes against float64.

The published LinearLossParallel returned each rank's local mean, x gradients of the wrong scale
and a weight gradient holding one rank's partial sum; these check the loss, dx, dW and db of
both styles against the unfused float64 loss on the whole batch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import flce
from components.process import exit_without_teardown
from flce.parallel import LinearLossParallel, VocabParallelLinearLoss
from ports import free_port

OPTIONS = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 8.0, "ignore_index": -100}


def _case(mesh, style_name, reduction, impl="torch", device="cpu") -> dict:
    """One style's loss and gradients on the mesh's ranks against the unfused float64 loss on
    the whole batch: {"loss", "dx", "dw", "db", "ref_loss", "ref_dx", ...} on the CPU."""
    torch.manual_seed(0)  # the same global data on every rank
    B, T, H, V = 2, 10, 16, 37  # T and V not multiples of the world size
    x = torch.randn(B, T, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64) / 4
    b = torch.randn(V, dtype=torch.float64) / 4
    t = torch.randint(0, V, (B, T))
    t[0, :3] = -100
    x, w, b, t = (a.to(device) for a in (x, w, b, t))
    dtype = torch.float64 if impl == "torch" else torch.float32  # Triton: fp32
    loss_fn = flce.FusedLinearCrossEntropyLoss(reduction=reduction, impl=impl, **OPTIONS)
    style = (LinearLossParallel() if style_name == "sequence"
             else VocabParallelLinearLoss(chunk_size=7, impl=impl,
                                          fused=style_name != "vocab_unfused"))
    parallelize_module(loss_fn, mesh, style)
    xd = distribute_tensor(x.to(dtype), mesh, [Shard(1)]).requires_grad_()
    placement = [Replicate()] if style_name == "sequence" else [Shard(0)]  # vocab: W sharded
    wd = distribute_tensor(w.to(dtype), mesh, placement).requires_grad_()
    bd = distribute_tensor(b.to(dtype), mesh, placement).requires_grad_()
    loss = loss_fn(xd, t, wd, bd)
    (loss * 0.7).backward()
    out = {"loss": loss.detach().cpu(), "dx": xd.grad.full_tensor().cpu(),
           "dw": wd.grad.full_tensor().cpu(), "db": bd.grad.full_tensor().cpu()}
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    ref = flce.linear_cross_entropy(xr, t, wr, br, reduction=reduction, **OPTIONS)
    (ref * 0.7).backward()
    out.update(ref_loss=ref.detach().cpu(), ref_dx=xr.grad.cpu(), ref_dw=wr.grad.cpu(),
               ref_db=br.grad.cpu())
    return out


def _worker(rank, world, port, cases, result_path, device="cpu"):
    """Each (style, reduction, impl) case on `world` ranks, in one process group (starting the
    processes costs far more than a case); rank 0 saves {case: _case's results}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":  # one GPU per rank: gloo with CUDA tensors crashed (SIGSEGV) on an H200
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device, (world,))
    results = {case: _case(mesh, *case, device=device) for case in cases}
    if rank == 0:
        torch.save(results, result_path)
    dist.destroy_process_group()
    # as the trainer leaves (components/process.py): gloo's teardown at interpreter exit aborts
    # now and then ("terminate called without an active exception", SIGABRT in a CI run)
    exit_without_teardown(0)


STYLES = ["sequence", "vocab", "vocab_unfused"]
TRITON_STYLES = ["sequence", "vocab"]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """The results of every 2-rank CPU case below, from one mp.spawn: {(style, reduction,
    impl): _case's results}."""
    cases = [(style, reduction, "torch") for style in STYLES for reduction in ("mean", "sum")]
    if INTERPRETED:
        cases += [(style, "mean", "triton") for style in TRITON_STYLES]
    path = tmp_path_factory.mktemp("loss_parallel") / "results.pt"
    mp.spawn(_worker, args=(2, free_port(), cases, str(path)), nprocs=2)
    return torch.load(path)


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_parallel_styles_match_float64(two_ranks, style, reduction):
    r = two_ranks[(style, reduction, "torch")]
    torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=1e-10, atol=1e-12)
    for g in ("dx", "dw", "db"):
        torch.testing.assert_close(r[g], r[f"ref_{g}"], rtol=1e-9, atol=1e-12, msg=g)


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETED,
                    reason="runs the kernels on CPU tensors through Triton's interpreter")
@pytest.mark.parametrize("style", TRITON_STYLES)
def test_loss_parallel_styles_triton_kernels(two_ranks, style):
    """The Triton kernels (vocab offset, statistics pass) in fp32 against float64."""
    r = two_ranks[(style, "mean", "triton")]
    torch.testing.assert_close(r["loss"].double(), r["ref_loss"], rtol=1e-5, atol=1e-6)
    for g in ("dx", "dw", "db"):
        torch.testing.assert_close(r[g].double(), r[f"ref_{g}"], rtol=1e-4, atol=1e-6, msg=g)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
@pytest.mark.parametrize("style", ["sequence", "vocab", "vocab_unfused"])
def test_loss_parallel_styles_triton_on_cuda(tmp_path, style):
    """The same on two GPUs with NCCL: the compiled Triton kernels."""
    path = tmp_path / "result.pt"
    mp.spawn(_worker, args=(2, free_port(), [(style, "mean", "triton")], str(path), "cuda"),
             nprocs=2)
    r = torch.load(path)[(style, "mean", "triton")]
    torch.testing.assert_close(r["loss"].double(), r["ref_loss"], rtol=1e-5, atol=1e-6)
    for g in ("dx", "dw", "db"):
        torch.testing.assert_close(r[g].double(), r[f"ref_{g}"], rtol=1e-4, atol=1e-6, msg=g)


# (impl, style, T, V, reduction) on 4 ranks: T and V below and not multiples of 4. DTensor cuts
# like torch.chunk, so T=5 gives shards 2, 2, 1, 0 and V=6 gives 2, 2, 2, 0: some ranks hold
# nothing. impl "triton" (fp32, Triton's interpreter on the CPU) mixes the kernels on the ranks
# with classes and the PyTorch rows on the one without.
SMALL_SHARDS = [("torch", "sequence", 3, 11, "mean"), ("torch", "sequence", 5, 11, "none"),
                ("torch", "sequence", 7, 11, "sum"), ("torch", "sequence", 7, 11, "none"),
                ("torch", "vocab", 7, 3, "mean"), ("torch", "vocab", 7, 5, "sum"),
                ("torch", "vocab", 7, 6, "mean"), ("torch", "vocab", 2, 5, "mean"),
                ("torch", "vocab_unfused", 7, 5, "mean"), ("torch", "vocab_unfused", 5, 6, "sum"),
                ("triton", "sequence", 5, 11, "mean"), ("triton", "vocab", 7, 5, "sum"),
                ("triton", "vocab", 7, 6, "mean")]


def _small_shards_worker(rank, world, port, result_path, cases):
    """Each case on `world` ranks, with its own fresh data, against float64 on the whole batch;
    rank 0 saves {case: (got, expected)}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for i, case in enumerate(cases):
        impl, style_name, T, V, reduction = case
        dtype = torch.float64 if impl == "torch" else torch.float32
        torch.manual_seed(i)  # the same global data on every rank
        B, H = 2, 8
        x = torch.randn(B, T, H, dtype=torch.float64)
        w = torch.randn(V, H, dtype=torch.float64) / 2
        b = torch.randn(V, dtype=torch.float64) / 2
        t = torch.randint(0, V, (B, T))
        t[0, 0] = -100
        upstream = torch.rand(B, T, dtype=torch.float64) if reduction == "none" else 0.7
        loss_fn = flce.FusedLinearCrossEntropyLoss(reduction=reduction, impl=impl, **OPTIONS)
        style = (LinearLossParallel() if style_name == "sequence"
                 else VocabParallelLinearLoss(impl=impl, fused=style_name == "vocab"))
        parallelize_module(loss_fn, mesh, style)
        xd = distribute_tensor(x.to(dtype), mesh, [Shard(1)]).requires_grad_()
        placement = [Replicate()] if style_name == "sequence" else [Shard(0)]
        wd = distribute_tensor(w.to(dtype), mesh, placement).requires_grad_()
        bd = distribute_tensor(b.to(dtype), mesh, placement).requires_grad_()
        loss = loss_fn(xd, t, wd, bd)
        if reduction == "none":
            (loss.full_tensor() * upstream.to(dtype)).sum().backward()
            loss = loss.full_tensor()
        else:
            (loss * upstream).backward()
        got = {"loss": loss.detach(), "dx": xd.grad.full_tensor(),
               "dw": wd.grad.full_tensor(), "db": bd.grad.full_tensor()}
        xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
        ref = flce.linear_cross_entropy(xr, t, wr, br, reduction=reduction, **OPTIONS)
        (ref * upstream).sum().backward()
        expected = {"loss": ref.detach(), "dx": xr.grad, "dw": wr.grad, "db": br.grad}
        results[case] = (got, expected)
    if rank == 0:
        torch.save(results, result_path)
    dist.destroy_process_group()
    exit_without_teardown(0)  # see _worker


@pytest.mark.slow
def test_loss_parallel_with_empty_and_uneven_shards(tmp_path):
    """Fewer tokens (sequence) or classes (vocab) than the 4 ranks, and uneven cuts: a rank with
    an empty shard adds nothing and gets zero/empty gradients. It raised IndexError (sequence:
    torch.chunk returned fewer pieces than ranks) or ZeroDivisionError (vocab: chunk size)."""
    cases = [c for c in SMALL_SHARDS
             if c[0] == "torch" or os.environ.get("TRITON_INTERPRET") == "1"]
    path = tmp_path / "result.pt"
    mp.spawn(_small_shards_worker, args=(4, free_port(), str(path), cases), nprocs=4)
    results = torch.load(path)
    assert list(results) == cases
    for case, (got, expected) in results.items():
        tol = dict(rtol=1e-10, atol=1e-12) if case[0] == "torch" else dict(rtol=1e-5, atol=1e-6)
        for key in ("loss", "dx", "dw", "db"):
            torch.testing.assert_close(got[key].double(), expected[key], **tol,
                                       msg=lambda m: f"{case} {key}: {m}")


def _bad_input_worker(rank, world, port, folder):
    """Each mistake on every rank; rank r writes the messages it got to folder/rank-r.txt."""
    import datetime
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank left in a collective by another's error fails after this, rather than hanging
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    B, T, H, V = 2, 6, 8, 11
    x, w = torch.randn(B, T, H), torch.randn(V, H)
    messages = []

    def attempt(style, x, t, w, placement):
        loss_fn = flce.FusedLinearCrossEntropyLoss()
        parallelize_module(loss_fn, mesh, style)
        try:
            loss_fn(distribute_tensor(x, mesh, [Shard(1)]), t,
                    distribute_tensor(w, mesh, placement))
            messages.append("no error")
        except Exception as e:  # noqa: BLE001 (the message is what is checked)
            messages.append(f"{type(e).__name__}: {e}")

    attempt(LinearLossParallel(), x, torch.randint(0, V, (B, T - 1)), w, [Replicate()])
    attempt(VocabParallelLinearLoss(), x, torch.rand(B, T) * V, w, [Shard(0)])
    attempt(VocabParallelLinearLoss(fused=False), x, torch.rand(B, T) * V, w, [Shard(0)])
    attempt(VocabParallelLinearLoss(), x, torch.randint(0, V, (B, T)), w.double(), [Shard(0)])
    (folder / f"rank-{rank}.txt").write_text("\n".join(messages) + "\n")
    dist.destroy_process_group()
    exit_without_teardown(0)  # see _worker


@pytest.mark.slow
def test_loss_parallel_bad_input_is_a_clear_error_on_every_rank(tmp_path):
    """The parallel styles skipped the single-device checks: a float target was truncated to
    class ids and trained on; a weight of another dtype was torch's "expected m1 and m2 to have
    the same dtype"; and a target one token short under LinearLossParallel raised on rank 1
    alone while rank 0 waited in the loss's all-reduce (gloo: "Connection reset by peer")."""
    mp.spawn(_bad_input_worker, args=(2, free_port(), tmp_path), nprocs=2)
    for rank in range(2):
        assert (tmp_path / f"rank-{rank}.txt").read_text().splitlines() == [
            "ValueError: LinearLossParallel: target shape (2, 5) must equal x.shape[:-1] = "
            "(2, 6) (x's global shape)",
            "TypeError: target must hold integer class ids, got dtype torch.float32",
            "TypeError: target must hold integer class ids, got dtype torch.float32",
            "TypeError: weight dtype torch.float64 differs from x dtype torch.float32"], rank
