"""The imperative shell: owns resources and row membership; calls the pure steps."""

from fx_engine.runtime import setup

setup()  # a shell entry point: process set-up (BLAS, malloc) before mlx is imported
