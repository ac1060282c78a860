"""Benchmarks and harnesses of strata, apart from the runtime: `strata-bench` (cli.py) and its
subcommands, `python -m strata.bench.windowbench` and `python -m strata.bench.tracereport`
(kernel timings: tools/gpu/). They drive the runtime through strata.launch and
strata.coordinator; nothing in the runtime imports them.
May import: launch, coordinator, stage_worker, protocol, kernels, model, trace, config_error, train"""
