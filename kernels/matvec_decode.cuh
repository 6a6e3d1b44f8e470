// One token's decode mat-vecs (included by matvec.cuh): matvec_<kind> and matvec_split_<kind>
// (decode_rows, and for the preloaded kinds decode_rows_preloaded), matvec_coop_<kind>
// (decode_rows_coop) and matvec_mixed_<a>_<b>.
#pragma once
#include "matvec.cuh"

// MV_PRELOAD: a lane's first P items of row w (first, first + step, ...) into buf.
template <class K, int P>
__device__ __forceinline__ void preload_items(const u8 * __restrict__ w, const int n_items, const int first,
                                              const int step, typename K::raw (&buf)[P]) {
#pragma unroll
    for (int q = 0; q < P; ++q) {
        if (first + q * step < n_items) K::load(w, first + q * step, buf[q]);
    }
}

// Whether kind K reads an item's activations once for several rows (K::dot_raw_rows).
template <class K, class = void> struct HasDotRows { static constexpr bool value = false; };
template <class K> struct HasDotRows<K, decltype((void) K::has_dot_rows)> { static constexpr bool value = K::has_dot_rows; };

// acc[r] += item i of row r (its raw loads buf[r][q]) . y, for the R rows: K::dot_raw_rows where
// the kind has it (the activations read once), else K::dot_raw a row at a time. Each row's
// product is dot_raw's float, added to acc[r] as the one-row loop adds it.
template <class K, int P, int R, class Y>
__device__ __forceinline__ void kind_dot_rows(typename K::raw (&buf)[R][P], const int q, const int i,
                                              const Y * __restrict__ y, float (&acc)[R]) {
    if constexpr (R > 1 && HasDotRows<K>::value) {
        const typename K::raw * rs[R];
#pragma unroll
        for (int r = 0; r < R; ++r) rs[r] = &buf[r][q];
        float v[R];
        K::template dot_raw_rows<R>(rs, i, y, v);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += v[r];
    } else {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += K::dot_raw(buf[r][q], i, y);
    }
}

