"""strata-worker: one stage process, its main loop, model slice, KV cache, CUDA graphs, the
link to its neighbours and the last stage's head and drafter. It never imports the coordinator.
May import: protocol, kernels, model, trace, config_error"""
