"""The `smelt` console command: one entry point for every stage and tool (smelt.cli; docs/cli.md).

The top floor of the layout: it may import any stage and nothing imports it.
"""
