"""The DFlash algorithm, pure and device-agnostic: drafter geometry, packing, anchors, the
attention rule, the drafter module and the loss. Imports nothing from the stages above it
(only `config` and `errors`); tests/test_layout.py checks that."""
