"""Benchmarks: both sides measured in one run, figures computed from the runs' events."""
