"""strata-train-mtp: a NextN (MTP) head for a model that has none, trained by self-distillation
from the frozen target (prompts.py: the prompts; data.py: the target's answers through strata
and its hidden states; torch_llama.py: the differentiable forward; fit.py: training and
teacher-forced acceptance; export.py: the sidecar GGUF; cli.py: the command).
May import: launch, coordinator, stage_worker, protocol, kernels, model, trace, config_error"""
