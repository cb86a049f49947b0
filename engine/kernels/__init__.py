"""Triton kernel variants. Each module: reference-compatible wrapper, kernel, tunable params as data."""
