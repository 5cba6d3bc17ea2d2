"""The control channel of a running experiment, below the CLI and the dashboard that use it."""
