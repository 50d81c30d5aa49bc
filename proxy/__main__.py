"""`python -m proxy` is `envelope-proxy`."""

import sys

from proxy.cli import main

sys.exit(main())
