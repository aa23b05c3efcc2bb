"""``mbridge-offload plot`` and the MCP tool ``plot_offload``: the planner's answers as a picture.

A sweep of one input, the phases of a step, or recommend's options: the points from the planner (``points``),
drawn by matplotlib (``figures``, imported only to draw), written under apply's rules (``output``).
"""
