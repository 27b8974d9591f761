"""Subcommands of ``vmcache``: one module each (see ``vmcache.cli``)."""
