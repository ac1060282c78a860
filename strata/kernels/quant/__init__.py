"""Matmuls over weights kept in GGUF's block types: the types' packed planes (blocks, weight),
the Triton readers of those blocks every kernel shares (reads), the kernels with float
activations (float_triton) and with int8 ones (a8, a8_triton, a8_gemv, a8_gated, the MMAs
a8_mma, a8_gluon and a8_ring; a8_parts: the parts of K and how they are added), and the
projections a layer calls (ops). Beneath kernels' fused and moe, which call it;
above the dense tiles it shares (skinny_triton, fused_triton) and the policy.
May import: kernels"""
