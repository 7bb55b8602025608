"""The repository's scripts. The Python ones run from the repository root as modules, so that
the recipe (components, models, parallelisms) and what the scripts share (scripts/lib/) import
without any sys.path edit:

    python3 -m scripts.bench_train --help
    torchrun --nproc_per_node 2 -m scripts.bench_loss_parallel

Run as a file, a script that imports the repository stops with a one-line error saying so;
compare_losses.py and summarize_trace.py import only the standard library and run either way.
Only `flce` is an installed library (`pip install -e .`); the recipe runs from the repository.
"""
