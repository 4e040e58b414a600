"""The `deadpool` command, one module per subcommand. Nothing in the package imports it."""
