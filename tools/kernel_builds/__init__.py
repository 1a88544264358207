"""Triton build time per kernel configuration against concurrency, on a GPU machine."""
