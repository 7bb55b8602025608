"""Training metrics: what a step achieved (StepMeter), and where it is recorded (MetricsLogger).

MetricsLogger writes, on rank 0 only:
  <dump_folder>/metrics.jsonl  one JSON object per log() call, always; a fresh run starts a new
                               file (an earlier run's is renamed metrics.<time>.jsonl), a resumed
                               run appends (after {"step": <its checkpoint's>, "resumed": true}
                               where the file went on past it or ends in a line cut short, which
                               stays and is followed by a newline: metrics_timeline.py)
  stdout                       one line per log() call, always
  <dump_folder>/wandb/         a wandb run (offline unless asked for "online"), when enabled
  <dump_folder>/tb/            TensorBoard event files, when enabled
"""

import datetime
import json
import math
import shutil
import sys
import time
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from components.config.checks import TENSORBOARD_FOLDER
from components.config.schema import Metrics, WandbMode
from components.metrics_timeline import records, timeline

GIB = 2**30

# Dense (no sparsity) bf16 peak FLOP/s per GPU, matched as a substring of the CUDA device name;
# the longest matching key wins, so "H100 PCIe" beats "H100". Values follow torchtitan.
PEAK_BF16_FLOPS: dict[str, float] = {
    "A100": 312e12,
    "H100": 989e12,  # SXM
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "B200": 2.25e15,
}

WANDB_MODES = typing.get_args(WandbMode)

# Keys printed on the stdout line, in order: (metric key, label, format). Every other key still
# goes to metrics.jsonl, wandb and TensorBoard.
PRINTED_METRICS = (
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val_loss", "{:.4f}"),
    ("val_bpb", "val_bpb", "{:.4f}"),
    ("grad_norm", "grad_norm", "{:.3g}"),
    ("lr", "lr", "{:.1e}"),
    ("tokens_per_second", "tok/s/device", "{:,.0f}"),  # each device's; the sum is in the jsonl
    ("mfu_percent", "mfu", "{:.1f}%"),
    ("memory_max_reserved_gib", "mem", "{:.1f} GiB"),
)


def bits_per_byte(nats: float, n_bytes: float) -> float:
    """Cross-entropy per UTF-8 byte of the text, in bits: the summed token losses (nats) over
    ln 2 x the bytes the target tokens decode to. Unlike a loss per token it does not depend on
    the tokenizer, so runs with different tokenizers compare."""
    if n_bytes <= 0:
        raise ValueError(f"bits_per_byte: {n_bytes} bytes (the targets decode to no text)")
    return nats / (math.log(2) * n_bytes)


