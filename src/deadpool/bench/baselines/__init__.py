"""Baselines for `deadpool bench recovery`: the same GPT workload recovered by other means."""
