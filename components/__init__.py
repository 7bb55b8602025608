"""Training-loop building blocks: optimizer, learning-rate schedule, metrics."""
