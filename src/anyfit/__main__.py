import sys

from anyfit.cli import main

sys.exit(main())
