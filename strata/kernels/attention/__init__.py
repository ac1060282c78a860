"""Attention of a window's rows over their slots' KV cache: the plain-torch reference and the
dispatch (window), the decode rows' fixed-order Triton kernel (decode_triton) and a prompt
chunk's blocked one (chunk_triton).
May import: kernels"""
