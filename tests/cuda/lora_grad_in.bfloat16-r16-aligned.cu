// lora_grad_in: dA = dh^T dropout(x) and the LoRA part of grad_x, (dh A) * keep / (1 - p), in one
// pass over x with the dropout mask regenerated.
// Rendered by loragen.cuda.render for bfloat16:
// scalar_t=bf16_t, rank_bucket=16, aligned=true, warps=4, min_blocks=3, rank_tile=4, rows_per_step=4.
//
// dh already carries the LoRA scaling. A block owns 256 columns (each lane 8 consecutive ones: one
// 16-byte load of x per row for 16-bit x, at every rank) and one tile of RANK_TILE ranks; its warps
// walk a split of the rows in turn, ROWS_PER_STEP rows per step, and all the rows' loads of a step are
// issued before the first is used. dA for the lane's columns and tile stays in registers for the whole
// split; the warps' sums are added in shared memory at the end, in a fixed order. grad_x needs every
// rank: the rank tiles of a column block (neighbours in blockIdx.x, so x comes from L2 after the first)
// take turns, tile t writing grad_x for the steps s with s % RANK_TILES == t, streaming A at its columns
// for all ranks -- the same 256 columns for the block's warps, so A is read from L1 after the first.
// The base GEMM accumulates onto grad_x_lora afterwards (cuBLAS, beta = 1).
//
// A arrives padded to RANK_BUCKET rows (rows past the rank are zero): no load depends on the rank.
// Rows past the end are read clamped to the split's last row and zeroed: no load sits under a branch.
#include "lora_common.cuh"

using namespace loragen;

typedef bf16_t scalar_t;
constexpr int RANK_BUCKET = 16;  // R: columns of dh, rows of dA and of (padded) A
constexpr int RANK_TILE = 4;  // blockIdx.x = column block * RANK_TILES + tile
constexpr int RANK_TILES = RANK_BUCKET / RANK_TILE;
constexpr int WARPS = 4;
constexpr int ROWS_PER_STEP = 4;
constexpr bool ALIGNED = true;  // cols % 8 == 0, x, A and grad_x_lora 16-byte aligned
constexpr int THREADS = WARPS * 32;
constexpr int MIN_BLOCKS = 3;  // blocks per multiprocessor the register budget must allow
constexpr int CHUNK = 8;  // columns per thread: one Philox call per row
constexpr int BLOCK_COLS = 32 * CHUNK;  // the warps share the columns and split the rows

