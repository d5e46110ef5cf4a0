"""`python -m clusterft <stage> ...`"""
import sys

from .cli import main

sys.exit(main())
