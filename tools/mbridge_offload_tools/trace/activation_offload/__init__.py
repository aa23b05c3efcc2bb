"""The activation offload mechanisms the trace's child runs: TE's layer offload and megatron-core's fine-grained one.

Transformer Engine's layer-level offload is a stand-in with TE's call shape (``te_layers``); megatron-core's
fine-grained manager runs as it is, with the few device spots it needs given (``fine_grained``). Imported by the
child only (torch and megatron-core).
"""
