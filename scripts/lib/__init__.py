"""What the scripts share, imported as `scripts.lib.<module>` (the scripts run from the
repository root as modules: `python3 -m scripts.bench.train`, see scripts/__init__.py).

    runs.py     trainer runs in their own process group: launch, stop, log tail, the rows of
                metrics.jsonl, throughput over the measured windows, the run's status
    run_folders.py  the dump folder of each such run: made fresh, cleared only if a script made
                it (also `python3 -m scripts.lib.run_folders check|fresh DIR ...` for the shell)
    report.py   a report's provenance (environment, command, commit; a dirty tree flagged) and
                its files (<out>.json and <out>.md, written atomically), table helpers
    timing.py   the one timer of the GPU benchmarks (median ms; CUDA events, or the wall clock)
    loss_grid.py  the loss grid of `bench.flce --grid` (its points, its report), and the one
                reader of the benchmarks' shapes ("NxHxV" and lists of them: parse_shape(s))
    train_report.py  the report of `bench.train`: its meta, the summary per loss and fused
                against the others, the markdown; the AC modes and measured steps it shares
    checkpoints.py  a trained model as export_hf, generate and evaluate read it
    trace_timeline.py  where a profiled step's GPU time goes on its timeline (summarize_trace)
    prepare_shards/  raw documents to token shards, in worker processes (prepare_data's engine):
                units.py (the inputs cut into units), worker.py (one unit tokenized),
                run.py (settings, resuming, the worker pool, index.json)

runs.py, report.py and train_report.py never import torch: a CUDA context in a launcher would
take GPU memory from the runs it launches. The shell helpers here (gpus.sh, torchrun.sh, usage.sh)
are sourced by the shell scripts.
"""
