"""`python -m cardiofl`: the same command line as the installed `cardiofl`."""

from cardiofl.cli import main

main()
