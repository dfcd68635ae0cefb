"""`dflash plan`: FLOPs, memory and time per step of a run before it starts, from the config,
the target's HF config, data statistics and a hardware preset."""
