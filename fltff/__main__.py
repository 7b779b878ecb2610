"""`python -m fltff <command> [flags]`: the `fltff` command (see `fltff.cli`)."""

from fltff.cli import main

if __name__ == '__main__':
  main()
