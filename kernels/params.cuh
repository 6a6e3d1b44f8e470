// Parameter structs: every kernel takes its buffers first and one of these by value last.
// kernels/params.py describes the same structs for the host; conformance/test_nvrtc_compile.py
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
    int capacity;         // cache slots; positions outside [0, capacity) are not written
    int pad0;
};

struct AttentionParams {
    int n_tokens;
    int n_heads;
    int n_kv_heads;
    int head_dim;         // of queries and keys
    int head_dim_v;
    int capacity;         // cache slots
    int n_slots;          // logits kept in shared memory: capacity, or the window if smaller
    int window;           // 0: none; else key s is visible when pos - s < window
    float scale;
    int pad0;
};

struct RowParams {
    int n_rows;
    int n_cols;
    int k;                // top-k: how many to keep
    int pad0;
};
