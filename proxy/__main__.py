"""``python -m proxy`` runs the ``pulsar-tap`` console script."""

import sys

from proxy.cli import main

sys.exit(main())