def peak_flops_for_name(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a GPU name such as "NVIDIA H100 80GB HBM3"; None if unknown."""
    matches = [key for key in PEAK_BF16_FLOPS if key in device_name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None


def peak_flops(device: torch.device | str) -> float | None:
    """Peak dense bf16 FLOP/s of one device; None on CPU or on a GPU missing from PEAK_BF16_FLOPS
    (MFU is then not reported rather than reported against a guessed peak)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


class StepMeter:
    """Throughput, MFU, peak memory and data wait, averaged over the steps since the last read().

    The trainer calls step_done() every step and read() only on the steps it logs, so the only
    host-device sync is the one in read() (which the timing needs to include the queued GPU work):

        meter = StepMeter(device, world_size, flops_per_token, peak_flops(device))
        for step in ...:
            with meter.waiting_for_data():
                batch = next(batches)
            ... forward, backward, optimizer step ...
            meter.step_done(tokens=tokens_per_device)
            if step % log_freq == 0:
                logger.log(step, {"loss": loss, **meter.read()})

    tokens is the number of tokens this device trained on in the step: its local batch tokens
    divided by how many ranks work on the same batch (tensor/pipeline parallel degree).
    tokens_per_second_total assumes every device trains on as many tokens.
    """

    def __init__(self, device: torch.device | str, world_size: int,
                 flops_per_token: float | None = None,
                 peak_flops_per_device: float | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"StepMeter: world_size={world_size} must be >= 1")
        self.device = torch.device(device)
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self.reset()

    def reset(self) -> None:
        """Start a new window now, e.g. after a checkpoint save or an evaluation, so that their
        time is not counted as training time."""
        self._window_start = time.perf_counter()
        self._steps = 0
        self._tokens = 0
        self._data_wait_seconds = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        """Time the block as data wait (it is still part of the step time)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._data_wait_seconds += time.perf_counter() - start

    def step_done(self, tokens: int) -> None:
        self._steps += 1
        self._tokens += tokens

    def read(self) -> dict[str, float]:
        """The window's metrics, then a new window. Keys that do not apply are left out: MFU
        without flops_per_token or a known peak, memory off CUDA."""
        if self._steps == 0:
            raise RuntimeError("StepMeter.read(): no step_done() since the last read() or reset()")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._window_start
        tokens_per_second = self._tokens / seconds
        metrics = {
            "step_seconds": seconds / self._steps,
            "data_wait_seconds": self._data_wait_seconds / self._steps,
            "tokens_per_second": tokens_per_second,
            "tokens_per_second_total": tokens_per_second * self.world_size,
        }
        if self.flops_per_token is not None:
            flops_per_second = self.flops_per_token * tokens_per_second
            metrics["tflops_per_device"] = flops_per_second / 1e12
            if self.peak_flops_per_device:
                metrics["mfu_percent"] = 100.0 * flops_per_second / self.peak_flops_per_device
        if self.device.type == "cuda":
            # Peaks since the previous read, i.e. the largest of the window's steps.
            metrics["memory_max_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            metrics["memory_max_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
        self.reset()
        return metrics


def _as_float(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
        raise TypeError(f"metric {key!r}: expected a number or a 0-dim tensor, got "
                        f"{type(value).__name__}{shape}") from e


def _format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"[metrics] enable_wandb is set but wandb does not import ({e}): "
                          "pip install wandb (or set [metrics] enable_wandb = false)") from e
    return wandb


def _import_summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("[metrics] enable_tensorboard is set but tensorboard is not "
                          "installed: pip install tensorboard") from e
    return SummaryWriter


def check_metrics_backends(cfg: Metrics) -> None:
    """An ImportError naming the key when an enabled backend is not installed (the trainer asks
    before it builds the model; MetricsLogger would say the same later), and a ValueError naming
    the key for a project or run name wandb refuses (a traceback otherwise, once the earlier
    run's files in the dump folder had been set aside)."""
    if cfg.enable_wandb:
        wandb = _import_wandb()
        for key in ("wandb_project", "wandb_run_name"):
            value = getattr(cfg, key)
            try:  # wandb's own rules, which may change with its versions
                wandb.Settings(**{key.removeprefix("wandb_"): value or None})
            except Exception as e:
                raise ValueError(f"[metrics] {key} = {value!r}: wandb refuses it "
                                 f"({' '.join(str(e).split())})") from None
    if cfg.enable_tensorboard:
        _import_summary_writer()


def _inside(folder: Path, name: str) -> bool:
    """Whether folder/name is a path strictly inside folder."""
    base = folder.resolve()
    return base in (base / name).resolve().parents


class MetricsLogger:
    """Records metrics on rank 0; on every other rank each method does nothing.

    A resumed run (resumed=True) appends to metrics.jsonl: it repeats the steps after its
    checkpoint, and the last line for a step wins. Where the checkpoint recorded the time of its
    file's first line (`timeline`, from `started`) and the file now begins at step 1 at another
    time (a fresh run's, in the same folder since), that file is set aside as below and the
    resumed run starts a new one. A fresh run starts a new file: an earlier
    run's metrics.jsonl in the same folder is renamed metrics.<its last write time>.jsonl, so
    the two runs' lines never mix (and nothing is lost). Non-finite values are written as null
    there, to keep each line valid JSON; stdout, wandb and TensorBoard get them as they are.
    `last` and `lowest` hold each metric's latest and lowest (step, value), for the summary.
    logs_at() says which steps the trainer logs: every [metrics] log_freq steps, the run's first
    step (first_step) and its last (total_steps).
    cfg is the [metrics] section; config (the whole resolved config, a dict) and notes ([job]
    description) go to wandb with the run.
    """

    def __init__(self, dump_folder: str | Path, rank: int, total_steps: int,
                 cfg: Metrics | None = None, config: dict | None = None, notes: str = "",
                 resumed: bool = False, first_step: int = 1,
                 timeline: Optional[float] = None, outputs: tuple[str, ...] = ()) -> None:
        cfg = Metrics() if cfg is None else cfg
        if cfg.wandb_mode not in WANDB_MODES:
            raise ValueError(f"[metrics] wandb_mode = {cfg.wandb_mode!r}: expected one of "
                             f"{', '.join(WANDB_MODES)}")
        self.dump_folder = Path(dump_folder)
        self.rank = rank
        self.total_steps = total_steps
        self.log_freq = cfg.log_freq
        self.first_step = first_step
        resumed = resumed or first_step > 1
        self.enabled = rank == 0
        self._jsonl = None
        self._wandb_run = None
        self._tensorboard = None
        self._first_logged: tuple[int, float] | None = None  # (step, time) for the ETA
        self.last: dict[str, tuple[int, float]] = {}
        self.lowest: dict[str, tuple[int, float]] = {}
        self.jsonl_path = self.dump_folder / "metrics.jsonl"
        self.started: Optional[float] = None  # the "time" of metrics.jsonl's first line
        self.wandb_dir: Path | None = None  # the run's folder, what `wandb sync` takes
        self.tensorboard_dir: Path | None = None
        # only folders of the run's own inside its dump folder: a profiling folder set to an
        # absolute path, "..", "" or "." would rename a folder the run does not own
        self.outputs = tuple(name for name in outputs if _inside(self.dump_folder, name))
        if not self.enabled:
            return

        self.dump_folder.mkdir(parents=True, exist_ok=True)
        abandoned = False  # whether the file's timeline went on past this run's checkpoint
        cut_short = False  # whether the file ends inside a line (the earlier run's last)
        if not resumed:
            self._set_aside_earlier_run()
        else:
            step, self.started = self._first_record()
            # a file begun at step 1 by a run other than the checkpoint's: a fresh run in this
            # folder since (one begun later, by a run resumed here, continues the timeline)
            if timeline is not None and step == 1 and self.started != timeline:
                self._set_aside_earlier_run(f"held another run's metrics (its first line is not "
                                            f"this run's, resumed at step {first_step})")
                self.started = None
            else:
                abandoned = self._take_earlier_steps(first_step) and first_step > 1
                cut_short = self._ends_inside_a_line()
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        try:
            if cut_short:
                # The earlier run stopped mid-write (a kill, a full disk): appended to its
                # partial line, this run's first line would be lost with it. The partial line
                # stays as it was; readers skip it.
                self._jsonl.write("\n")
            if abandoned or (cut_short and first_step > 1):
                # The steps logged after the checkpoint are a timeline this run abandons: a line
                # at the checkpoint's step says where the file's timeline goes back to, which
                # the run's own first line (log_freq steps on) could not (metrics_timeline.py).
                # After a partial line it also tells compare_losses that the line was the
                # earlier run's last, cut short, not a damaged file.
                self._jsonl.write(json.dumps({"step": first_step - 1, "time": time.time(),
                                              "resumed": True}) + "\n")
                self._jsonl.flush()
            if cfg.enable_wandb:
                self._wandb_run = self._start_wandb(cfg, config, notes)
            if cfg.enable_tensorboard:
                self._tensorboard = self._start_tensorboard()
        except BaseException:
            self.close()  # whatever did start
            raise

    def _timeline(self) -> dict[int, dict]:
        """metrics.jsonl's numeric values by step, as the run's timeline has them
        (`metrics_timeline.timeline`: the steps a resumed run abandoned are left out)."""
        numeric = ({key: (value if key == "step" else float(value))
                    for key, value in record.items() if key != "time"
                    and isinstance(value, (int, float)) and not isinstance(value, bool)}
                   for record in records(self.jsonl_path))
        return {step: {key: value for key, value in values.items() if key != "step"}
                for step, values in timeline(numeric).items()}

    def _take_earlier_steps(self, first_step: int) -> bool:
        """`last` and `lowest` from the steps before first_step of the run's timeline, so that a
        resumed run's summary (the best validation loss) covers the whole run; whether the
        timeline holds steps from first_step on (ones this run abandons)."""
        timeline = self._timeline()
        for step, values in sorted(timeline.items()):
            if step >= first_step:
                continue
            for key, value in values.items():
                self.last[key] = (step, value)
                if key not in self.lowest or value < self.lowest[key][1]:
                    self.lowest[key] = (step, value)
        return max(timeline, default=0) >= first_step

    def recorded(self, step: int, key: str) -> bool:
        """Whether the run's timeline in metrics.jsonl holds a value of `key` at `step` (rank 0;
        False elsewhere)."""
        return self.enabled and key in self._timeline().get(step, {})

    def _ends_inside_a_line(self) -> bool:
        """Whether metrics.jsonl ends without a newline: its last line was cut short."""
        try:
            with open(self.jsonl_path, "rb") as f:
                if f.seek(0, 2) == 0:
                    return False
                f.seek(-1, 2)
                return f.read(1) != b"\n"
        except OSError:  # no file yet
            return False

    def _first_record(self) -> tuple[Optional[int], Optional[float]]:
        """(step, time) of metrics.jsonl's first line; None for what it does not hold."""
        try:
            with open(self.jsonl_path, encoding="utf-8") as f:
                first = json.loads(f.readline())
            step, when = first.get("step"), first.get("time")
        except (OSError, ValueError, AttributeError):
            return None, None
        return (step if isinstance(step, int) else None,
                when if isinstance(when, float) else None)

    def _set_aside_earlier_run(self, why: str = "held an earlier run's metrics") -> None:
        """The earlier run's metrics.jsonl, with the config.toml that says what made them, its
        TensorBoard events (a second run's would show as one mixed curve) and its other outputs
        (`outputs`: profile traces and memory snapshots, whose step folders a new run would
        overwrite or mix with its own), renamed with the time its metrics were last written:
        metrics.<time>.jsonl, config.<time>.toml, tb.<time>, profile_traces.<time>. The caller
        writes this run's config.toml after."""
        if not self.jsonl_path.is_file() or self.jsonl_path.stat().st_size == 0:
            return
        written = datetime.datetime.fromtimestamp(self.jsonl_path.stat().st_mtime)
        stamp, n = f"{written:%Y%m%d-%H%M%S}", 1
        earlier = {"metrics.jsonl": "metrics.{}.jsonl", "config.toml": "config.{}.toml",
                   TENSORBOARD_FOLDER: TENSORBOARD_FOLDER + ".{}", **{name: name.rstrip("/") + ".{}" for name in self.outputs}}
        names = {}
        while not names or any((self.dump_folder / new).exists() for new in names.values()):
            suffix = stamp if n == 1 else f"{stamp}-{n}"
            names = {old: new.format(suffix) for old, new in earlier.items()
                     if (self.dump_folder / old).exists()}
            n += 1
        for old, new in names.items():
            (self.dump_folder / old).rename(self.dump_folder / new)
        renamed = ", ".join(f"{old} to {new}" for old, new in names.items())
        print(f"{self.jsonl_path} {why}: renamed {renamed}; this run starts anew", flush=True)

    def _start_wandb(self, cfg: Metrics, config: dict | None, notes: str):
        wandb = _import_wandb()
        # mode is passed explicitly (it outranks a WANDB_MODE in the environment), so nothing
        # talks to the network unless the caller asked for "online". console="off": wandb would
        # otherwise wrap sys.stdout/stderr of the whole trainer to mirror them.
        settings = wandb.Settings(silent=True, console="off")
        run = wandb.init(mode=cfg.wandb_mode, dir=str(self.dump_folder), project=cfg.wandb_project,
                         name=cfg.wandb_run_name or None, notes=notes or None, config=config,
                         settings=settings)
        if cfg.wandb_mode != "disabled":  # a disabled run's dir is a temporary name, never made
            self.wandb_dir = Path(run.dir).parent  # run.dir is the run folder's files/
        return run

    def _start_tensorboard(self):
        SummaryWriter = _import_summary_writer()  # noqa: N806 (a class)
        self.tensorboard_dir = self.dump_folder / TENSORBOARD_FOLDER
        # a resumed run hides what an earlier one logged from its first step on (a rollback's or
        # a killed run's abandoned steps), as it leaves them out of its summary
        return SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=self.first_step)

    def logs_at(self, step: int) -> bool:
        """Whether the trainer logs this step (the same answer on every rank)."""
        return step % self.log_freq == 0 or step == self.first_step or step == self.total_steps

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics: values are numbers or 0-dim tensors; None means absent."""
        if not self.enabled:
            return
        if self._jsonl is None:
            raise RuntimeError("MetricsLogger.log() after close()")
        now = time.time()
        values = {key: _as_float(key, value) for key, value in metrics.items() if value is not None}
        for reserved in ("step", "time"):
            if reserved in values:
                raise ValueError(f"metric {reserved!r}: the logger adds it itself; rename it")

        for key, value in values.items():
            self.last[key] = (step, value)
            if math.isfinite(value) and (key not in self.lowest or value < self.lowest[key][1]):
                self.lowest[key] = (step, value)
        record = {"step": step, "time": now}
        if self.started is None:
            self.started = now
        record.update({k: v if math.isfinite(v) else None for k, v in values.items()})
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()  # a crash right after this loses nothing
        except OSError as e:  # a full disk: say which file and how much room is left
            free = shutil.disk_usage(self.dump_folder).free / 2**30
            raise OSError(e.errno, f"[metrics] writing {self.jsonl_path} failed ({e.strerror}); "
                                   f"{free:.1f} GiB free on its filesystem") from None

        print(self._stdout_line(step, values, now), file=sys.stdout, flush=True)
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()

    def _stdout_line(self, step: int, values: dict[str, float], now: float) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        parts += [f"{label} {fmt.format(values[key])}" for key, label, fmt in PRINTED_METRICS
                  if key in values]
        # The average step time is measured from the first logged step on, which leaves out the
        # slow first steps (compilation, allocator warmup) and works the same after a resume.
        # A resumed step's validation comes before the first step's warm-up: not a start.
        if self._first_logged is None and step >= self.first_step:
            self._first_logged = (step, now)
        elif self._first_logged is not None and step > self._first_logged[0]:
            first_step, first_time = self._first_logged
            seconds_per_step = (now - first_time) / (step - first_step)
            parts.append(f"eta {_format_eta(seconds_per_step * (self.total_steps - step))}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl is not None:
            jsonl, self._jsonl = self._jsonl, None
            try:
                jsonl.close()
            except OSError:  # the line that could not be written: log() said so already
                pass
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
            # finish() returns before wandb's service has written the run out (an offline run's
            # .wandb file holds a few bytes then); teardown() waits for it, as the interpreter's
            # exit would, which a process leaving through os._exit skips.
            import wandb
            wandb.teardown()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
