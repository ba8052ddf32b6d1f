"""The `deadpool` command: parse arguments into a config, start the coordinator and the processes."""
