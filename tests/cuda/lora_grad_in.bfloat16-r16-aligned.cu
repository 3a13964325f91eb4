// lora_grad_in: dA = dh^T dropout(x) and the LoRA part of grad_x, (dh A) * keep / (1 - p), in one
// pass over x with the dropout mask regenerated.
// Rendered by loragen.cuda.build for bfloat16:
// scalar_t=bf16_t, rank_bucket=16, aligned=true, warps=4, min_blocks=3, mma=true, rank_tile=16, rows_per_step=64.
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
//
// With MMA (bf16, aligned, R >= 16) both products run on tensor cores and a block owns 32 columns and
// every rank (RANK_TILE == R: x is read once). Its warps take turns over the split's rows, ROWS_PER_STEP
// = 16 * M_TILES at a time; per 16-row tile each lane loads 16 bytes of x for rows g and g + 8 at columns
// 8t .. 8t+7 (lane = 4g + t) and dh for the same rows at ranks 4t .. 4t+3 of each 16-rank tile, all the
// step's loads before the first use. The sum over ranks of grad_x = dh A maps k slots 2t, 2t+1, 2t+8,
// 2t+9 to ranks 4t .. 4t+3 (one 16-byte load of dh per row and tile) and n slot g of 8-column tile w to
// column 8 (g / 2) + 2w + g % 2, so the results of row g land at the lane's own columns 8t .. 8t+7:
// the mask bits of its x load apply to them and the store is one 16-byte access. A's fragments are
// loaded once per block and stay in registers. dA^T = dh^T drop(x) sums over rows: its A operand is
// grad_x's dh fragments transposed by movmatrix (transpose8x8), so m slot g (g + 8) is rank
// 4 (g / 2) + g % 2 (+ 2), and its B operand is the masked x with rows in the k slots, transposed from
// the lane's row registers as in lora_grad_out. x is bf16 already; dh is split into two bf16 terms
// (hi = bf16(dh), lo = bf16(dh - hi): dh to about 2^-17), A is rounded to bf16 once; products and sums
// are float32. The warps' dA sums are added in shared memory at the end, in a fixed order.
#include "lora_common.cuh"

using namespace loragen;

typedef bf16_t scalar_t;
constexpr int RANK_BUCKET = 16;  // R: columns of dh, rows of dA and of (padded) A
constexpr int RANK_TILE = 16;  // blockIdx.x = column block * RANK_TILES + tile
constexpr int RANK_TILES = RANK_BUCKET / RANK_TILE;
constexpr int WARPS = 4;
constexpr int ROWS_PER_STEP = 64;  // rows per warp and step (16 * M_TILES with MMA)
constexpr bool MMA = true;  // tensor cores (bf16, ALIGNED only): RANK_TILE == RANK_BUCKET
constexpr bool ALIGNED = true;  // cols % 8 == 0, x, A and grad_x_lora 16-byte aligned
constexpr int THREADS = WARPS * 32;
constexpr int MIN_BLOCKS = 3;  // blocks per multiprocessor the register budget must allow
constexpr int CHUNK = 8;  // columns per thread: one Philox call per row
constexpr int BLOCK_COLS = MMA ? 32 : 32 * CHUNK;  // the warps share the columns and split the rows
constexpr int WARP_DA = RANK_TILE * BLOCK_COLS;  // dA sums per warp and block

// The CUDA-core pass (every dtype and alignment); the passes are templates so that only the one the
// kernel uses is instantiated.
template <bool USED>
__device__ __forceinline__ void grad_in_fma(
    const scalar_t* __restrict__ x, const float* __restrict__ dh, const float* __restrict__ lora_a,
    scalar_t* __restrict__ grad_x_lora, float* __restrict__ da_part, int rows, int cols, int rows_per_split,
    const Dropout& drop, float (*warp_da)[WARP_DA])
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
            if (drop.threshold != 0) {  // the same for the whole grid
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
                for (int e = 0; e < CHUNK; ++e) gx[m][e] = (keep[m] >> e) & 1u ? gx[m][e] * drop.keep_scale : 0.0f;
                if (col_ok && row0 + m < row_end) {
                    store_guarded<CHUNK, ALIGNED>(grad_x_lora + static_cast<u64>(row0 + m) * cols + col, count, gx[m]);
                }
            }
        }
    }

    // the warps' dA sums, added by warp 0 in a fixed order (deterministic)
    if (warp > 0) {
#pragma unroll
        for (int j = 0; j < RANK_TILE; ++j) {
#pragma unroll
            for (int e = 0; e < CHUNK; ++e) warp_da[warp - 1][j * BLOCK_COLS + lane * CHUNK + e] = da[j][e];
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
            for (int w = 0; w < WARPS - 1; ++w) sum += warp_da[w][j * BLOCK_COLS + lane * CHUNK + e];
            v[e] = drop.keep_scale * sum;
        }
        store_guarded<CHUNK, ALIGNED>(da_part + (static_cast<u64>(blockIdx.y) * RANK_BUCKET + tile * RANK_TILE + j) * cols + col,
                                      count, v);
    }
}

