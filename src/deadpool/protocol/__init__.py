"""The control plane, torch-free: the job's keys, its typed records (one writer each), the one ControlPlane that
reads and writes them, and the authenticated store beneath (no pickle, no torch)."""
