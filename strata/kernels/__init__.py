"""The numeric kernels of a stage: attention, RoPE, norms, sampling, quantized matmuls,
experts; each with a plain-torch reference and a test, chosen by one policy object.
May import: config_error"""
