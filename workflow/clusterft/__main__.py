"""`python -m clusterft <stage> ...`"""
import sys

from clusterft.cli import main

sys.exit(main())
