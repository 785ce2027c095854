"""Subcommands of the ``hpsray`` command, one module each (see ``hpsray.__main__``)."""
