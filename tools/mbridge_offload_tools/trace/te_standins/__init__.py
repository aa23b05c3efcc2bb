"""Transformer Engine stand-ins beyond ``trace/standins.py`` (whose folder is full): context-parallel attention.

The child imports these modules by name (``te_standins.context_parallel``), as it imports its siblings.
"""
