#!/usr/bin/env python3
"""Forward+backward time of causal scaled-dot-product attention per SDPA backend, on one GPU.

Attention is about a third of a training step of the 1B model at seq 8192, and PyTorch's default
order (flash first, cuDNN last) is not the fastest there. This times each backend at the model's
shapes (grouped-query attention through `enable_gqa`), so `[model] sdpa_backend` can be chosen
from a measurement. Writes JSON and a markdown table.

    python3 -m scripts.bench.attention --out benchmarks/attention_h200
"""

import argparse
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.attention ...")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from scripts.lib.loss_grid import parse_shape, parse_shapes  # noqa: E402
from scripts.lib.report import grid_table, provenance, warning_lines, write_report  # noqa: E402
from scripts.lib.timing import median_ms, require_cuda  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
# batch x query heads x kv heads x seq x head dim: llama_1b at local batch 4 (and its TP=2
# half), llama_8b at batch 1.
SHAPES = "4x32x8x8192x64,4x16x4x8192x64,1x32x8x8192x128"
FORM = "BxHQxHKVxTxD"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.attention", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, type=lambda s: parse_shapes(s, FORM),
                   help="comma-separated BxHQxHKVxTxD")
    p.add_argument("--out", default="benchmarks/attention_bench", help="output path without suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.attention")
    origin = provenance()  # the commit (a dirty tree flagged) of the code that runs
    results = []
    for shape in args.shapes:
        B, HQ, HKV, T, D = parse_shape(shape, FORM)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, HQ, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        dout = torch.randn(B, HQ, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        # causal: half of the 4·B·HQ·T²·D forward FLOPs; backward 2.5x forward (recompute)
        flops = 3.5 * 2 * B * HQ * T * T * D
        ref, first = None, None
        for name, backend in BACKENDS.items():
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def run():
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                         enable_gqa=HKV != HQ)
                out.backward(dout)
                return out
            try:
                out = run()
                ms = median_ms(run, warmup=3, reps=10)
            except RuntimeError as e:  # "No available kernel": this backend cannot run the shape
                print(f"{shape} {name}: not available ({str(e).splitlines()[0][:120]})")
                results.append({"shape": shape, "backend": name, "ms": None})
                continue
            if ref is None:
                ref, first = out.detach().float(), name
            err = ((out.detach().float() - ref).norm() / ref.norm()).item()
            results.append({"shape": shape, "backend": name, "ms": ms,
                            "tflops": flops / ms / 1e9, "out_diff_vs_first": err})
            print(f"{shape} {name:9s} {ms:7.2f} ms {flops / ms / 1e9:5.0f} TFLOP/s "
                  f"(output vs {first}: {err:.1e})")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), **origin}
    text = markdown(meta, results)
    write_report(args.out, {"meta": meta, "results": results}, text)
    print(text, end="")


def _backend_cell(_, r):
    return "n/a" if r["ms"] is None else f"{r['ms']:.2f} ({r['tflops']:.0f})"


def markdown(meta, results) -> str:
    lines = [*warning_lines(meta),
             f"GPU: {meta['gpu']} · torch {meta['torch']} · cuDNN {meta['cudnn']} · bf16 · "
             f"{meta['date']} · git {meta['git']}", f"Command: `{meta['command']}`", "",
             "Causal attention forward+backward, median ms (TFLOP/s counting the causal half).", "",
             *grid_table(results, "backend", "B×HQ×HKV×T×D", _backend_cell),
             "", "n/a: PyTorch reported no available kernel of that backend for the call "
             "(grouped-query attention through enable_gqa)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
