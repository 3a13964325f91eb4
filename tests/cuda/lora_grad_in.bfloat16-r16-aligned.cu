// lora_grad_in: dA = dh^T dropout(x) and the LoRA part of grad_x, (dh A) * keep / (1 - p), in one
// pass over x with the dropout mask regenerated.
// Rendered by loragen.cuda.render for bfloat16:
// scalar_t=bf16_t, rank_bucket=16, aligned=true, warps=4, min_blocks=2, cols_per_lane=4.
//
// dh already carries the LoRA scaling. Each thread owns COLS_PER_LANE consecutive columns for the
// whole split of rows it walks: A at those columns and the dA sums stay in registers. A Philox call
// covers 8 columns, i.e. SHARE = 8 / COLS_PER_LANE neighbouring lanes, so over a step of SHARE rows
// each lane computes one call (its row is the step's row lane % SHARE) and the lanes swap the bits.
// The base GEMM accumulates onto grad_x_lora afterwards (cuBLAS, beta = 1).
#include "lora_common.cuh"

using namespace loragen;

typedef bf16_t scalar_t;
constexpr int RANK_BUCKET = 16;  // R: columns of dh, rows of dA
constexpr int WARPS = 4;
constexpr int COLS_PER_LANE = 4;  // 1, 2, 4 or 8
constexpr bool ALIGNED = true;  // cols % 8 == 0, x, A and grad_x_lora 16-byte aligned
constexpr int THREADS = WARPS * 32;
constexpr int MIN_BLOCKS = 2;  // blocks per multiprocessor the register budget must allow
constexpr int BLOCK_COLS = THREADS * COLS_PER_LANE;
constexpr int SHARE = 8 / COLS_PER_LANE;  // lanes per Philox call, rows per step
constexpr unsigned LANE_BITS = (1u << COLS_PER_LANE) - 1u;

// x (rows, cols); dh (rows, R) and lora_a (rank, cols) float32; grad_x_lora (rows, cols) or null.
// For the columns of block blockIdx.x and the rows of split s = blockIdx.y it writes
//   grad_x_lora[n][k] = keep(n, k) * keep_scale * sum_j dh[n][j] * A[j][k]
//   da_part[s][j][k]  = keep_scale * sum over n of dh[n][j] * keep(n, k) * x[n][k]
// with da_part (splits, R, cols) float32.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) lora_grad_in(
    const scalar_t* __restrict__ x, const float* __restrict__ dh, const float* __restrict__ lora_a,
    scalar_t* __restrict__ grad_x_lora, float* __restrict__ da_part,
    int rows, int cols, int rank, int rows_per_split,
    u64 seed, u64 offset, unsigned threshold, float keep_scale)
{
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * BLOCK_COLS + threadIdx.x * COLS_PER_LANE;
    const int count = max(0, min(COLS_PER_LANE, cols - col));  // this thread's columns inside x
    const int row_begin = blockIdx.y * rows_per_split;
    const int row_end = min(rows, row_begin + rows_per_split);
    const Dropout drop{seed, offset, threshold, keep_scale};
    const int share_lane = lane % SHARE;

    float a[RANK_BUCKET][COLS_PER_LANE];  // A at this thread's columns, zero past rank
#pragma unroll
    for (int j = 0; j < RANK_BUCKET; ++j) {
        load_guarded<COLS_PER_LANE, ALIGNED>(lora_a + static_cast<u64>(j) * cols + col, j < rank ? count : 0, a[j]);
    }
    float da[RANK_BUCKET][COLS_PER_LANE] = {};

    for (int row0 = row_begin; row0 < row_end; row0 += SHARE) {
        unsigned step_bits = 0xFFu;
        if (ALIGNED && threshold != 0) {
            // the Philox call of row row0 + share_lane for the 8 columns starting at this lane group
            const u64 first = static_cast<u64>(row0 + share_lane) * cols + (col - share_lane * COLS_PER_LANE);
            step_bits = keep_bits8(drop, first >> 3);
        }
#pragma unroll 1
        for (int s = 0; s < SHARE; ++s) {  // a run-time loop: no register array is indexed by s
            const int row = row0 + s;
            unsigned keep = LANE_BITS;
            if (threshold != 0) {
                if (ALIGNED) {  // every lane takes part in the shuffle, whatever its row and columns
                    const unsigned bits = __shfl_sync(0xffffffffu, step_bits, lane - share_lane + s);
                    keep = (bits >> (share_lane * COLS_PER_LANE)) & LANE_BITS;
                } else if (row < row_end && count > 0) {
                    keep = keep_bits_span(drop, static_cast<u64>(row) * cols + col, count);
                }
            }
            if (row >= row_end) continue;

            float xv[COLS_PER_LANE];
            load_guarded<COLS_PER_LANE, ALIGNED>(x + static_cast<u64>(row) * cols + col, count, xv);
            float dhv[RANK_BUCKET];  // the same for the warp
#pragma unroll
            for (int j0 = 0; j0 < RANK_BUCKET; j0 += 4) {
                load_vec<4>(dh + static_cast<u64>(row) * RANK_BUCKET + j0, dhv + j0);
            }

            float gx[COLS_PER_LANE] = {};
#pragma unroll
            for (int j = 0; j < RANK_BUCKET; ++j) {
#pragma unroll
                for (int e = 0; e < COLS_PER_LANE; ++e) gx[e] += dhv[j] * a[j][e];
            }
#pragma unroll
            for (int e = 0; e < COLS_PER_LANE; ++e) {
                const bool kept = (keep >> e) & 1u;
                xv[e] = kept ? xv[e] : 0.0f;
                gx[e] = kept ? gx[e] * keep_scale : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < RANK_BUCKET; ++j) {
#pragma unroll
                for (int e = 0; e < COLS_PER_LANE; ++e) da[j][e] += dhv[j] * xv[e];
            }
            if (grad_x_lora != nullptr) {
                store_guarded<COLS_PER_LANE, ALIGNED>(grad_x_lora + static_cast<u64>(row) * cols + col, count, gx);
            }
        }
    }

#pragma unroll
    for (int j = 0; j < RANK_BUCKET; ++j) {
        float v[COLS_PER_LANE];
#pragma unroll
        for (int e = 0; e < COLS_PER_LANE; ++e) v[e] = keep_scale * da[j][e];
        store_guarded<COLS_PER_LANE, ALIGNED>(da_part + (static_cast<u64>(blockIdx.y) * RANK_BUCKET + j) * cols + col,
                                              count, v);
    }
}
