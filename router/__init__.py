"""mlx-pd: router package."""
