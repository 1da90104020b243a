"""A small FSDP + tensor-parallel transformer, driven only by annotations.

Run `python -m examples.transformer` (8 CPU devices) or with `--processes 2`
(2 processes x 4 devices). See docs/tutorial-transformer.md.
"""
