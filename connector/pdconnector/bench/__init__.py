"""Benchmarks that print figures (plan building, descriptor counts)."""
