"""Placeholder: the dsg plugin is being written (registers nothing yet)."""
