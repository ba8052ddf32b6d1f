"""Declarative fault injection: a plan of real faults (SIGKILL, corrupted replicas) keyed by rank, step, phase."""
