import sys

from jaxfuse.cli import main

sys.exit(main())
