"""Cluster-scale goodput model: checkpoint-restart, replica dropping and hot swap, closed form and Monte Carlo."""
