"""Drafter files on disk: our own drafter directory, export/import for the z-lab (vLLM, SGLang)
and speculators layouts, the independent-reader check, model cards and weight files."""