// The tensor-core pass (see the header comment): bf16, ALIGNED, RANK_TILE == RANK_BUCKET.
template <bool USED>
__device__ __forceinline__ void grad_in_mma(
    const scalar_t* __restrict__ x, const float* __restrict__ dh, const float* __restrict__ lora_a,
    scalar_t* __restrict__ grad_x_lora, float* __restrict__ da_part, int rows, int cols, int rows_per_split,
    const Dropout& drop, float (*warp_da)[WARP_DA])
{
    constexpr int K_TILES = RANK_BUCKET / 16;    // 16-rank tiles: k tiles of grad_x, m tiles of dA^T
    constexpr int M_TILES = ROWS_PER_STEP / 16;  // 16-row tiles per warp and step
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int col_lane = blockIdx.x * BLOCK_COLS + 8 * t;  // the lane's 8 columns of x, grad_x and dA
    const bool col_ok = col_lane < cols;  // lanes past the end stay for the warp's mma and the barrier
    const int col = min(col_lane, cols - 8);  // read clamped to the last 8 columns, zeroed past the end
    const int row_begin = blockIdx.y * rows_per_split;
    const int row_end = min(rows, row_begin + rows_per_split);

    // grad_x's B operand for the whole split: A at ranks 16q + 4t .. 16q + 4t + 3 (k slots 2t, 2t+1 in
    // register 0, 2t+8, 2t+9 in register 1) and column 8 (g / 2) + 2w + g % 2 of the block (n slot g of
    // column tile w), rounded to bf16; zero past the end
    unsigned af[K_TILES][4][2];
    {
        const int c = blockIdx.x * BLOCK_COLS + 8 * (g >> 1) + (g & 1);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const bool ok = c + 2 * w < cols;
            const int at = ok ? c + 2 * w : cols - 1;
#pragma unroll
            for (int q = 0; q < K_TILES; ++q) {
                const float* __restrict__ src = lora_a + static_cast<u64>(16 * q + 4 * t) * cols + at;
                float v[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) v[i] = ok ? src[static_cast<u64>(i) * cols] : 0.0f;
                af[q][w][0] = pack2<scalar_t>(v[0], v[1]);
                af[q][w][1] = pack2<scalar_t>(v[2], v[3]);
            }
        }
    }
    float da[K_TILES][4][4] = {};  // dA^T: rank tile q, column tile w, fragment

    for (int row0 = row_begin + warp * ROWS_PER_STEP; row0 < row_end; row0 += WARPS * ROWS_PER_STEP) {
        // 1. every load of the step: x (rows g and g + 8 of each 16-row tile, the lane's 8 columns) and dh
        //    (the same rows, ranks 4t .. 4t+3 of each rank tile)
        uint4 xw[M_TILES][2];
        float dv[M_TILES][2][K_TILES][4];
#pragma unroll
        for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = min(row0 + 16 * m + 8 * half + g, row_end - 1);
                xw[m][half] = *reinterpret_cast<const uint4*>(x + static_cast<u64>(row) * cols + col);
#pragma unroll
                for (int q = 0; q < K_TILES; ++q) {
                    load_vec<4>(dh + static_cast<u64>(row) * RANK_BUCKET + 16 * q + 4 * t, dv[m][half][q]);
                }
            }
        }
        // 2. per 16-row tile: the mask (zero for rows and columns past the end), grad_x, then dA
#pragma unroll
        for (int m = 0; m < M_TILES; ++m) {
            unsigned keep[2];
            bool row_ok[2];
            unsigned xr[2][4];  // drop(x) (unscaled) of row g + 8 half, columns 8t + 2w, 8t + 2w + 1
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + 16 * m + 8 * half + g;
                row_ok[half] = row < row_end;
                keep[half] = col_ok && row_ok[half] ? 0xFFu : 0u;
                if (drop.threshold != 0) {  // the same for the whole grid
                    keep[half] &= keep_bits8(drop, (static_cast<u64>(min(row, row_end - 1)) * cols + col) >> 3);
                }
                const unsigned words[4] = {xw[m][half].x, xw[m][half].y, xw[m][half].z, xw[m][half].w};
#pragma unroll
                for (int w = 0; w < 4; ++w) xr[half][w] = keep_halves(words[w], keep[half] >> (2 * w));
            }
            // grad_x's A operand: dh as hi + lo, register 0 / 2 = row g at ranks 4t, 4t+1 / 4t+2, 4t+3,
            // registers 1 / 3 the same for row g + 8; rows past the end are zero
            unsigned hi[K_TILES][4], lo[K_TILES][4];
