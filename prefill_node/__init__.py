"""mlx-pd: prefill_node package."""
