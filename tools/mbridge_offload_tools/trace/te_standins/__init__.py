"""Transformer Engine stand-ins beyond ``trace/standins.py`` (whose folder is full): context-parallel attention, FP8.

The child imports these modules by name (``te_standins.context_parallel``), as it imports its siblings.
"""
