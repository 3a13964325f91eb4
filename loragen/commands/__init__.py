"""Subcommands of the ``loragen`` command line, one module each."""
