"""Subcommand modules of the tandem CLI; each exposes a click command named `command`."""
