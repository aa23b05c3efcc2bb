"""The activation offload mechanisms, run inside the trace's child: Transformer Engine's layer-level offload
(``te_layers``: a stand-in with TE's call shape) and megatron-core's own fine-grained manager (``fine_grained``: run as
it is, with the few device spots it needs given). Imported by the child only (torch and megatron-core)."""
