"""The one error of configuration: a value, key or combination that cannot work."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value, key or combination that cannot work; the message says what to change."""
