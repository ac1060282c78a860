"""strata-launch: the CLI, the plan (split, devices, link), spawning the stages (on this host,
from other hosts, on Ray), readiness and teardown, serving over HTTP. It assembles processes
and holds no policy.
May import: coordinator, stage_worker, protocol, kernels, model, trace, config_error"""
