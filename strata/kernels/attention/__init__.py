"""Attention of a window's rows over their slots' KV cache: the plain-torch reference and the
dispatch (window), the decode rows' fixed-order Triton kernel (decode_triton; with int8
activations it also quantizes its rows for the o projection's int8 kernels: kernels.quant's
Codes and row quantizer) and a prompt chunk's blocked one (chunk_triton).
May import: kernels, kernels.quant"""
