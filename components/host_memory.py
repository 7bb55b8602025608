"""Whether a run on the CPU can hold its model: the weights, gradients and AdamW's two states in
fp32 and the activations autograd keeps for backward, against the memory this machine (or its
container) has available. Without the check a model too large was killed by the kernel's
out-of-memory killer while it initialised or at its first step, with no message (llama_1b on a
24 GiB machine); on CUDA an out-of-memory error names itself."""

import os
from pathlib import Path
from typing import Optional

from components.config.schema import ConfigError, JobConfig
from models import LlamaArgs, param_count_for, saved_values_per_token

# fp32 weight, gradient and AdamW's exp_avg and exp_avg_sq: what any step holds at least
BYTES_PER_PARAMETER = 16


def available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup"
                    ) -> Optional[int]:
    """Memory a new allocation can get: the kernel's MemAvailable plus free swap, capped by the
    container's limit less what it uses beside its page cache (cgroup v2's memory.max,
    memory.current and memory.stat's file; v1's limit_in_bytes, usage_in_bytes and total_cache),
    which MemAvailable does not see. The page cache counts as free, as the kernel reclaims it
    (after reading a corpus a container's usage is mostly cache). None where /proc/meminfo is
    not there."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines()
                      if ":" in line)
        free = (int(fields["MemAvailable"].split()[0]) + int(fields["SwapFree"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    root = Path(cgroup)
    for limit, used, stat, cache in (("memory.max", "memory.current", "memory.stat", "file"),
                                     ("memory/memory.limit_in_bytes",
                                      "memory/memory.usage_in_bytes", "memory/memory.stat",
                                      "total_cache")):
        try:
            cap, usage = int((root / limit).read_text()), int((root / used).read_text())
        except (OSError, ValueError):  # no such file, or "max": no limit
            continue
        try:
            stats = dict(line.split() for line in (root / stat).read_text().splitlines())
            usage -= int(stats.get(cache, 0))
        except (OSError, ValueError):
            pass
        return max(0, min(free, cap - usage))
    return free


def least_bytes(parameters: int, shards: int, tokens: int, args: LlamaArgs,
                every_block_kept: bool, logits_kept: bool) -> int:
    """One process's least memory for a step, in fp32: its 1/shards of the parameters' state
    (FSDP and TP shard them; replicas hold their own) and, for its tokens, what autograd keeps for
    backward. Without activation checkpointing (every_block_kept) that is every block's saved
    values; under any mode of it, each block's input, and in backward one block's saved values
    at a time. Then the final norm's input, rms and input x rms and, for the unfused loss
    (logits_kept), the logits.
    A bound, not an estimate: backward's gradients and the allocator's slack come on top (the
    debug model without checkpointing peaks at ~1.3x it)."""
    state = parameters * BYTES_PER_PARAMETER // max(1, shards)
    block = saved_values_per_token(args)
    blocks = (args.n_layers * block if every_block_kept
              else args.n_layers * args.dim + block - args.dim)
    values = blocks + 2 * args.dim + 1 + (args.vocab_size if logits_kept else 0)
    return state + tokens * values * 4


def eager_blocks_keep_all(cfg: JobConfig) -> bool:
    """Whether every block keeps the values eager autograd saves (no activation checkpointing,
    and no compiled blocks, whose graphs may save fewer): least_bytes's every_block_kept."""
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    return cfg.activation_checkpoint.mode == "none" and not compiled


def check_run_fits_on_cpu(cfg: JobConfig, args: LlamaArgs, shards: int, tokens: int,
                          available: Optional[int]) -> None:
    """check_model_fits_on_cpu for a run: the model of `args`, its state over `shards` ranks,
    `tokens` a rank, the processes torchrun starts on this host (LOCAL_WORLD_SIZE)."""
    parameters = param_count_for(args, False)
    need = least_bytes(parameters, shards, tokens, args, eager_blocks_keep_all(cfg),
                       cfg.loss.impl == "unfused")
    check_model_fits_on_cpu(cfg.model.flavor, parameters, cfg.training.local_batch_size,
                            cfg.training.seq_len, need,
                            int(os.environ.get("LOCAL_WORLD_SIZE", "1")), available)


def check_model_fits_on_cpu(flavor: str, parameters: int, local_batch_size: int, seq_len: int,
                            needed: int, processes_here: int, available: Optional[int]) -> None:
    """Raise a ConfigError naming [model] flavor and the batch where this host's processes,
    each needing `least_bytes`, need more than the available bytes (None: unknown, unchecked)."""
    needed *= processes_here
    if available is None or needed <= available:
        return
    over = f", {processes_here} processes" if processes_here > 1 else ""
    raise ConfigError(
        f"[model] flavor = {flavor!r} at [training] local_batch_size = {local_batch_size}, "
        f"seq_len = {seq_len}: its {parameters:,} parameters need at least "
        f"{needed / 2**30:.1f} GiB of this machine's memory on the CPU (fp32 weights, gradients "
        f"and AdamW's two states, and the activations kept for backward{over}), and "
        f"{available / 2**30:.1f} GiB is available: a smaller flavor or batch, or a GPU")
