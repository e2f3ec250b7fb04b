"""`python -m smelt ...` is the `smelt` command."""
from smelt.cli import main

main()
