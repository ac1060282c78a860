"""Weight types of random-weight files: the ggml type each matrix gets, and the file type.

A weight type names either one type for every matrix (``Q4_K``) or a mix (``Q4_K_M``): the
types llama.cpp's ``llama-quantize`` gives the tensors of a llama model for that file type.
The mix rules follow src/llama-quant.cpp of ggml-org/llama.cpp (commit 007dbbf3fd17), functions
``llama_tensor_get_type_impl``, ``tensor_type_fallback`` and ``llama_ftype_get_default_type``.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES, LlamaFileType

from strata.model import kquant_blocks

# Types made by quantizing Gaussian weights with gguf-py: mkmodel.random_tensor gives their
# values.
QUANTIZABLE_TYPES = ("F32", "F16", "BF16") + tuple(t.name for t in kquant_blocks.QUANTIZED_TYPES)
# Types gguf-py cannot quantize to (K-quants, IQ types, NVFP4): random valid blocks.
RANDOM_BLOCK_TYPES = tuple(t.name for t in kquant_blocks.RANDOM_BLOCK_TYPES)
# mix -> llama.cpp's default type for it (what the tensors no rule singles out get)
MIXES = {"Q3_K_M": QType.Q3_K, "Q4_K_M": QType.Q4_K, "Q5_K_M": QType.Q5_K}
MIX_TYPES = tuple(MIXES)
WEIGHT_TYPES = QUANTIZABLE_TYPES + RANDOM_BLOCK_TYPES + MIX_TYPES

# general.file_type is LlamaFileType.MOSTLY_<weight type>, except for these. A single type's
# is the llama_ftype whose default type it is, as `llama-quantize --pure` writes it (the _M
# one for the K-quants that have several).
_FILE_TYPE_NAMES = {"F32": "ALL_F32", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M",
                    "Q5_K": "MOSTLY_Q5_K_M", "IQ2_S": "MOSTLY_IQ2_M",
                    "MXFP4": "MOSTLY_MXFP4_MOE"}

# llama.cpp's tensor_type_fallback for the types these mixes use: the type a tensor gets when
# its row length is not a multiple of the chosen type's block size (then F16 if still not).
_FALLBACK = {QType.Q3_K: QType.Q4_0, QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1,
             QType.Q6_K: QType.Q8_0}


def weight_type_name(weight_type: str | QType) -> str:
    """The upper-case name of a weight type of WEIGHT_TYPES; a ValueError listing them
    otherwise."""
    name = weight_type.name if isinstance(weight_type, QType) else str(weight_type).upper()
    if name not in WEIGHT_TYPES:
        raise ValueError(f"unsupported weight type {weight_type!r}; choose one of "
                         f"{', '.join(WEIGHT_TYPES)}")
    return name


def file_type(weight_type: str) -> LlamaFileType:
    """The general.file_type of a file of ``weight_type`` (a validated, upper-case name)."""
    return LlamaFileType[_FILE_TYPE_NAMES.get(weight_type, f"MOSTLY_{weight_type}")]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one
    between them. (i_layer - n/8) is never negative where evaluated, so Python's % agrees
    with C++'s."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def mix_tensor_type(mix: str, name: str, cols: int, n_blocks: int, tied: bool,
                    llama_70b: bool = False, n_experts: int = 0) -> QType:
    """The type llama-quantize gives matrix ``name`` (rows of ``cols`` values) of a llama
    model of ``n_blocks`` blocks (block_count, NextN layers included) for file type ``mix``.

    What llama_tensor_get_type_impl does for these file types on a llama model (and the
    other families'):
    output.weight, and token_embd.weight when there is no output.weight (``tied``), get Q6_K
    (Q8_0 if ``cols`` is not a multiple of 256); attn_v gets Q6_K in the use_more_bits layers
    for Q4_K_M and Q5_K_M, Q5_K in layers 0-1 and Q4_K after for Q3_K_M; ffn_down gets Q6_K
    in the use_more_bits layers for Q4_K_M and Q5_K_M, Q5_K in the first n/16 layers and Q4_K
    after for Q3_K_M (an MoE layer's ffn_down_exps and ffn_down_shexp alike); attn_output gets
    Q4_K for Q3_K_M; for a 70B (80 layers, grouped-query attention: ``llama_70b``) a Q3_K or
    Q4_K attn_v becomes Q5_K; a model of exactly 8 experts (``n_experts``, Mixtral's rule)
    gets Q8_0 attn_k and attn_v and Q5_K attn_output. Everything else gets the mix's default
    type (an MoE router, ffn_gate_inp, stays F32: no matrix here). Last, tensor_type_fallback
    replaces a type whose block size does not divide ``cols``. llama.cpp counts attn_v and
    ffn_down tensors in file order, sorted by block: for a llama model that count is the block
    number in the name (where ffn_down tensors are not one a block, llama.cpp reads the block
    number from the name: the same).
    """
    default = MIXES[mix]
    block = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = QType.Q8_0 if cols % GGML_QUANT_SIZES[default][0] else QType.Q6_K
    elif name.endswith("attn_v.weight"):
        if mix == "Q3_K_M":
            qtype = QType.Q5_K if block < 2 else QType.Q4_K
        else:
            qtype = QType.Q6_K if use_more_bits(block, n_blocks) else default
        if llama_70b and qtype in (QType.Q3_K, QType.Q4_K):
            qtype = QType.Q5_K
        if n_experts == 8:
            qtype = QType.Q8_0
    elif name.endswith("attn_k.weight") and n_experts == 8:
        qtype = QType.Q8_0
    elif name.endswith("attn_output.weight") and n_experts == 8:
        qtype = QType.Q5_K
    elif ".ffn_down" in name:
        if mix == "Q3_K_M":
            qtype = QType.Q5_K if block < n_blocks // 16 else QType.Q4_K
        else:
            qtype = QType.Q6_K if use_more_bits(block, n_blocks) else default
    elif name.endswith("attn_output.weight") and mix == "Q3_K_M":
        qtype = QType.Q4_K
    else:
        qtype = default
    return _fallback(qtype, cols)


def _fallback(qtype: QType, cols: int) -> QType:
    """tensor_type_fallback: ``qtype`` if its blocks fit rows of ``cols`` values, else its
    fallback, else F16. A type without one (Q8_0) is kept: llama.cpp refuses such a tensor,
    and so does the writer, with a sentence about the row length."""
    if cols % GGML_QUANT_SIZES[qtype][0] == 0 or qtype not in _FALLBACK:
        return qtype
    qtype = _FALLBACK[qtype]
    return qtype if cols % GGML_QUANT_SIZES[qtype][0] == 0 else QType.F16