// x (rows, cols); dh (rows, R) and lora_a (R, cols, rows >= rank zero) float32; grad_x_lora (rows,
// cols) or null. For the columns of column block c and the rows of split s = blockIdx.y it writes
//   grad_x_lora[n][k] = keep(n, k) * keep_scale * sum_j dh[n][j] * A[j][k]
//   da_part[s][j][k]  = keep_scale * sum over n of dh[n][j] * keep(n, k) * x[n][k]
// with da_part (splits, R, cols) float32. `rank` is not read.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) lora_grad_in(
    const scalar_t* __restrict__ x, const float* __restrict__ dh, const float* __restrict__ lora_a,
    scalar_t* __restrict__ grad_x_lora, float* __restrict__ da_part,
    int rows, int cols, int rank, int rows_per_split,
    const u64* __restrict__ rng, unsigned threshold, float keep_scale)
{
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int tile = blockIdx.x % RANK_TILES;
    const int col_lane = blockIdx.x / RANK_TILES * BLOCK_COLS + lane * CHUNK;
    const bool col_ok = col_lane < cols;  // lanes past the end stay for the final barrier
    const int col = col_ok ? col_lane : (cols - 1) / CHUNK * CHUNK;  // the last chunk, read and never stored
    const int count = min(CHUNK, cols - col);  // this thread's columns inside x
    const int row_begin = blockIdx.y * rows_per_split;
    const int row_end = min(rows, row_begin + rows_per_split);
    const Dropout drop = make_dropout(rng, threshold, keep_scale);
    const unsigned all_kept = (1u << CHUNK) - 1u;

    float da[RANK_TILE][CHUNK] = {};
    for (int row0 = row_begin + warp * ROWS_PER_STEP; row0 < row_end; row0 += WARPS * ROWS_PER_STEP) {
        // 1. every load of the step: x and this tile's dh for ROWS_PER_STEP rows
        int row_at[ROWS_PER_STEP];
        float xv[ROWS_PER_STEP][CHUNK];
        float dhv[ROWS_PER_STEP][RANK_TILE];  // the same for the warp
#pragma unroll
        for (int m = 0; m < ROWS_PER_STEP; ++m) {
            row_at[m] = min(row0 + m, row_end - 1);
            load_span<CHUNK, ALIGNED>(x + static_cast<u64>(row_at[m]) * cols + col, count, xv[m]);
#pragma unroll
            for (int t = 0; t < RANK_TILE; t += 4) {
                load_vec<4>(dh + static_cast<u64>(row_at[m]) * RANK_BUCKET + tile * RANK_TILE + t, dhv[m] + t);
            }
        }
        // 2. the mask (zero for rows past the end), then dA
        unsigned keep[ROWS_PER_STEP];
#pragma unroll
        for (int m = 0; m < ROWS_PER_STEP; ++m) {
            keep[m] = col_ok && row0 + m < row_end ? all_kept : 0u;
            if (threshold != 0) {  // the same for the whole grid
                const u64 first = static_cast<u64>(row_at[m]) * cols + col;
                keep[m] &= ALIGNED ? keep_bits8(drop, first >> 3) : keep_bits_span(drop, first, count);
            }
#pragma unroll
            for (int e = 0; e < CHUNK; ++e) xv[m][e] = (keep[m] >> e) & 1u ? xv[m][e] : 0.0f;
#pragma unroll
            for (int j = 0; j < RANK_TILE; ++j) {
#pragma unroll
                for (int e = 0; e < CHUNK; ++e) da[j][e] += dhv[m][j] * xv[m][e];
            }
        }
        // 3. grad_x, every rank, on this tile's turn (the same for the whole block)
        if (grad_x_lora != nullptr && (row0 / ROWS_PER_STEP) % RANK_TILES == tile) {
            float gx[ROWS_PER_STEP][CHUNK] = {};
#pragma unroll 2  // a rank loop: A and dh come from L1, two rank steps' loads in flight
            for (int j0 = 0; j0 < RANK_BUCKET; j0 += 4) {
                float d4[ROWS_PER_STEP][4];
                float a[4][CHUNK];
#pragma unroll
                for (int m = 0; m < ROWS_PER_STEP; ++m) {
                    load_vec<4>(dh + static_cast<u64>(row_at[m]) * RANK_BUCKET + j0, d4[m]);
                }
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    load_span<CHUNK, ALIGNED>(lora_a + static_cast<u64>(j0 + t) * cols + col, count, a[t]);
                }
#pragma unroll
                for (int t = 0; t < 4; ++t) {
#pragma unroll
                    for (int m = 0; m < ROWS_PER_STEP; ++m) {
#pragma unroll
                        for (int e = 0; e < CHUNK; ++e) gx[m][e] += d4[m][t] * a[t][e];
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < ROWS_PER_STEP; ++m) {
#pragma unroll
                for (int e = 0; e < CHUNK; ++e) gx[m][e] = (keep[m] >> e) & 1u ? gx[m][e] * keep_scale : 0.0f;
                if (col_ok && row0 + m < row_end) {
                    store_guarded<CHUNK, ALIGNED>(grad_x_lora + static_cast<u64>(row0 + m) * cols + col, count, gx[m]);
                }
            }
        }
    }

    // the warps' dA sums, added by warp 0 in a fixed order (deterministic)
    __shared__ float warp_da[WARPS - 1][RANK_TILE][BLOCK_COLS];
    if (warp > 0) {
#pragma unroll
        for (int j = 0; j < RANK_TILE; ++j) {
#pragma unroll
            for (int e = 0; e < CHUNK; ++e) warp_da[warp - 1][j][lane * CHUNK + e] = da[j][e];
        }
    }
    __syncthreads();
    if (warp > 0 || !col_ok) return;
#pragma unroll
    for (int j = 0; j < RANK_TILE; ++j) {
        float v[CHUNK];
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) {
            float sum = da[j][e];
#pragma unroll
            for (int w = 0; w < WARPS - 1; ++w) sum += warp_da[w][j][lane * CHUNK + e];
            v[e] = keep_scale * sum;
        }
        store_guarded<CHUNK, ALIGNED>(da_part + (static_cast<u64>(blockIdx.y) * RANK_BUCKET + tile * RANK_TILE + j) * cols + col,
                                      count, v);
    }
}
