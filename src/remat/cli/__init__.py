"""The ``remat`` command line: one file per subcommand, each a thin wrapper over the public API."""
