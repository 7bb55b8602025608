"""The config's schema: one dataclass per section, with defaults, a Literal type for each key
that takes one of a few strings, and a docstring per key. Read by components/config/parse.py,
checked by checks.py and written back by toml_out.py; --help and docs/config.md come from
components/config/docs.py.

Key names follow torchtitan v0.2 where one exists.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional


# The allowed values of the keys that take one of a few strings: each key's Literal type is the
# only list of them; the checks, --help and docs/config.md read it, and so do the modules that
# act on the value (typing.get_args).
DeviceType = Literal["auto", "cuda", "cpu"]
ParamDtype = Literal["bfloat16", "float32"]
ReduceDtype = Literal["float32", "bfloat16"]
NanPolicy = Literal["skip", "stop"]
ModelName = Literal["llama3", "llama"]  # torchtitan v0.2 names the family llama3
SdpaBackend = Literal["auto", "cudnn", "flash", "efficient", "math"]
Converter = Literal["quantize.linear.float8"]
OptimizerName = Literal["AdamW"]
OptimizerImplementation = Literal["auto", "fused", "foreach", "for-loop"]
DecayType = Literal["cosine", "linear", "sqrt", "wsd"]
OnBadDocument = Literal["error", "skip"]
TokenizerName = Literal["byte", "hf"]
LossImpl = Literal["flce", "unfused", "torch_chunked"]
LossFloat8 = Literal["none", "logits", "logits+dx"]  # = flce.float8.FLOAT8 (flce imports no recipe code)
LossParallel = Literal["sequence", "vocab"]
ReshardAfterForward = Literal["default", "always", "never"]
RotateMethod = Literal["allgather", "alltoall"]
AsyncMode = Literal["disabled", "async"]
WandbMode = Literal["offline", "online", "disabled"]
# none, selective, full: in the order of the memory they save; memory_budget: as much as asked
ACMode = Literal["none", "selective", "full", "memory_budget"]
CompileComponent = Literal["model", "loss"]
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

# Each field's docstring (the string literal below it) is its documentation: the first line is
# the one-line summary `--help` shows, the rest goes to docs/config.md too.


@dataclass
class Job:
    """Where the run writes, and what it is."""
    dump_folder: str = "./outputs/debug"
    """The run's folder: metrics.jsonl, config.toml, checkpoints, traces.

    A second run into the same folder is refused at once, naming the run that holds it (a lock
    file), and a fresh run sets an earlier run's metrics.jsonl aside rather than appending to it."""
    description: str = ""
    """A line about the run, shown in the start and summary lines and as the wandb run's notes."""
    print_config: bool = True
    """Print the resolved config (as TOML) at the start."""


@dataclass
class Model:
    """The model and the transforms applied to it."""
    name: ModelName = "llama3"
    """The model family: Llama 3 ("llama3", torchtitan's name; "llama" is the same model);
    [model] flavor picks its size."""
    flavor: str = "debug"
    """The size: a key of models/args.py FLAVORS (debug, llama_1b, llama_8b, ...)."""
    vocab_size: int = 0
    """Rows of the embedding and output layers; 0: the flavor's.

    May exceed the tokenizer's vocabulary (padding rows, never a target); must not be smaller."""
    max_seq_len: int = 0
    """The context the model is built for (RoPE's length); 0: the flavor's (llama_1b: 131072).

    [training] seq_len may not exceed it. An exported model's config.json gives it as
    max_position_embeddings. Raising it past the flavor's trains longer sequences with the
    flavor's RoPE frequencies, unless rope_scaling_factor changes them."""
    rope_scaling_factor: float = 0.0
    """Llama-3 RoPE scaling's factor (Hugging Face's rope_scaling "factor"); 0: the flavor's (llama_1b: 32).

    Wavelengths longer than original_max_position_embeddings are stretched by it (Llama 3.1's
    long-context scaling). On a flavor without scaling (debug, llama_150m) it adds Llama-3
    scaling with the flavor's max_seq_len as original_max_position_embeddings: e.g. debug
    (2048) with max_seq_len = 8192 and rope_scaling_factor = 4. An export's config.json says
    it, as rope_scaling."""
    sdpa_backend: SdpaBackend = "auto"
    """The CUDA attention kernel; "auto" keeps PyTorch's choice (models/sdpa.py)."""
    converters: list[Converter] = field(default_factory=list)
    """Transforms of the built model, in order: "quantize.linear.float8" (float8 linear layers).

    float8 goes through torchao and is configured in [quantize.linear.float8]."""


