"""mlx-pd: decode_node package."""
