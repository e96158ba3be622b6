"""The modelload command line: one entry point, subcommands registered through entry points."""
