"""``python -m zaya_jax.cli``: the ``zaya`` command of this installation."""

import sys

from zaya_jax.cli import entry

sys.exit(entry())
