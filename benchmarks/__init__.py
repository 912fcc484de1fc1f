"""The benchmarks tool beside the product: load generator, comparisons, profiling, reliability harness.

`mlx-pd bench` and `mlx-pd profile` run `benchmarks.cli.main` and `benchmarks.profile_cli.main`; the product
never imports this package (tests/test_dependency_rule.py). `REQUIRES` are the packages of the `[bench]` extra
(pyproject.toml), which the server does not need; the CLI checks them before it hands over.
"""

REQUIRES = ("httpx", "matplotlib")
