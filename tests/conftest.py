"""Shared pytest setup for mlx-pd.

The markers (`slow`: long tests over the real model, still run in CI; `ray`: tests that start a local
Ray cluster) and the default per-test timeout (600 s, pytest-timeout) are declared in pyproject.toml.
Fixtures shared by several test files go below.
"""
