#!/usr/bin/env python3
"""NumbaSplat command line (``cli/``).  ``python run.py --help`` lists the commands."""
import sys

from cli import main

if __name__ == "__main__":
    sys.exit(main())
