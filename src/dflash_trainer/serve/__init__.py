"""Serving a drafter in an inference server: starting vLLM, reading its counters, and
`dflash serve-check` (docs/serving.md)."""
