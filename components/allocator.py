"""Which CUDA caching allocator settings a run gets (no torch here: the benchmark launchers,
which do not import torch, record them)."""

import os

# The CUDA caching allocator's setting for a run whose user set none: segments that grow in
# place instead of fixed-size ones, as torchtitan's launcher (run_train.sh) sets. On one H200
# the 1B recipe's float8 run at batch 12 then peaks at 108.5 GiB reserved instead of 110.6, at
# the same speed (docs/performance.md, "The fastest recipe").
ALLOCATOR_SETTINGS = "expandable_segments:True"
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def default_allocator_settings(environ=os.environ) -> None:
    """ALLOCATOR_SETTINGS unless the user set the allocator (either variable): called before
    the first CUDA allocation, which is when PyTorch reads the variable."""
    if not any(name in environ for name in ALLOCATOR_ENV):
        environ["PYTORCH_ALLOC_CONF"] = ALLOCATOR_SETTINGS


def run_environment(environ=os.environ) -> dict:
    """A copy of environ as a trainer launched with it runs: with the default unless set."""
    env = dict(environ)
    default_allocator_settings(env)
    return env


def allocator_settings(environ) -> dict:
    """The allocator variables set in environ (what a report records)."""
    return {name: environ[name] for name in ALLOCATOR_ENV if name in environ}
