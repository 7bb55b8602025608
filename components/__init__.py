"""The recipe's building blocks, each taking its config section.

    config/        the config: schema, parser and writer, --help and docs/config.md
    data/          training data, from a source to batches
    tokenizer.py   the byte tokenizer and Hugging Face tokenizers
    loss.py        [loss] impl: the training loss and the module joining it to the model
    optim.py       AdamW and the learning-rate schedule
    metrics.py     what a step achieved and where it is recorded (metrics_timeline.py: the file
                   read back as the run's timeline); bad_steps.py: non-finite steps
    checkpoint.py  DCP checkpoints (checkpoint_folders.py: which step folders are whole and
                   which one a run resumes from; checkpoint_manifest.py: checksums; safe_dcp.py:
                   loading without running code; initial_load.py: settings from
                   initial_load_path)
    float8_linear.py  linear layers converted to torchao's float8
    lock.py, stop_request.py, process.py  the run's lifetime: the dump folder's lock, stop
                   signals, the process group and the process's exit; rank_warnings.py: a
                   warning every rank gives alike, printed by rank 0 alone
    synced_files.py  writes a kill or a power loss cannot leave half done (checkpoints, token
                   shards, data caches; scripts/lib's reports)
    profiling.py   the torch profiler, when [profiling] asks for it
    allocator.py   the CUDA caching allocator's settings a run gets (recorded by the launchers)
    host_memory.py  whether a run on the CPU can hold its model's fp32 state and activations in
                   this machine's memory
    validation.py  [validation]: the loss and bits per byte on held-out batches (evaluate())
"""
