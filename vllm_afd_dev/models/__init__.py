"""The built-in checkpoints: tiny random-weight models of each architecture
(``tiny_model``) and their FP8 block-quantized form (``fp8_checkpoint``)."""
