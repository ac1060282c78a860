"""Tokens from a window's logits: the penalties and biases, the filters and the Gumbel-max pick
(sample, in torch; sample_triton, sorted_triton, gumbel_triton on CUDA), the drafter's pick for
filtered proposals (proposal_pick), and log-probabilities (logprobs). A row's sampling is
protocol/rows.py's SamplingRow.
May import: kernels, protocol.rows"""
