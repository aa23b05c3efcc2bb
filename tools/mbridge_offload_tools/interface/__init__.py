"""One interface for the CLI and the MCP server: each tool declared once (``tools.py``: its parameters, title and
description), the ``mbridge-offload`` subcommand and the MCP tool's signature built from it (``build.py``)."""
