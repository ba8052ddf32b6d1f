"""The coordinator: membership, failure decisions and the rank -> process map (never imports torch)."""
