// Embedding lookup (ggml_get_rows): rows ids[t] of a table of any weight type, dequantized to
// float32 bit for bit as engine/quants.py does (dequant.cuh).
#include "common.cuh"
#include "dequant.cuh"
#include "params.cuh"

#define GET_ROWS_THREADS 256

template <int TYPE>
__device__ __forceinline__ void get_rows(const u8 * __restrict__ table, const int * __restrict__ ids,
                                         float * __restrict__ y, const GetRowsParams & p) {
    const int t = blockIdx.y;
    const int i = blockIdx.x * GET_ROWS_THREADS + threadIdx.x;
    if (i >= p.n_cols) return;
    const int id = ids[t];
    float v = __int_as_float(0x7fc00000);   // an id outside the table gives NaN, not a stray read
    if (id >= 0 && id < p.n_table_rows) v = dequant_value<TYPE>(table + id * p.row_bytes, i);
    y[(i64) t * p.n_cols + i] = v;
}

#define DEFINE_GET_ROWS(name, TYPE)                                                                \
extern "C" __global__ void __launch_bounds__(GET_ROWS_THREADS)                                     \
get_rows_##name(const u8 * __restrict__ table, const int * __restrict__ ids, float * __restrict__ y, \
                const GetRowsParams p) {                                                           \
    PDL_ENTRY();                                                                                   \
    get_rows<TYPE>(table, ids, y, p);                                                              \
}

DEFINE_GET_ROWS(f32, F32)
DEFINE_GET_ROWS(f16, F16)
DEFINE_GET_ROWS(bf16, BF16)
DEFINE_GET_ROWS(q4_0, Q4_0)
DEFINE_GET_ROWS(q4_1, Q4_1)
DEFINE_GET_ROWS(q5_0, Q5_0)
DEFINE_GET_ROWS(q5_1, Q5_1)
DEFINE_GET_ROWS(q8_0, Q8_0)
DEFINE_GET_ROWS(q4_k, Q4_K)
DEFINE_GET_ROWS(q5_k, Q5_K)
DEFINE_GET_ROWS(q6_k, Q6_K)
DEFINE_GET_ROWS(mxfp4, MXFP4)