#pragma unroll
            for (int q = 0; q < K_TILES; ++q) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float d[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) d[i] = row_ok[half] ? dv[m][half][q][i] : 0.0f;
                    split2<scalar_t>(d[0], d[1], hi[q][half], lo[q][half]);
                    split2<scalar_t>(d[2], d[3], hi[q][half + 2], lo[q][half + 2]);
                }
            }
            if (grad_x_lora != nullptr) {
                float gx[4][4] = {};  // column tile w: (row g, columns 8t + 2w, +1), (row g + 8, the same)
#pragma unroll
                for (int q = 0; q < K_TILES; ++q) {
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        mma_16x8x16<scalar_t>(gx[w], hi[q], af[q][w]);
                        mma_16x8x16<scalar_t>(gx[w], lo[q], af[q][w]);
                    }
                }
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float v[CHUNK];
#pragma unroll
                    for (int e = 0; e < CHUNK; ++e) {
                        v[e] = (keep[half] >> e) & 1u ? gx[e >> 1][2 * half + (e & 1)] * drop.keep_scale : 0.0f;
                    }
                    const int row = row0 + 16 * m + 8 * half + g;
                    if (col_ok && row_ok[half]) {
                        store_vec<CHUNK>(grad_x_lora + static_cast<u64>(row) * cols + col_lane, v);
                    }
                }
            }
            // dA^T += dh^T drop(x): B operand = x with rows 2t, 2t+1 (+ 8) in the k slots, n slot g =
            // column 8 (g / 2) + 2w + g % 2; A operand = the dh fragments transposed
            unsigned xb[4][2];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                xb[w][0] = transpose8x8(xr[0][w]);
                xb[w][1] = transpose8x8(xr[1][w]);
            }
#pragma unroll
            for (int q = 0; q < K_TILES; ++q) {
                const unsigned th[4] = {transpose8x8(hi[q][0]), transpose8x8(hi[q][2]), transpose8x8(hi[q][1]),
                                        transpose8x8(hi[q][3])};
                const unsigned tl[4] = {transpose8x8(lo[q][0]), transpose8x8(lo[q][2]), transpose8x8(lo[q][1]),
                                        transpose8x8(lo[q][3])};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    mma_16x8x16<scalar_t>(da[q][w], th, xb[w]);
                    mma_16x8x16<scalar_t>(da[q][w], tl, xb[w]);
                }
            }
        }
    }

    // the warps' dA sums, added by warp 0 in a fixed order (deterministic)
    if (warp > 0) {
#pragma unroll
        for (int q = 0; q < K_TILES; ++q) {
#pragma unroll
            for (int w = 0; w < 4; ++w) {
#pragma unroll
                for (int i = 0; i < 4; ++i) warp_da[warp - 1][((q * 4 + w) * 4 + i) * 32 + lane] = da[q][w][i];
            }
        }
    }
    __syncthreads();
    if (warp > 0 || !col_ok) return;
    // fragment (q, w, i): rank 16q + 4 (g / 2) + g % 2 + 2 (i / 2), column 8t + 2w + i % 2
#pragma unroll
    for (int q = 0; q < K_TILES; ++q) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float v[CHUNK];
#pragma unroll
            for (int e = 0; e < CHUNK; ++e) {
                const int i = 2 * half + (e & 1);
                float sum = da[q][e >> 1][i];
#pragma unroll
                for (int w = 0; w < WARPS - 1; ++w) sum += warp_da[w][((q * 4 + (e >> 1)) * 4 + i) * 32 + lane];
                v[e] = drop.keep_scale * sum;
            }
            const int rank = 16 * q + 4 * (g >> 1) + (g & 1) + 2 * half;
            store_vec<CHUNK>(da_part + (static_cast<u64>(blockIdx.y) * RANK_BUCKET + rank) * cols + col_lane, v);
        }
    }
}

template <bool USE_MMA>
__device__ __forceinline__ void grad_in_pass(
    const scalar_t* __restrict__ x, const float* __restrict__ dh, const float* __restrict__ lora_a,
    scalar_t* __restrict__ grad_x_lora, float* __restrict__ da_part, int rows, int cols, int rows_per_split,
    const Dropout& drop, float (*warp_da)[WARP_DA])
{
    if constexpr (USE_MMA) {
        grad_in_mma<USE_MMA>(x, dh, lora_a, grad_x_lora, da_part, rows, cols, rows_per_split, drop, warp_da);
    } else {
        grad_in_fma<!USE_MMA>(x, dh, lora_a, grad_x_lora, da_part, rows, cols, rows_per_split, drop, warp_da);
    }
}

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
    // the warps' dA sums at the end. Declared here, in the kernel, and handed to the pass: a __shared__
    // array inside a template would be one object for every variant loaded into a process in loragen's
    // CPU emulation (a unique symbol), whatever its size.
    __shared__ float warp_da[WARPS - 1][WARP_DA];
    grad_in_pass<MMA>(x, dh, lora_a, grad_x_lora, da_part, rows, cols, rows_per_split,
                      make_dropout(rng, threshold, keep_scale), warp_da);
}
