"""Registers and spilled bytes a thread of the row kernel (`flce.kernels.flce_rows_kernel`) takes
at each pass and block/warps, compiled for a GPU on any machine, no GPU needed.

    python3 -m scripts.bench.kernel_registers                        # the tuned defaults, sm_90
    python3 -m scripts.bench.kernel_registers --configs 16384/16,32768/32 --passes full

Triton compiles the kernel for the target (`triton.compile` with a GPUTarget: the same
PTX and cubin a GPU run would build for it) and the triton wheel's cuobjdump reads the cubin's
resource usage: REG (registers a thread) and STACK (bytes a thread keeps on its stack: spilled
registers, as the kernel has no local arrays). A spill sends those bytes through L1 and L2 on
every use, so a configuration that spills needs a measurement to be worth it
(`tune_rows_kernel`); one that needs more registers than a thread may have at its warps (64 K a
multiprocessor: 128 at 16 warps, 64 at 32) spills. Writes <out>.json and <out>.md with --out.
"""

import argparse
import os
import subprocess
import sys
import tempfile

if not __package__:
    sys.exit("run from the repository root as a module: "
             "python3 -m scripts.bench.kernel_registers ...")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flce.kernels import _block_and_warps, flce_rows_kernel, walks_back  # noqa: E402
from scripts.lib.report import provenance, warning_lines, write_report  # noqa: E402

# flce_rows_kernel's runtime arguments, as a bf16 chunk with int64 targets passes them
SIGNATURE = dict(
    logits_ptr="*bf16", stride_row="i64", target_ptr="*i64", loss_ptr="*fp32", max_ptr="*fp32",
    log_sum_ptr="*fp32", weight_ptr="*fp32", weight_stride="i32", weight_scale_ptr="*fp32",
    V="i32", width="i32", vocab_start="i32", V_total="i32", ignore_index="i32",
    logit_scale="fp32", softcap="fp32", label_smoothing="fp32", z_loss="fp32",
    g8_ptr="*fp8e4nv", g8_stride="i64", g8_scale_ptr="*fp32", target_grad_ptr="*fp32",
    off_max_ptr="*fp32")
PASSES = ("stats", "grad", "grad+e4m3", "full", "full+e4m3")


def constexprs(name: str, block: int, softcap: bool) -> dict:
    """The kernel's compile-time switches for a pass, as `launch_rows` sets them."""
    full, e4m3 = name.startswith("full"), name.endswith("+e4m3")
    return dict(HAS_SOFTCAP=softcap, HAS_SMOOTHING=softcap, HAS_Z_LOSS=False,
                STATS_GIVEN=name.startswith("grad"), STORE_STATS=name == "stats" or full,
                COMPUTE_GRAD=name != "stats", FP8_GRAD=e4m3, KEEP_OFF_MAX=False,
                MAX_OFF_TARGET=e4m3 and full, HAS_WEIGHT_SCALE=True,
                REVERSE_GRAD=walks_back(name), PADDED=False, FP8_MAX=448.0, BLOCK_V=block)


def resource_usage(name: str, block: int, warps: int, softcap: bool, arch: int) -> dict:
    """{"registers", "stack_bytes"} of a thread of the pass compiled for sm_<arch>."""
    const = constexprs(name, block, softcap)
    source = ASTSource(fn=flce_rows_kernel,
                       signature={**SIGNATURE, **{k: "constexpr" for k in const}},
                       constexprs={(flce_rows_kernel.arg_names.index(k),): v
                                   for k, v in const.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump(), "-res-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    fields = dict(item.split(":") for line in usage.splitlines() if "REG:" in line
                  for item in line.split())
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"])}


def cuobjdump() -> str:
    """The cuobjdump that ships with triton's NVIDIA backend."""
    import triton.backends.nvidia as nvidia
    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(path):
        sys.exit(f"error: no cuobjdump at {path}: this triton wheel does not ship one")
    return path


def default_configs(name: str) -> list[tuple[int, int]]:
    """The (block, warps) launch_rows picks for the pass, over the row counts and vocabularies
    its rules tell apart (`_block_and_warps`)."""
    kind = name.replace("grad+e4m3", "grad")
    picked = {_block_and_warps(C, V, None, None, kind) for C in (64, 1024, 8192)
              for V in (32000, 128256)}
    return sorted(picked)


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [*warning_lines(meta), f"Target: sm_{meta['arch']} · triton {meta['triton']} · "
             f"{meta['date']} · git {meta['git']}",
             f"Command: `{meta['command']}`", "",
             "The row kernel's registers and stack bytes (spills) a thread, by pass, block/warps "
             "and whether softcap and label smoothing are on (cuobjdump -res-usage of the cubin "
             "triton builds for the target).", "",
             "| pass | block/warps | softcap | registers | stack bytes |", "|---|---|---|---|---|"]
    for r in results:
        softcap = "on" if r["softcap"] else "off"
        lines.append(f"| {r['pass']} | {r['block']}/{r['warps']} | {softcap} | {r['registers']} | "
                     f"{r['stack_bytes']} |")
    return "\n".join(lines) + "\n"


def parse_configs(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(n) for n in item.split("/")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected block/warps[,block/warps...]")


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.kernel_registers",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", default=",".join(PASSES),
                   help=f"comma-separated passes: {', '.join(PASSES)}")
    p.add_argument("--configs", type=parse_configs, default=None,
                   help="block/warps pairs (default: each pass's tuned ones)")
    p.add_argument("--arch", type=int, default=90, help="the target's compute capability x 10")
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 makes the kernels Python functions: run without it")
    passes = [n for n in args.passes.split(",") if n]
    if unknown := [n for n in passes if n not in PASSES]:
        p.error(f"--passes: unknown {', '.join(unknown)}; expected some of {', '.join(PASSES)}")
    results = []
    for name in passes:
        for block, warps in args.configs or default_configs(name):
            for softcap in (False, True):
                usage = resource_usage(name, block, warps, softcap, args.arch)
                results.append({"pass": name, "block": block, "warps": warps,
                                "softcap": softcap, **usage})
    meta = {**provenance(), "arch": args.arch, "triton": triton.__version__}
    text = markdown(meta, results)
    if args.out:
        write_report(args.out, {"meta": meta, "results": results}, text)
    print(text, end="")


if __name__ == "__main__":
    main()
