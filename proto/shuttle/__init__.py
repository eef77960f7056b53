"""Generated packages of the shuttle protos (see proto/__init__.py)."""
