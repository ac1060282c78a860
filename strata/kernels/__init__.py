"""The numeric kernels of a stage, each with a plain-torch reference and a test, the choice among
them in one policy object (policy). Grouped by what they compute: attention/, sampling/, quant/
(matmuls over GGUF-quantized weights); here the dense row kernels (fused, fused_triton,
skinny_triton, norms, rope), the routed experts (moe, moe_route, moe_triton), arrive (the
counters by which the last program of a tile adds its parts), pdl (kernels launched while the
one before runs) and device (host values onto the device).
quant/ reads the dense tiles and the policy while fused, moe and moe_triton call quant/, so
those three state their own rule; this line is the rule for the others. The sampler
takes a window's sampled rows as protocol/rows.py defines them (SamplingRow: one definition for
the coordinator, the wire and the kernels), a leaf module that imports nothing:
May import: config_error, protocol.rows"""
