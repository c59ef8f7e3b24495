"""kgp's built-in plugins.

They live outside the ``kgp`` core package and register through the same hooks and the same
``kgp`` entry-point group as any third-party plugin (see ``pyproject.toml``).
"""
