"""mlx-pd: kv_transfer package."""
