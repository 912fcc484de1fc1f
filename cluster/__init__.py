"""mlx-pd: cluster package."""
