"""Command-line pipelines: `run` (one experiment from gin) and `bench` (speed ratios)."""
