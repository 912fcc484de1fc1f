"""mlx-pd: benchmarks package."""
