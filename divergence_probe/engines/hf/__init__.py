"""The transformers trainer: its forward with taps, routing replay, tensor parallelism; where transformers keeps each
family's modules (layouts.py) and the region patches on them (patches/)."""
