"""``mbridge-offload plot`` and the MCP tool ``plot_offload``: the planner's answers as a picture.

Three kinds: a sweep of one planner input (peak memory per stage and step time, each point an ``estimate``), the
phases of one step per pipeline stage (``estimate``'s ``phases``), and ``recommend``'s ranked options side by side.
The points come from ``plan.service.plan`` (``points``, ``sweep``); matplotlib draws them (``figures``, imported
only when a picture is drawn); the file is written under apply's rules (``output``).
"""
