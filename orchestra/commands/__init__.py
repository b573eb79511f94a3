"""The `orchestra` command's subcommands, one module each, registered by `orchestra/cli.py`.

May import anything in orchestra below the CLI; nothing imports it but the CLI and the benchmarks.
"""
