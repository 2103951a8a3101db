"""The training loop: where it stands, its steps, its data and precision (placeholder; see issue 26)."""
