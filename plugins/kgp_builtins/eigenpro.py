"""Placeholder: the eigenpro plugin is being written (registers nothing yet)."""
