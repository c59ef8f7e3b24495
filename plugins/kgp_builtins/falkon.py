"""Placeholder: the falkon plugin is being written (registers nothing yet)."""
