"""How the commands print machine-readable results."""

from __future__ import annotations

import json
from typing import Any


def print_json(obj: Any) -> None:
    """``obj`` as indented JSON on stdout, keys in their given order."""
    print(json.dumps(obj, indent=2, sort_keys=False))
