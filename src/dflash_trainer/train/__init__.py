"""Online training against a frozen target: the step, the trainer (built in a stated order),
token-budget batching, optimiser, checkpoints, distributed setup, the run directory and plots."""
