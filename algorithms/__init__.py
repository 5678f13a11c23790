"""The math of each algorithm, pure torch: one module per algorithm."""
