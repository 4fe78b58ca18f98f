"""`python -m nbexec.cli`: the `nbexec` command."""

from .main import main

main()
