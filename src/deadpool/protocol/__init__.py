"""The control plane's wire: an authenticated key-value store, torch-free (no pickle, no torch)."""
