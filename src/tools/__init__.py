"""Command-line tools beside the server: benchmark, synthetic checkpoints, export."""
