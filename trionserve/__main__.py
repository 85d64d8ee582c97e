"""``python -m trionserve`` runs the server."""

import sys

from trionserve.cli import main

sys.exit(main())
