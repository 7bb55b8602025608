"""The repository's scripts. The Python ones run from the repository root as modules, so that
the recipe (components, models, parallelisms) and what the scripts share (scripts/lib/) import
without any sys.path edit:

    python3 -m scripts.evaluate --help
    torchrun --nproc_per_node 2 -m scripts.bench.loss_parallel

At the top, what a user runs: prepare_data, generate, evaluate, export_hf, compare_losses,
compare_layouts (and config_reference, which writes docs/config.md); the shell scripts
run_train.sh, compare_fused_vs_unfused.sh, test_gpu.sh and slurm/. bench/ holds the benchmark
harness (each benchmark writes a report into benchmarks/); lib/ what the scripts share.

Run as a file, a script that imports the repository stops with a one-line error saying so;
compare_losses.py imports only the standard library and runs either way. Only `flce` is an
installed library (`pip install -e .`); the recipe runs from the repository.
"""