// Rows w + r * rb (r < R) . x over the lane's items first, first + step, ... in that order,
// summed over the warp: warp_dot_rows<K, 1>'s terms and order for each row (the same floats).
// buf[r] holds row r's first P items (preload_items); each slot is refilled with the item P
// items on as soon as it is used. The rows read each item's activations together.
template <class K, int P, int R, class A>
__device__ __forceinline__ void preloaded_dot(const u8 * __restrict__ w, const i64 rb, const A * __restrict__ x,
                                              const int n_items, typename K::raw (&buf)[R][P], const int first,
                                              const int step, float (&acc)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int i0 = first; i0 < n_items; i0 += P * step) {
#pragma unroll
        for (int q = 0; q < P; ++q) {
            const int i = i0 + q * step;
            if (i < n_items) {
                /* every row's products first, then the refills: the rows' reads of the item's
                   activations in one basic block, where nvcc keeps one of each */
                kind_dot_rows<K, P, R>(buf, q, i, item_blocks(x + i), acc);
                if (i + P * step < n_items) {
#pragma unroll
                    for (int r = 0; r < R; ++r) K::load(w + r * rb, i + P * step, buf[r][q]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
}

template <class K>
__host__ __device__ __forceinline__ constexpr bool decode_preloads() {
    return Preloads<K>::depth > 0 && MV_ROWS == 1;
}

// Rows of a unit of matvec_<kind>'s launch (a warp's, or a split group's, at once): the
// backend's unit_rows for the kind's type.
template <class K>
__host__ __device__ __forceinline__ constexpr int unit_rows() {
    return decode_preloads<K>() ? MV_PRELOAD_ROWS : MV_ROWS;
}

// A lane's preloaded items (MV_PRELOAD) for kind K, MV_PRELOAD_ROWS rows; empty for the kinds
// without (Preloads<K>).
template <class K, bool = (Preloads<K>::depth > 0)> struct PreloadBuf { };
template <class K> struct PreloadBuf<K, true> { typename K::raw r[MV_PRELOAD_ROWS][Preloads<K>::depth]; };

template <class KA, class KB> union MixedPreloadBuf { PreloadBuf<KA> a; PreloadBuf<KB> b; };

// The first loads of unit u (rows u * R .. of its matrix; rows past the matrix's end read its
// last row again) into pb; u becomes the unit's index within its matrix. Weights only.
template <class K, int SPLIT>
__device__ __forceinline__ void preload_unit(const MatVecUnit & m, const int u, const int n_items,
                                             PreloadBuf<K> & pb) {
    constexpr int R = MV_PRELOAD_ROWS;
    const int first = threadIdx.x % WARP_SIZE + (threadIdx.x / WARP_SIZE % SPLIT) * WARP_SIZE;
#pragma unroll
    for (int r = 0; r < R; ++r)
        preload_items<K, Preloads<K>::depth>(m.w + (i64) min(u * R + r, m.n - 1) * m.rb, n_items, first,
                                             SPLIT * WARP_SIZE, pb.r[r]);
}

// decode_rows' first loads (MV_PRELOAD): the warp's first unit's items, into pb. Weights only,
// so the kernels call it before PDL_ENTRY: inside a decode graph those loads are in flight while
// the previous kernel ends. Nothing for other kinds.
template <class K, int SPLIT>
__device__ __forceinline__ void decode_preload(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                               const u8 * __restrict__ w2, const MultiMatVecParams & p,
                                               const int bx, PreloadBuf<K> & pb) {
    if constexpr (decode_preloads<K>()) {
        constexpr int UPB = MvBlockWarps<K, SPLIT>::value / SPLIT, R = MV_PRELOAD_ROWS;
        int u = bx * UPB + threadIdx.x / WARP_SIZE / SPLIT;
        if (u < (p.n_rows0 + R - 1) / R + (p.n_rows1 + R - 1) / R + (p.n_rows2 + R - 1) / R) {
            const MatVecUnit m = unit_matrix(u, R, w0, w1, w2, nullptr, nullptr, nullptr, p);
            preload_unit<K, SPLIT>(m, u, p.k / K::values_per_item, pb);
        }
    }
}

// decode_rows for MV_PRELOAD (units of MV_PRELOAD_ROWS rows a warp or split group): the warp's
// first unit's loads went out before PDL_ENTRY (pb: decode_preload, by the kernel); every row's
// result is decode_rows' (the same sums, blocks and order).
template <class K, int SPLIT>
__device__ __forceinline__ void decode_rows_preloaded(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                                      const u8 * __restrict__ w2, const typename K::act * __restrict__ x,
                                                      float * __restrict__ y0, float * __restrict__ y1,
                                                      float * __restrict__ y2, const MultiMatVecParams & p,
                                                      const int bx, const int gx, PreloadBuf<K> & pb) {
    constexpr int UPB = MvBlockWarps<K, SPLIT>::value / SPLIT, R = MV_PRELOAD_ROWS;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = warp / SPLIT, s = warp % SPLIT;
    const int units = (p.n_rows0 + R - 1) / R + (p.n_rows1 + R - 1) / R + (p.n_rows2 + R - 1) / R;
    const int t = blockIdx.y, n_items = p.k / K::values_per_item;
    const int first = lane + s * WARP_SIZE, step = SPLIT * WARP_SIZE;
    extern __shared__ int4 staged_x[];
    const void * xs = stage_act<K, MV_STAGE_MAX_K, (SPLIT > 1 ? MV_STAGE_BATCH_SPLIT : MV_STAGE_BATCH)>(
        x + (i64) t * n_items, 1, n_items, staged_x);
    __shared__ float mv_part[SPLIT > 1 ? MvBlockWarps<K, SPLIT>::value : 1][R];
    /* the block's groups loop together (ub is uniform), so split_sum's barriers are too */
    for (int ub = bx * UPB; ub < units; ub += gx * UPB) {
        int u = ub + g;
        const bool valid = u < units;
        const MatVecUnit m = unit_matrix(u, R, w0, w1, w2, y0, y1, y2, p);
        const int row = u * R;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        if (valid) {
            constexpr int P = Preloads<K>::depth;
            if (ub != bx * UPB) preload_unit<K, SPLIT>(m, u, n_items, pb);
            /* the unit's last rows past the matrix's end are its last row again (dropped) */
            const i64 rb = R > 1 && row + 1 >= m.n ? 0 : m.rb;
            const u8 * w = m.w + row * m.rb;
            if (xs != nullptr)
                preloaded_dot<K, P, R>(w, rb, (const typename Staged<K>::act *) xs, n_items, pb.r, first, step, acc);
            else
                preloaded_dot<K, P, R>(w, rb, x + (i64) t * n_items, n_items, pb.r, first, step, acc);
        }
        if constexpr (SPLIT > 1) split_sum<R, SPLIT>(acc, mv_part, warp, s, valid);
        if (valid && s == 0 && lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) if (row + r < m.n) y_row(m, t, row + r) = acc[r];
        }
    }
}

// matvec_<kind> (SPLIT 1) and matvec_split_<kind> (SPLIT = MV_SPLIT): one token's rows, after the
// kernel's prefetch and PDL_ENTRY (in the kernel itself, where the PDL lint reads them).
template <class K, int SPLIT>
__device__ __forceinline__ void decode_rows(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                            const u8 * __restrict__ w2, const typename K::act * __restrict__ x,
                                            float * __restrict__ y0, float * __restrict__ y1,
                                            float * __restrict__ y2, const MultiMatVecParams p,
                                            const int bx, const int gx, PreloadBuf<K> & pb) {
    /* bx, gx: this block's index among the launch's blocks that take these matrices, and     */
    /* their number (blockIdx.x, gridDim.x; matvec_mixed_ gives each kind its own range)       */
    constexpr int UPB = MvBlockWarps<K, SPLIT>::value / SPLIT;    /* units per block: a group of SPLIT warps each */
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = warp / SPLIT, s = warp % SPLIT;
    /* Each matrix takes whole warp groups: unit u covers rows u*MV_ROWS.. of its matrix. A     */
    /* grid smaller than the units makes each group loop over several (grid-stride).           */
    const int u0 = (p.n_rows0 + MV_ROWS - 1) / MV_ROWS, u1 = (p.n_rows1 + MV_ROWS - 1) / MV_ROWS;
    const int u2 = (p.n_rows2 + MV_ROWS - 1) / MV_ROWS;
    if constexpr (decode_preloads<K>()) {
        decode_rows_preloaded<K, SPLIT>(w0, w1, w2, x, y0, y1, y2, p, bx, gx, pb);
        return;
    }
    const int t = blockIdx.y, n_items = p.k / K::values_per_item;
    extern __shared__ int4 staged_x[];
    const void * xs = stage_act<K, MV_STAGE_MAX_K, (SPLIT > 1 ? MV_STAGE_BATCH_SPLIT : MV_STAGE_BATCH)>(
        x + (i64) t * n_items, 1, n_items, staged_x);
    __shared__ float mv_part[SPLIT > 1 ? MvBlockWarps<K, SPLIT>::value : 1][MV_ROWS];
    if constexpr (SPLIT == 1) {
        for (int uu = bx * MV_WARPS + warp; uu < u0 + u1 + u2; uu += gx * MV_WARPS) {
            int u = uu;
            const MatVecUnit m = unit_matrix(u, MV_ROWS, w0, w1, w2, y0, y1, y2, p);
            const int row = u * MV_ROWS;
            float acc[MV_ROWS];
            rows_dot<K, MV_ROWS>(m.w + row * m.rb, m.rb, m.n - row, x + (i64) t * n_items, xs, n_items, acc);
            if (lane == 0) {
                _Pragma("unroll")
                for (int r = 0; r < MV_ROWS; ++r) if (row + r < m.n) y_row(m, t, row + r) = acc[r];
            }
        }
        return;
    }
    /* split: the block's groups loop together (ub is uniform), so the barriers are too */
    for (int ub = bx * UPB; ub < u0 + u1 + u2; ub += gx * UPB) {
        int u = ub + g;
        const bool valid = u < u0 + u1 + u2;
        const MatVecUnit m = unit_matrix(u, MV_ROWS, w0, w1, w2, y0, y1, y2, p);
        const int row = u * MV_ROWS;
        float acc[MV_ROWS];
        if (valid) rows_dot<K, MV_ROWS>(m.w + row * m.rb, m.rb, m.n - row, x + (i64) t * n_items, xs,
                                        n_items, acc, lane + s * WARP_SIZE, SPLIT * WARP_SIZE);
        split_sum<MV_ROWS, SPLIT>(acc, mv_part, warp, s, valid);
        if (valid && s == 0 && lane == 0) {
            _Pragma("unroll")
            for (int r = 0; r < MV_ROWS; ++r) if (row + r < m.n) y_row(m, t, row + r) = acc[r];
        }
    }
}

// matvec_coop_<kind> (MV_COOP_WARPS): a lane's words of one chunk of a row, l + 32 k for lane l.
template <class K>
struct CoopChunk {
    static constexpr int loads = (K::chunk_words + WARP_SIZE - 1) / WARP_SIZE;
    u64 w[loads];
};

// The chunks a warp has in flight, one per row it takes at once (MV_COOP_ROWS).
template <class K>
struct CoopNext { CoopChunk<K> r[MV_COOP_ROWS]; };

// Chunk c of row w (8-byte aligned, whole chunks) into r: lane l the words l + 32 k.
template <class K>
__device__ __forceinline__ void coop_chunk_load(const u8 * __restrict__ w, const int c, CoopChunk<K> & r) {
    const u64 * src = (const u64 *) w + (i64) c * K::chunk_words;
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int k = 0; k < CoopChunk<K>::loads; ++k)
        if (lane + WARP_SIZE * k < K::chunk_words) r.w[k] = src[lane + WARP_SIZE * k];
}

// The warp's first row's first chunk into r. Weights only, so the kernel calls it before
// PDL_ENTRY: those loads in flight while the previous kernel ends.
template <class K>
__device__ __forceinline__ void coop_preload(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                             const u8 * __restrict__ w2, const MultiMatVecParams & p,
                                             CoopNext<K> & next) {
    if constexpr (MV_COOP_ROWS == 1) {
        int row = blockIdx.x * MV_COOP_WARPS + threadIdx.x / WARP_SIZE;
        if (row < p.n_rows0 + p.n_rows1 + p.n_rows2) {
            const MatVecUnit m = unit_matrix(row, 1, w0, w1, w2, nullptr, nullptr, nullptr, p);
            coop_chunk_load<K>(m.w + row * m.rb, 0, next.r[0]);
        }
    } else {
        const int first = blockIdx.x * MV_COOP_WARPS + threadIdx.x / WARP_SIZE;
#pragma unroll
        for (int j = 0; j < MV_COOP_ROWS; ++j) {
            int row = first + j * gridDim.x * MV_COOP_WARPS;
            if (row < p.n_rows0 + p.n_rows1 + p.n_rows2) {
                const MatVecUnit m = unit_matrix(row, 1, w0, w1, w2, nullptr, nullptr, nullptr, p);
                coop_chunk_load<K>(m.w + row * m.rb, 0, next.r[j]);
            }
        }
    }
}

// matvec_coop_<kind>'s rows against activations xa (A: staged items, or Q8_1 blocks past
// MV_STAGE_MAX_K). A loop for each, as rows_dot picks a warp_dot_rows for each, not a branch
// inside one loop: with the branch, nvcc 13.0 added each item's product to acc apart (mul, then
// add) where matvec_q6_k fuses them (fma), which rounds otherwise. Warp w of block b takes the
// rows b * MV_COOP_WARPS + w, stepping gridDim.x * MV_COOP_WARPS (matrices 0, 1, 2 one after
// another: matvec_<kind>'s units of one row). Chunk c holds items 32 c .. 32 c + 31 of the row
// and lane l takes item 32 c + l, as warp_dot_rows' lane does in its c-th step; K::load finds it
// at index l of the chunk's copy in buf (a chunk is whole blocks of the kind, and an item's place
// in its block is the same for l and 32 c + l). next: the first row's first chunk (coop_preload).
template <class K, class A>
__device__ __forceinline__ void coop_rows(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                          const u8 * __restrict__ w2, const A * __restrict__ xa,
                                          float * __restrict__ y0, float * __restrict__ y1,
                                          float * __restrict__ y2, const MultiMatVecParams & p,
                                          u64 * __restrict__ buf, CoopChunk<K> & next) {
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int units = p.n_rows0 + p.n_rows1 + p.n_rows2;
    const int t = blockIdx.y, n_chunks = p.k / K::values_per_item / WARP_SIZE;
    const int step = gridDim.x * MV_COOP_WARPS;
    for (int row = blockIdx.x * MV_COOP_WARPS + warp; row < units; row += step) {
        int u = row;
        const MatVecUnit m = unit_matrix(u, 1, w0, w1, w2, y0, y1, y2, p);
        const u8 * w = m.w + u * m.rb;
        float acc = 0.0f;
        for (int c = 0; c < n_chunks; ++c) {
            __syncwarp();           /* every lane is done with the previous chunk's copy */
#pragma unroll
            for (int k = 0; k < CoopChunk<K>::loads; ++k)
                if (lane + WARP_SIZE * k < K::chunk_words) buf[lane + WARP_SIZE * k] = next.w[k];
            __syncwarp();           /* ... and sees all of this one */
            if (c + 1 < n_chunks) coop_chunk_load<K>(w, c + 1, next);
            else if (row + step < units) {          /* the warp's next row's first */
                int un = row + step;
                const MatVecUnit mn = unit_matrix(un, 1, w0, w1, w2, y0, y1, y2, p);
                coop_chunk_load<K>(mn.w + un * mn.rb, 0, next);
            }
            const int i = c * WARP_SIZE + lane;
            typename K::raw r;
            K::load((const u8 *) buf, lane, r);
            acc += K::dot_raw(r, i, item_blocks(xa + i));
        }
        acc = warp_sum(acc);
        if (lane == 0) y_row(m, t, u) = acc;
    }
}

// MV_COOP_ROWS > 1: coop_rows with rows row0 + j * step (j < MV_COOP_ROWS) at once, each
// row's chunk c in buf side by side, every row's items, lanes and order as coop_rows'. Apart
// from coop_rows, not its generalization: this loop at one row compiled to another cubin than
// coop_rows does, and the default build is to stay the machine code the GPU suite passed on.
template <class K, class A>
__device__ __forceinline__ void coop_rows_multi(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                                const u8 * __restrict__ w2, const A * __restrict__ xa,
                                                float * __restrict__ y0, float * __restrict__ y1,
                                                float * __restrict__ y2, const MultiMatVecParams & p,
                                                u64 * __restrict__ buf, CoopNext<K> & next) {
    constexpr int R = MV_COOP_ROWS;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int units = p.n_rows0 + p.n_rows1 + p.n_rows2;
    const int t = blockIdx.y, n_chunks = p.k / K::values_per_item / WARP_SIZE;
    const int step = gridDim.x * MV_COOP_WARPS;
    /* rows row0 + j * step (j < R) at once; buf holds their chunks side by side */
    for (int row0 = blockIdx.x * MV_COOP_WARPS + warp; row0 < units; row0 += R * step) {
        MatVecUnit m[R];
        int u[R];
        float acc[R];
#pragma unroll
        for (int j = 0; j < R; ++j) {
            u[j] = row0 + j * step;
            if (u[j] < units) m[j] = unit_matrix(u[j], 1, w0, w1, w2, y0, y1, y2, p);
            acc[j] = 0.0f;
        }
        for (int c = 0; c < n_chunks; ++c) {
            __syncwarp();           /* every lane is done with the previous chunks' copies */
#pragma unroll
            for (int j = 0; j < R; ++j)
#pragma unroll
                for (int k = 0; k < CoopChunk<K>::loads; ++k)
                    if (row0 + j * step < units && lane + WARP_SIZE * k < K::chunk_words)
                        buf[j * K::chunk_words + lane + WARP_SIZE * k] = next.r[j].w[k];
            __syncwarp();           /* ... and sees all of these */
#pragma unroll
            for (int j = 0; j < R; ++j) {
                if (row0 + j * step >= units) continue;
                if (c + 1 < n_chunks) coop_chunk_load<K>(m[j].w + u[j] * m[j].rb, c + 1, next.r[j]);
                else if (row0 + (R + j) * step < units) {       /* the row R steps on: its first */
                    int un = row0 + (R + j) * step;
                    const MatVecUnit mn = unit_matrix(un, 1, w0, w1, w2, y0, y1, y2, p);
                    coop_chunk_load<K>(mn.w + un * mn.rb, 0, next.r[j]);
                }
            }
            const int i = c * WARP_SIZE + lane;
#pragma unroll
            for (int j = 0; j < R; ++j) {
                if (row0 + j * step >= units) continue;
                typename K::raw r;
                K::load((const u8 *) (buf + j * K::chunk_words), lane, r);
                acc[j] += K::dot_raw(r, i, item_blocks(xa + i));
            }
        }
#pragma unroll
        for (int j = 0; j < R; ++j) {
            if (row0 + j * step >= units) continue;
            acc[j] = warp_sum(acc[j]);
            if (lane == 0) y_row(m[j], t, u[j]) = acc[j];
        }
    }
}

// matvec_coop_<kind> after PDL_ENTRY: the token's activations staged (every thread of the
// block, once), then the warp's rows.
template <class K>
__device__ __forceinline__ void decode_rows_coop(const u8 * __restrict__ w0, const u8 * __restrict__ w1,
                                                 const u8 * __restrict__ w2, const typename K::act * __restrict__ x,
                                                 float * __restrict__ y0, float * __restrict__ y1,
                                                 float * __restrict__ y2, const MultiMatVecParams & p,
                                                 CoopNext<K> & next) {
    const int n_items = p.k / K::values_per_item;
    const typename K::act * xt = x + (i64) blockIdx.y * n_items;
    extern __shared__ int4 staged_x[];
    const void * xs = stage_act<K>(xt, 1, n_items, staged_x);
    __shared__ u64 coop_buf[MV_COOP_WARPS][MV_COOP_ROWS * K::chunk_words];
    u64 * buf = coop_buf[threadIdx.x / WARP_SIZE];
    if constexpr (MV_COOP_ROWS == 1) {
        if (xs != nullptr) coop_rows<K>(w0, w1, w2, (const typename Staged<K>::act *) xs, y0, y1, y2, p, buf, next.r[0]);
        else coop_rows<K>(w0, w1, w2, xt, y0, y1, y2, p, buf, next.r[0]);
    } else {
        if (xs != nullptr) coop_rows_multi<K>(w0, w1, w2, (const typename Staged<K>::act *) xs, y0, y1, y2, p, buf, next);
        else coop_rows_multi<K>(w0, w1, w2, xt, y0, y1, y2, p, buf, next);
    }
}

// matvec_mixed_<a>_<b>: a decode step's q, k (kind KA: matrices 0 and 1) and v (kind KB: matrix
// 2) in one launch, where the recipe gives v another type (Q4_K_M: q, k Q4_K, v Q6_K) and two
// launches would otherwise be needed. The first ceil(units of 0 and 1 / MV_WARPS) blocks run
// matvec_<a>'s body over matrices 0 and 1, the rest matvec_<b>'s over matrix 2, each with its
// own staged activations: every row the very bits of the two launches (one launch boundary
// fewer a layer; the backend takes it for one token, rows of K < MV_SPLIT_MIN_K).
#define DEFINE_MATVEC_MIXED(name, KA, KB)                                                          \
extern "C" __global__ void __launch_bounds__(MV_WARPS * WARP_SIZE)                                 \
matvec_mixed_##name(const u8 * __restrict__ w0, const u8 * __restrict__ w1, const u8 * __restrict__ w2, \
    const KA::act * __restrict__ x, float * __restrict__ y0, float * __restrict__ y1,              \
    float * __restrict__ y2, const MultiMatVecParams p) {                                          \
    constexpr int ra = unit_rows<KA>();  /* the backend's mixed_blocks */                          \
    const int blocks_a = ((p.n_rows0 + ra - 1) / ra + (p.n_rows1 + ra - 1) / ra + MV_WARPS - 1) / MV_WARPS; \
    const bool a = (int) blockIdx.x < blocks_a;                                                    \
    const int bx = a ? (int) blockIdx.x : (int) blockIdx.x - blocks_a;                             \
    const int gx = a ? blocks_a : (int) gridDim.x - blocks_a;                                      \
    MultiMatVecParams q = p;            /* the matrices this block's kind takes, as its launch */  \
    q.n_rows2 = 0;                                                                                 \
    if (!a) {                                                                                      \
        q.n_rows0 = p.n_rows2;                                                                     \
        q.row_bytes0 = p.row_bytes2;                                                               \
        q.n_rows1 = 0;                                                                             \
    }                                                                                              \
    MixedPreloadBuf<KA, KB> pre;        /* a block takes one kind: one buffer's registers */      \
    prefetch_unit(a ? w0 : w2, a ? w1 : w2, a ? w1 : w2, q, bx * MV_WARPS + threadIdx.x / WARP_SIZE, \
                  a ? unit_rows<KA>() : unit_rows<KB>());                                    \
    if (a) decode_preload<KA, 1>(w0, w1, w1, q, bx, pre.a);                                        \
    else decode_preload<KB, 1>(w2, w2, w2, q, bx, pre.b);                                          \
    PDL_ENTRY();                                                                                   \
    if (a) decode_rows<KA, 1>(w0, w1, w1, x, y0, y1, y1, q, bx, gx, pre.a);                        \
    else decode_rows<KB, 1>(w2, w2, w2, (const KB::act *) x, y2, y2, y2, q, bx, gx, pre.b);        \
}

// matvec_coop_<kind> (MV_COOP_WARPS): matvec_<kind>'s launch and bits for one token, for kinds with
// K::load / K::dot_raw and K::chunk_words (32 items' bytes in whole blocks, whole 8-byte words)
// and rows of whole chunks.
#define DEFINE_MATVEC_COOP(name, K)                                                                \
extern "C" __global__ void __launch_bounds__(MV_COOP_WARPS * WARP_SIZE)                            \
matvec_coop_##name(const u8 * __restrict__ w0, const u8 * __restrict__ w1, const u8 * __restrict__ w2, \
    const K::act * __restrict__ x, float * __restrict__ y0, float * __restrict__ y1,               \
    float * __restrict__ y2, const MultiMatVecParams p) {                                          \
    CoopNext<K> next;                                                                              \
    prefetch_unit(w0, w1, w2, p, blockIdx.x * MV_COOP_WARPS + threadIdx.x / WARP_SIZE, 1);         \
    coop_preload<K>(w0, w1, w2, p, next);                                                          \
    PDL_ENTRY();                                                                                   \
    decode_rows_coop<K>(w0, w1, w2, x, y0, y1, y2, p, next);                                       \
}
