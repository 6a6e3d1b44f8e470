// Quantized weight × Q8_1 activations, as int8 dot products (__dp4a), the way llama.cpp's
// CUDA mat-vec does (ggml-cuda/mmvq.cu, vecdotq.cuh); the weight kinds are in matvec_q.cuh.
// Kernels matvec_<type>, matvec_glu_<type>, matvec_moe_down_<type>, matmul_<type>,
// matvec_id_<type>: see matvec.cuh.
#include "matvec_q.cuh"

DEFINE_MATVEC(q4_0, QuantKind<Q4_0>)
DEFINE_MATVEC(q4_1, QuantKind<Q4_1>)
DEFINE_MATVEC(q5_0, QuantKind<Q5_0>)
DEFINE_MATVEC(q5_1, QuantKind<Q5_1>)
DEFINE_MATVEC(q8_0, QuantKind<Q8_0>)
DEFINE_MATVEC(q4_k, Q4KPairKind)
DEFINE_MATVEC(q5_k, QuantKind<Q5_K>)
DEFINE_MATVEC(q6_k, Q6KKind)
DEFINE_MATVEC(mxfp4, QuantKind<MXFP4>)

// matvec_q6_k with each chunk of a row read by the warp together (matvec.cuh: MV_COOP_WARPS)
DEFINE_MATVEC_COOP(q6_k, Q6KKind)

// q and k of one type, v of another (llama-quantize's *_M recipes give attn_v more bits)
DEFINE_MATVEC_MIXED(q4_k_q6_k, Q4KPairKind, Q6KKind)
DEFINE_MATVEC_MIXED(q5_k_q6_k, QuantKind<Q5_K>, Q6KKind)
