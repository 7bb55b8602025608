"""Parallelising the model: the device mesh, FSDP2, activation checkpointing and compile;
build.py builds the model a run trains (model_args, build_model) with them."""
