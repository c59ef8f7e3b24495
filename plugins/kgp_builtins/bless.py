"""Placeholder: the bless plugin is being written (registers nothing yet)."""
