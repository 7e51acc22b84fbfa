"""The transformers trainer: its forward with taps, routing replay, tensor parallelism."""
