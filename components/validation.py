"""[validation]: the loss (and bits per byte) on held-out batches, as train.py logs it every freq
steps and scripts/evaluate.py scores a checkpoint with it."""

from typing import Callable

import torch
import torch.distributed as dist

from components.config.schema import JobConfig
from components.loss import IGNORE_INDEX
from components.metrics import MetricsLogger, bits_per_byte
from components.process import all_reduce_sum
from components.tokenizer import Tokenizer


def evaluate(model, batches, steps: int, device, token_bytes: torch.Tensor | None = None, *,
             shard) -> dict:
    """val_loss: the mean cross-entropy per token over `steps` held-out batches (all ranks;
    without label smoothing or z-loss), and val_bpb when token_bytes (UTF-8 bytes per token
    id, on the CPU) is given: the same summed losses / (ln 2 x the bytes the target tokens
    decode to). Bytes are counted on the CPU from the labels, so nothing waits for the device.
    shard: context parallelism's (each of its ranks scores its part of every sequence;
    parallelisms/context_parallel.py: SequenceSharding, or NoSharding for whole sequences)."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    n_bytes = 0
    one = torch.ones((), device=device)
    with torch.no_grad(), model.loss.cross_entropy_only():
        for _ in range(steps):
            inputs, labels = next(batches)
            if token_bytes is not None:
                n_bytes += int(token_bytes[labels[labels != IGNORE_INDEX]].sum())
            inputs, labels = inputs.to(device), labels.to(device)
            total[1] += (labels != IGNORE_INDEX).sum()
            with shard(inputs, labels) as (inputs, labels):
                total[0] += model(inputs, labels, one).double()
    model.train()
    total = torch.cat([total, torch.tensor([n_bytes], dtype=torch.float64, device=device)])
    nats, tokens, n_bytes = all_reduce_sum(total).tolist()
    # the cp ranks of a batch each scored a part of it but counted all of its tokens and bytes
    # (train.py's once_per_batch: floats here)
    tokens, n_bytes = tokens / shard.degree, n_bytes / shard.degree
    metrics = {"val_loss": nats / max(tokens, 1)}
    if token_bytes is not None and n_bytes > 0:
        metrics["val_bpb"] = bits_per_byte(nats, n_bytes)
    return metrics


def warn_if_read_more_than_once(val_batches, steps: int, device,
                                log: Callable[[str], None]) -> bool:
    """After an evaluation: warn when it read its validation split more than once on any rank
    (its numbers then weigh the repeated windows twice)."""
    repeated = val_batches.read_more_than_once()
    anywhere = all_reduce_sum(torch.tensor([float(bool(repeated))], device=device)).item() > 0
    if anywhere:
        log(f"warning: [validation] steps = {steps} batches read more than the "
            f"validation split holds ({', '.join(repeated) or 'on another rank'}): every "
            "evaluation scores some windows more than once; fewer steps would not")
    return anywhere


class Validation:
    """[validation]: the loss (and bits per byte) on the same held-out batches every freq steps
    and at the last step, so that validation losses compare. log: rank 0's lines (train.py's)."""

    def __init__(self, cfg: JobConfig, batches, tokenizer: Tokenizer, vocab_size: int, device,
                 shard, log: Callable[[str], None]):
        self.batches, self.device, self.shard, self.log = batches, device, shard, log
        self.steps, self.freq, self.last_step = (cfg.validation.steps, cfg.validation.freq,
                                                 cfg.training.steps)
        self.start = batches.state_dict()  # every evaluation starts here
        # UTF-8 bytes per token id for bits per byte (ids past the tokenizer's: padding, 0 bytes)
        self.token_bytes = None
        if not cfg.data.synthetic:
            lengths = tokenizer.byte_lengths()
            self.token_bytes = torch.tensor(lengths + [0] * (vocab_size - len(lengths)))
        self.repeats_checked = False

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def run(self, model, step: int, metrics: MetricsLogger) -> None:
        """Evaluate and log; after the first evaluation, warn if it read a batch twice (every
        evaluation reads the same ones)."""
        self.batches.load_state_dict(self.start)
        metrics.log(step, evaluate(model, self.batches, self.steps, self.device, self.token_bytes,
                                   shard=self.shard))
        if not self.repeats_checked:
            self.repeats_checked = True
            warn_if_read_more_than_once(self.batches, self.steps, self.device, self.log)


def validate_the_resumed_step(validation: Validation, model, step: int,
                              metrics: MetricsLogger) -> None:
    """The validation of the checkpoint's step, where it was due and metrics.jsonl lacks it: a
    run saves a step before validating it, so one stopped (a signal, a time limit) or killed at
    a validation step resumed after it with that validation never run. The checkpoint holds the
    weights it would have scored, and every validation reads the same batches."""
    if not 1 <= step <= validation.last_step or not validation.due(step):
        return
    missing = [not metrics.recorded(step, "val_loss")]  # rank 0 reads it; the others follow
    if dist.is_initialized():
        dist.broadcast_object_list(missing, src=0)
    if missing[0]:
        validation.log(f"validating step {step}, the checkpoint's: the run that saved it stopped "
                       "before")
        validation.run(model, step, metrics)
