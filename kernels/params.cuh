// Parameter structs: every kernel takes its buffers first and one of these by value last.
// kernels/params.py describes the same structs for the host; conformance/kernels/test_nvrtc_compile.py
// checks that the two layouts agree field by field.
#pragma once

struct QuantizeParams {
    int n_rows;           // rows of x
    int k;                // values per row, a multiple of 32
};

struct MatVecParams {
    int n_rows;           // N: output features (weight rows)
    int k;                // K: input features
    int n_tokens;         // T
    int n_used;           // mul_mat_id: experts per token; 1 otherwise
    long long row_bytes;  // bytes of one weight row
    long long expert_bytes;  // mul_mat_id: bytes of one expert's matrix
    int x_per_slot;       // mul_mat_id: x is [T, n_used, K] (1) or shared [T, K] (0)
    int n_experts;        // mul_mat_id: an id outside [0, n_experts) yields NaN outputs
};

struct GetRowsParams {
    int n_ids;            // rows to gather
    int n_cols;           // values per row
    long long row_bytes;  // bytes of one table row
    int n_table_rows;     // ids outside [0, n_table_rows) yield NaN rows
    int pad0;
};

struct RmsNormParams {
    int n_rows;
    int n_cols;           // normalised length (the last axis)
    float eps;
    int has_weight;       // multiply by w[n_cols] after normalising
    int has_scale;        // then by the scalar `scale` (l2_norm: 1 / sqrt(n_cols))
    float scale;
    int has_gate;         // then by silu(z) of the row's own z (rms_norm_gated)
    int write_q8;         // and the result's Q8_1 blocks to yq (n_cols a multiple of 32)
    int pad0;
};

struct BinaryParams {
    long long n;          // elements of a (and of the output)
    long long n_b;        // b repeats every n_b elements (n_b == n: same shape)
};

struct ScaleParams {
    long long n;
    float s;
    int pad0;
};

// elementwise.cu sigmoid_gate: y = (a +) x * sigmoid(g), g one value a row of `row` elements
// (row_gate) or one an element.
struct SigmoidGateParams {
    long long n;          // elements of x (and of the output)
    int row;              // elements a row
    int row_gate;         // g holds one value a row
    int has_a;            // add a, as the add kernel after the mul
    int pad0;
};

struct GluParams {
    long long n;
};

struct WeightedSumParams {
    int n_tokens;
    int k;                // experts per token
    int n_cols;
    int pad0;
};

struct RopeParams {
    int n_tokens;
    int n_heads;
    int head_dim;
    int n_rot;            // rotated dims at the start of each head; the rest pass through
    float theta_scale;    // base^(-2/n_rot), rounded to float32 on the host as ggml does
    float freq_scale;
    int neox;             // pairs (i, i + n_rot/2) instead of (2i, 2i + 1)
    int pad0;
};

struct KvStoreParams {
    int n_tokens;
    int row_elems;        // H_kv * Dh values per cache slot
    int capacity;         // the sequence's slots (its table's blocks times KV_BLOCK at most);
                          // positions outside [0, capacity) are not written
    int pad0;
};

struct AttentionParams {
    int n_tokens;
    int n_heads;
    int n_kv_heads;
    int head_dim;         // of queries and keys
    int head_dim_v;
    int capacity;         // a sequence's slots (the largest of the rows' with per_row)
    int n_slots;          // logits kept in shared memory: capacity, or the window if smaller
    int window;           // 0: none; else key s is visible when pos - s < window
    float scale;
    int write_q8;         // also write the output as Q8_1 blocks (head_dim_v a multiple of 32)
    int per_row;          // token t reads its own sequence: block table row t (batched decode)
    int table_stride;     // entries per block table row (per_row)
    int split_fill;       // split-K passes 1 and 3: (column, split, query) work items that fill
                          // the GPU, below which a KV group's heads take a block each
};

struct RowParams {
    int n_rows;
    int n_cols;
    int k;                // top-k: how many to keep
    int pad0;
};

// Decode mat-vec over up to three matrices of one weight type that read the same
// activations (q, k, v): their rows are laid end to end, each matrix on whole warps.
struct MultiMatVecParams {
    int k;                // K: input features, shared
    int n_tokens;
    int n_rows0;          // rows of matrix 0, 1, 2 (0: absent)
    int n_rows1;
    int n_rows2;
    int cols;             // matvec_cols_<kind>: tokens per block (a batched decode step's rows)
    long long row_bytes0;
    long long row_bytes1;
    long long row_bytes2;
};

// Gate and up mat-vecs with the gated activation fused: h = act(x W_gate^T) * (x W_up^T),
// and h's Q8_1 blocks for the down projection. With ids (MoE), blockIdx.y is a (token, slot)
// pair and ids[slot] picks the expert matrices.
struct GluMatVecParams {
    int n_rows;           // N: rows of each of the two matrices
    int k;
    int n_tokens;         // T (rows of x)
    int n_used;           // experts per token (1 without ids)
    long long row_bytes;
    long long expert_bytes;
    int has_ids;
    int n_experts;
    int gelu;             // 0: silu (SwiGLU), 1: gelu_tanh through F16 (GeGLU)
    int write_q8;         // also write h as Q8_1 blocks (n_rows a multiple of 32)
    int cols;             // matvec_glu_cols_<kind>: tokens per block
    int pad0;
};

// MoE down projection with the weighted sum over the chosen experts fused:
// out[t] = sum_j w[t, j] * (x[t, j] W_{ids[t, j]}^T), products added one expert after another.
struct MoeDownParams {
    int n_rows;           // N = model width
    int k;                // K: expert FFN width
    int n_tokens;
    int n_used;
    long long row_bytes;
    long long expert_bytes;
    int n_experts;
    int has_scale;        // each expert's output times scales[e] before its routing weight
};

