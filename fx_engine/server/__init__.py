"""The HTTP shell: an OpenAI-compatible server on the Engine (`fx-engine serve`)."""

from fx_engine.runtime import setup

setup()  # a shell entry point: process set-up (BLAS, malloc) before mlx is imported
