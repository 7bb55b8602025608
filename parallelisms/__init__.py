"""Parallelising the model: the device mesh, FSDP2, activation checkpointing and compile."""