// Residual add fused with the RMS norm that follows it: sum = a + b; y = rms_norm(sum) * w,
// optionally also y as Q8_1 blocks.
struct AddNormParams {
    int n_rows;
    int n_cols;
    float eps;
    int has_residual;     // 0: sum is a itself (no add; the first layer's norm)
    int write_q8;
    int has_scale;        // the sum times scale[0] before the norm (gemma4's layer_output_scale)
};

struct MoeNormsParams {
    int n_rows;
    int n_cols;
    float eps;
    float factor;         // the router input's scalar factor (gemma4: 1 / sqrt(n_embd))
    int write_q8;         // the experts' input as Q8_1 blocks too
    int pad0;
};

// Per-head q/k RMS norms, rope of q and k, and the K/V cache writes of one attention block.
struct RopeStoreParams {
    int n_tokens;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int head_dim_v;
    int n_rot;
    float theta_scale;
    float freq_scale;
    int neox;
    int q_norm;           // apply the q / k head norms (weights qn, kn)
    int k_norm;
    float eps;
    int capacity;         // a sequence's slots; positions outside [0, capacity) are not written
    int write_k;          // also write the roped keys as float32 (for the trace)
    int per_row;          // token t writes its own sequence: block table row t (batched decode)
    int table_stride;     // entries per block table row (per_row)
};

// MoE router: softmax over the experts, top-k, the chosen weights optionally renormalised
// to sum to one, then scaled.
struct MoeRouteParams {
    int n_rows;
    int n_experts;
    int k;
    int norm;
    float scale;
    int pad0;
};

// Greedy decoding on the device: the argmax becomes the next step's token and position.
struct AdvanceParams {
    int capacity;         // length of the history buffer
    int pad0;
};

// Dequantization of whole weight rows to float16 (the tensor-core prefill GEMM's operand).
struct DequantParams {
    int n_rows;           // rows written
    int n_cols;
    long long row_bytes;
    int rows_per_expert;  // 0: row r is source row r; else experts[r / rows_per_expert]'s
    int pad0;             // row r % rows_per_expert (the experts of a prompt, packed)
};

// The token and position a captured decode step reads, set from the host as launch parameters
// (no copy from host memory inside the stream).
struct DecodeSetParams {
    int tok;
    int pos;
};

// Rows of x gathered (and rounded to float16) for the expert GEMMs of a prompt: y[i] = x[idx[i]],
// zeros where idx[i] is -1 (padding).
struct GatherParams {
    int n_out;
    int n_cols;
    int n_src_rows;
    int pad0;
};

// ssm.cu: unary activations of the delta-net layers (op 0 sigmoid, 1 softplus, 2 silu).
struct UnaryParams {
    long long n;
    int op;
    int pad0;
};

// ssm.cu ssm_conv: x [n_tokens, n_channels], state [kernel - 1, n_channels], w [n_channels, kernel].
struct SsmConvParams {
    int n_tokens;
    int n_channels;
    int kernel;
    int silu;             // y = silu(conv), as ssm.cu's unary computes it
};

// ssm.cu delta_net_gates: beta, alpha [n_tokens, n_heads], dt_bias and a [n_heads].
struct DeltaGatesParams {
    long long n;          // n_tokens * n_heads
    int n_heads;
    int pad0;
};

// ssm.cu gated_delta_net_<D> and delta_chunked.cu gated_delta_net_chunked_<D>: q, k
// [n_tokens, n_k_heads, D], v [n_tokens, n_v_heads, D],
// g, beta [n_tokens, n_v_heads], state [n_v_heads, D, D].
struct GatedDeltaNetParams {
    int n_tokens;
    int n_v_heads;
    int n_k_heads;
    int head_dim;
};

// elementwise.cu mul_expert_scale: y and out [n_slots, n_cols] (n_slots = tokens x experts
// per token), ids [n_slots], s [n_experts].
struct ExpertScaleParams {
    int n_slots;
    int n_cols;
    int n_experts;
    int pad0;
};

// A prompt's expert mat-mul on the MMQ tiles (mmq_id_<type>), planned by moe_plan.
struct MoePlanParams {
    int n_slots;          // S = T * n_used (token, slot) pairs
    int n_experts;
    int max_tiles;        // tiles the plan has room for: ceil(S / MMQ_COLS) + min(E, S)
    int pad0;
};

struct MmqIdParams {
    int n_rows;           // N: rows of one expert's matrix
    int k;
    int n_slots;
    int n_used;           // experts per token
    long long row_bytes;
    long long expert_bytes;
    int n_experts;
    int x_per_slot;       // x is [S, K] (1) or [T, K], shared by a token's slots (0)
    int max_tiles;
    int pad0;
};

// attention_tiled.cu attention_tiled_<D>_<DV>: a prompt's causal GQA attention in tiles on
// tensor cores. q [n_tokens, n_heads, D] float32, caches F16 [capacity, n_kv_heads, D] and
// [capacity, n_kv_heads, DV], pos [n_tokens], out [n_tokens, n_heads * DV] float32 (and its
// Q8_1 blocks with write_q8). Grid (n_heads, ceil(n_tokens / 64)).
struct AttentionTiledParams {
    int n_tokens;
    int n_heads;
    int n_kv_heads;       // n_heads is a multiple of it
    int capacity;         // the sequence's slots; slots past capacity - 1 are never read
    int window;           // 0: none; else slot s is visible to query t when pos[t] - s < window
    float scale;
    int write_q8;         // also write the output as Q8_1 blocks
    int pad0;
};
