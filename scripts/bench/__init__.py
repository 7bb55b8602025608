"""The benchmark harness: each writes <out>.json and <out>.md with its provenance
(scripts/lib/report.py); benchmarks/README.md indexes the results.

    flce.py              the loss alone: fused vs unfused vs peers, float8, chunk sweeps, a grid
    chunk_sizes.py       flce at forced chunk sizes against its own choice (its rule's evidence)
    float8_grid.py       the float8 loss over the grid, against bf16 and its float8 floor
    loss_parallel.py     the loss under TP=2: sequence- vs vocab-parallel (torchrun)
    attention.py         causal SDPA per backend at the models' shapes
    step_floor.py        a step's GEMMs, attention, loss and optimizer timed alone, summed
    train.py             train.py runs: equal batch, the largest batch per loss and AC mode
    peers.py             this repository against torchtitan, in one call
    data.py              the data loaders alone, against what a GPU consumes
    tune_rows_kernel.py  the row kernel's block sizes and warps (flce/kernels.py's table)
    kernel_registers.py  the row kernel's registers and spills a thread, compiled without a GPU
    loss_kernels.py      each loss's GPU kernels at given shapes, from the profiler
    grad_gemms.py        the chunked sweep's dx and dW GEMMs, bf16 against fp32 outputs
    float8_dx.py         the float8 loss's dx GEMM whole and in row blocks, and its kernels
    row_order.py         pass 2 of the row kernel backwards (as flce runs it) against forwards
    row_overlap.py       an experiment: the row pass beside a GEMM on another stream
    logits_epilogue.py   an experiment: the softmax statistics in a Triton logits GEMM's epilogue
    summarize_trace.py   a profiled step's top kernels and kinds of kernel (a report with --out)
    summarize_memory.py  what held a GPU's memory at its peak, from a CUDA memory snapshot
    peer_runs/           the peers' argument files of `bench.peers` (1B on one GPU, 8B on two)

    python3 -m scripts.bench.NAME --help
"""
