"""The frozen target: loading its HF config and weights, and tapping its hidden states.

Its own room because training, evaluation, planning, the doctor and export all load the target;
inside train/ it would make evaluation depend on training."""
