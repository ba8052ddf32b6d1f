"""The runtime inside every worker and spare: session, snapshots, replicas and process groups."""
