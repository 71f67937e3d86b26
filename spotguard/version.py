"""The one place the release number is written."""

__version__ = "0.1.0"
