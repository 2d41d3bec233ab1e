"""Benchmarks that anyone can rerun, each side by side with its baseline."""
