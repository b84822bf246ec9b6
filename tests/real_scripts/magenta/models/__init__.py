"""Stand-in package (see magenta/__init__.py)."""
