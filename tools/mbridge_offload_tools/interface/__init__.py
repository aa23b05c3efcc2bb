"""One interface for the CLI and the MCP server: each tool's parameters declared once (``tools.py``), the
``mbridge-offload`` subcommand's flags and the MCP tool's signature built from them (``build.py``)."""
