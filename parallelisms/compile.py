"""torch.compile per transformer block: same graph for every block, so one compilation."""

import torch


def compile_blocks(model: torch.nn.Module) -> None:
    # Module.compile() compiles in place: parameter names (and so checkpoints) stay the same.
    for block in model.layers.values():
        block.compile(fullgraph=True)
