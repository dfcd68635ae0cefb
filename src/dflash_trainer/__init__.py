"""dflash-trainer: train DFlash block-diffusion drafters for Hugging Face causal LMs."""

__version__ = "0.1.0"
