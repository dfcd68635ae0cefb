"""Serving the drafter: the speculative loop, static-shape decoding with CUDA graphs, `dflash
eval`, its reports, the held-out walk used during training, and the prompt sets."""