@dataclass
class Training:
    """Batch, steps, precision, device, and what happens on a non-finite step."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    seq_len: int = 256
    """Tokens per sequence (at most [model] max_seq_len, by default the flavor's)."""
    steps: int = 100
    """Optimizer steps of the whole run (a resumed run continues up to it)."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1: local_batch_size x the
    data-parallel degree x gradient_accumulation_steps.

    Set, it fixes gradient_accumulation_steps at global_batch_size / (local_batch_size x the
    data-parallel degree), which must divide it: the step stays the same under another number
    of GPUs."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (from global_batch_size when that is set)."""
    max_norm: float = 1.0
    """Gradient clipping: the total gradient norm's limit; 0 or less: no clipping."""
    mixed_precision_param: ParamDtype = "bfloat16"
    """The dtype FSDP computes in on CUDA (the CPU trains in float32)."""
    mixed_precision_reduce: ReduceDtype = "float32"
    """The dtype of FSDP's gradient reduce-scatter on CUDA."""
    device: DeviceType = "auto"
    """"auto": CUDA when torch sees a GPU, else the CPU (gloo); "cuda" fails without one."""
    seed: int = 0
    """Seeds the weights' initialisation (and the order token shards are read in)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms: reproducible kernels where PyTorch has them (slower);
    sets CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set, as CUDA matmuls then need."""
    nan_policy: NanPolicy = "skip"
    """A step with a non-finite loss or gradient norm: "skip" its update, with a warning, or "stop".

    Either way no weights are updated from it. Under "skip" checkpoints go on (holding the
    weights from before it); a run that stops for bad steps writes no checkpoint at that step."""
    max_bad_steps: int = 5
    """Under nan_policy "skip": this many non-finite steps in a row stop the run."""


@dataclass
class Optimizer:
    """AdamW, with weight decay on matrices only."""
    name: OptimizerName = "AdamW"
    """The optimizer (torch.optim's AdamW; 2-D and larger parameters decay, others do not)."""
    lr: float = 3e-4
    """The peak learning rate (after warmup)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices (embeddings and linear weights)."""
    implementation: OptimizerImplementation = "auto"
    """torch's AdamW kernel: "auto" is "fused", which skips a non-finite step without a host sync."""


@dataclass
class LRScheduler:
    """Linear warmup, a stable lr, then a decay to min_lr_factor x lr at the schedule's last step."""
    warmup_steps: int = 10
    """Steps of linear warmup (a run too short for them warms up over all but its last step)."""
    decay_type: DecayType = "cosine"
    """The decay's shape: "cosine", "linear" or "sqrt" (1 - sqrt of the progress); "wsd" is
    "linear" with decay_ratio 0.1 when that is unset."""
    min_lr_factor: float = 0.1
    """The learning rate at the schedule's last step, as a fraction of lr (was min_lr_ratio)."""
    decay_ratio: Optional[float] = None
    """The share of total_steps spent decaying, after a stable lr; unset: all after warmup."""
    total_steps: Optional[int] = None
    """The steps the schedule spans; unset: [training] steps (a run may stop before or after it)."""


@dataclass
class MixtureSource:
    """One [[data.mixture]] table: a token shard folder and its weight."""
    source: str = ""
    """A token shard folder made by scripts.prepare_data."""
    weight: float = 1.0
    """Its share of the windows (relative: the weights need not sum to 1)."""

    @classmethod
    def parse(cls, where: str, text: str) -> "MixtureSource":
        """The command line's spelling, "folder:weight" (split at the last colon)."""
        source, colon, weight = text.rpartition(":")
        try:
            if not colon:
                raise ValueError
            return cls(source.strip(), float(weight))
        except ValueError:
            raise ConfigError(f"{where}: expected folder:weight, got {text!r}") from None


@dataclass
class Data:
    """The training text: where it comes from and how it is read."""
    source: str = "stdlib"
    """"stdlib", a .jsonl/.json/.parquet/.txt file (.gz/.bz2/.xz too) or folder, a hub dataset, or
    a token shard folder.

    "stdlib" is the Python standard library's source code: offline, for smoke runs. A token
    shard folder (made by scripts.prepare_data) is read in a seeded shuffled order."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Token shard folders mixed by weight, in place of source.

    TOML: one [[data.mixture]] table per folder, with source and weight; the command line:
    --data.mixture "shards/web:0.7,shards/code:0.3" ("" for none)."""
    text_field: str = "text"
    """The field of a JSON / parquet record that holds the text."""
    streaming: bool = False
    """Stream a hub dataset instead of downloading it whole."""
    synthetic: bool = False
    """Random tokens instead of text, for throughput runs."""
    val_every: int = 100
    """Text sources: every n-th document is held out for validation; 0: none (all train).

    A source with a validation split of its own uses that instead; 0 with [validation] enable
    and no such split is an error. Token shards hold theirs out when they are prepared
    (scripts.prepare_data --val-every)."""
    num_workers: int = 2
    """Text sources: tokenizer processes per rank, running ahead of training; 0: the loader's
    background thread.

    0 is fine for the byte tokenizer; a 32k BPE tokenizes ~0.6M tokens/s per core
    (benchmarks/data_loader_cpu.md)."""
    cache_dir: str = "~/.cache/flce-recipes"
    """The embedded stdlib corpus, local files' Arrow copies and check reports (Hub datasets stay in
    Hugging Face's cache, HF_DATASETS_CACHE).

    The reports say what each local .jsonl/.json/.txt file holds (by path, size and mtime), so
    an unchanged file is checked once; with on_bad_document = "skip", the cleaned copies too."""
    on_bad_document: OnBadDocument = "error"
    """A document that is not UTF-8, not a JSON object or has no text (null, empty, only whitespace):
    stop ("error") or "skip" it.

    "error" stops before training and names it (file and line, or dataset, split and row; a
    streamed Hub dataset's rows when they are read); "skip" leaves it out, with a warning naming
    it and a count."""


@dataclass
class Tokenizer:
    """Text to token ids."""
    name: TokenizerName = "byte"
    """"byte" (built in: 256 bytes + 3 special ids) or "hf" (a Hugging Face tokenizer.json)."""
    path: str = ""
    """"hf": the tokenizer.json file, or a folder holding one."""
    bos_token: str = ""
    """The beginning-of-document token; "": the tokenizer's own (a known name, if any)."""
    eos_token: str = ""
    """The end-of-document token; "": the tokenizer's own (a known name, if any)."""


@dataclass
class Loss:
    """The cross-entropy over the output layer: fused (FLCE) or not."""
    impl: LossImpl = "flce"
    """"flce" (fused linear cross-entropy), "unfused" (logits, then cross-entropy) or "torch_chunked"."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy, in [0, 1] as torch's (1: a uniform target)."""
    z_loss: float = 0.0
    """The z-loss weight (log-sum-exp squared)."""
    softcap: float = 0.0
    """Logit soft-capping, softcap x tanh(logit / softcap); 0: none."""
    logit_scale: float = 1.0
    """A factor on the logits before the softmax."""
    chunk_size: int = 0
    """Tokens per chunk of the fused loss; 0: automatic."""
    memory_lean: bool = False
    """flce: Liger-Kernel's peak memory (gradients + a logits buffer the size of the hidden states).

    Gradients accumulate in the weight dtype (bf16 accumulation error): dW over small token
    chunks, or, at few tokens and a large vocabulary, dx over vocabulary slices (docs/loss.md)."""
    float8: LossFloat8 = "none"
    """flce: the loss's GEMMs in float8 (e4m3, rowwise scales): "logits", or "logits+dx" too.

    Softmax statistics and gradients stay fp32 and dW stays bf16 (flce/float8.py). Taken from
    1024 tokens a call and N·H·V >= 2^38 only; below that the bf16 GEMMs are the faster and the
    loss runs them, without a word (docs/loss.md "Float8 GEMMs")."""
    parallel: LossParallel = "sequence"
    """Under tensor parallelism: shard the loss over the sequence or over the vocabulary."""


@dataclass
class Parallelism:
    """How the ranks split the work: FSDP (sharded / replicated), context and tensor parallelism."""
    data_parallel_replicate_degree: int = 1
    """Replicas (DDP-like; HSDP when sharded too)."""
    data_parallel_shard_degree: int = -1
    """FSDP shards; -1: whatever the other degrees leave of the world size."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel ranks (with sequence parallelism)."""
    context_parallel_degree: int = 1
    """Ranks that share each sequence (PyTorch's ring attention; docs/parallelism.md); 1: none.

    Every sequence is cut into 2 x degree pieces, load-balanced over the ranks, so [training]
    seq_len must be a multiple of 2 x degree. The ranks read the same batches; FSDP shards the
    weights over data_parallel_shard_degree x this degree."""
    context_parallel_rotate_method: RotateMethod = "allgather"
    """How ring attention passes keys and values round: "allgather" (all at once) or "alltoall" (one step at a time)."""
    fsdp_reshard_after_forward: ReshardAfterForward = "default"
    """Free gathered weights after forward: "default" (all blocks but the last), "always", "never" (ZeRO-2).

    "default" reshards none when nothing is sharded (data_parallel_shard_degree x context_parallel_degree is 1)."""


@dataclass
class Comm:
    """How long a rank waits for the others in a collective (longer fails the run instead of hanging it), and what it records of them."""
    init_timeout_seconds: int = 300
    """The collectives' timeout up to the end of the first step, and where ranks may wait long on each other after it.

    Start-up (building, loading: rank 0 alone reads an initial_load_path Hugging Face folder) and
    the first step (compilation, warm-up) run under it, and so do checkpoint saves (the ranks wait
    on each other's writes, then on rank 0 committing and pruning), evaluations (the first one
    compiles) and the end of the run (rank 0 closes the metrics backends while the others wait).
    Raise it when one rank can be that much slower than the others there. The device mesh's
    subgroups have it too (torch would give them its backend's default: 30 min on gloo, 10 on
    NCCL)."""
    train_timeout_seconds: int = 100
    """The collectives' timeout after the first training step, with more than one rank.

    A rank that stalls longer (a hung GPU or node, a stuck data loader) fails the run: the ranks
    waiting for it stop with a timeout error (NCCL's watchdog ends them; under gloo the error
    names this key). An asynchronous save's collectives, in the background, keep torch's default
    (30 min), as torchtitan's do."""
    trace_buf_size: int = 20000
    """How many of its latest collectives each rank's flight recorder (NCCL's) keeps; 0: none.

    On a collective's timeout every rank writes its record to
    <dump_folder>/<save_traces_folder>/<save_traces_file_prefix><rank>: the collectives it
    started and finished, so the rank that never reached one shows (`torchfrtrace <folder>`,
    torch's analyzer, compares the ranks' files). NCCL's only: a CPU (gloo) run records nothing
    and makes no folder."""
    save_traces_folder: str = "comm_traces"
    """The flight recorder's folder, under the dump folder."""
    save_traces_file_prefix: str = "rank_"
    """The flight recorder's file names: this prefix, then the rank."""


@dataclass
class Checkpoint:
    """Saving and resuming: <dump_folder>/<folder>/step-<N>/."""
    enable: bool = False
    """Save checkpoints and resume from the latest one (also read as torchtitan v0.1's enable_checkpoint)."""
    folder: str = "checkpoint"
    """The checkpoints' folder, under the dump folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep this many newest checkpoints, deleting older ones; 0: keep all."""
    load_step: int = -1
    """The step to resume from; -1: the latest."""
    initial_load_path: str = ""
    """Weights to start from when there is no checkpoint to resume: a step folder (or a checkpoint folder: its latest) or a Hugging Face model folder.

    Loaded with enable = false too (a run that saves nothing never resumes either). A Hugging
    Face folder also gives the tokenizer (when [tokenizer] is all defaults) and the vocab size
    (when [model] vocab_size is 0), with a log line saying so."""
    async_mode: AsyncMode = "disabled"
    """"async": training goes on while a save is written (its collectives in a gloo group of their own)."""


@dataclass
class Metrics:
    """Where the metrics go: stdout and metrics.jsonl always, wandb and TensorBoard on request."""
    log_freq: int = 10
    """Log every this many steps (the only steps where the host waits for the device)."""
    enable_wandb: bool = False
    """Log to Weights & Biases too (needs wandb installed)."""
    wandb_project: str = "flce"
    """The wandb project."""
    wandb_run_name: str = ""
    """The wandb run's name; "": wandb's."""
    wandb_mode: WandbMode = "offline"
    """"offline" writes locally (upload later with `wandb sync`); "online" talks to the server."""
    enable_tensorboard: bool = False
    """Write TensorBoard events to <dump_folder>/tb (needs tensorboard installed)."""


@dataclass
class Validation:
    """The loss (and bits per byte) on held-out data."""
    enable: bool = False
    """Evaluate during training."""
    freq: int = 50
    """Evaluate every this many steps (and at the last step)."""
    steps: int = 10
    """Batches per evaluation (the same ones each time, so the numbers compare)."""


@dataclass
class ActivationCheckpoint:
    """Recompute activations in the backward pass instead of keeping them."""
    mode: ACMode = "none"
    """"full": every block; "selective": as selective_ac_option says; "memory_budget": the
    compiler picks what each compiled block recomputes (needs [compile] enable with "model")."""
    selective_ac_option: str = "2"
    """selective: "op" (every block, keeping the attention's and every other matmul's outputs,
    recomputing the elementwise work; torchtitan's per-op policy) or a positive integer n
    (every n-th block, whole)."""
    memory_budget: float = 0.5
    """memory_budget: the share (0 to 1) of a compiled block's activation memory kept for
    backward; torch.compile's partitioner recomputes the rest, the cheapest ops to recompute
    first (1: nothing recomputed; 0: as much as it can)."""


@dataclass
class Compile:
    """torch.compile."""
    enable: bool = False
    """Compile the listed components."""
    components: list[CompileComponent] = field(default_factory=lambda: ["model"])
    """What to compile: "model" (each block) and / or "loss" (matters for the unfused loss)."""


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots, per rank."""
    enable_profiling: bool = False
    """Record traces."""
    save_traces_folder: str = "profile_traces"
    """The traces' folder, under the dump folder (step-<N>/rank-<r>.json, for Perfetto); not the
    checkpoint folder nor one holding it."""
    profile_freq: int = 10
    """Profile one step every this many steps (traces), dump a memory snapshot every this many."""
    enable_memory_snapshot: bool = False
    """CUDA memory history with Python stacks, dumped every profile_freq steps and on running out
    of memory (`python3 -m scripts.bench.summarize_memory` reads it)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """The snapshots' folder, under the dump folder (step-<N>/rank-<r>.pickle, oom-step-<N>/);
    not the checkpoint folder, the traces' folder, nor one holding either."""


@dataclass
class Float8:
    """Float8 linear layers (torchao), used when [model] converters lists "quantize.linear.float8"."""
    recipe_name: Float8Recipe = "tensorwise"
    """torchao's recipe: "tensorwise" (one scale per tensor; the fastest), "rowwise", or "rowwise_with_gw_hp".

    "rowwise_with_gw_hp": rowwise, with the weight gradient's GEMM in high precision."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers left in high precision: those whose name contains any entry (e.g. "layers.0.", "wk").

    "output" always stays: the loss reads its weight directly, it never runs as a linear layer.
    Layers with a dimension that is not a multiple of 16 are skipped too (fp8 GEMMs need it),
    and named in the log."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP all-gathers the weights cast to float8 (half the bytes of bf16); tensorwise only."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With the float8 all-gather: every weight's scale from one all-reduce after the optimizer step.

    Instead of one small all-reduce per weight at each all-gather."""
    emulate: bool = False
    """Emulate the float8 GEMMs in high precision (same rounding), for tests without fp8; slow.

    For the CPU or GPUs without fp8 (compute capability < 8.9); not for training."""


@dataclass
class QuantizeLinear:
    """[quantize.linear]: quantized linear layers."""
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    """[quantize]: quantization of the model."""
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    loss: Loss = field(default_factory=Loss)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    quantize: Quantize = field(default_factory=Quantize)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A config that cannot be used: it names the key (the command line shows it as one line)."""
