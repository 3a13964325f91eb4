/* CPU kernels for the dropout path of the LoRA linear op (loragen/cpu_kernels.py builds and loads them).
 *
 * With dropout, the rank-r products read x (or write dx) through a keep-mask stored as packed bits:
 * element i of the flattened (N, in) tensor is bit i % 8 of byte i / 8. Done with numpy and BLAS, each
 * product is an unpack pass, a masked copy and a GEMM, with numpy on one core. These kernels turn 16
 * bits of the mask into an AVX-512 lane mask where they use them, so x is read once per product and no
 * masked copy exists:
 *
 *   lora_masked_down    h  = scale * (x * m) A^T        (N, r)   forward; at = A^T (in, r)
 *   lora_masked_grad_a  at = (x * m)^T gh               (in, r)  backward; dA = at^T
 *   lora_masked_grad_x  dx = (gh A) * m                 (N, in)  backward; the base GEMM adds g W after
 *
 * float32, row-major, contiguous; r a multiple of 16 for down and grad_a (the caller pads), so a row of h
 * or gh is r/16 AVX-512 registers (r/8 AVX2 ones). Each kernel keeps its accumulators in registers: down
 * and grad_x work on four rows at a time (four independent FMA chains sharing every load of A); grad_a
 * works, with AVX-512, on a block of 16 / RV columns of x for all rows (the block's rows of at never
 * leave the registers), with AVX2 on four rows at a time against a 256-column tile of at held in cache.
 * Work is split over OpenMP threads by rows (down, grad_x) or columns (grad_a: each thread owns its rows
 * of at, no reduction).
 *
 * Two builds of this one file (loragen.ops.cpu_kernels chooses by the CPU's flags):
 *   -march=native -mprefer-vector-width=512   AVX-512 intrinsics, lora_kernels_isa() == 512
 *   -mavx2 -mfma                              AVX2 + FMA intrinsics, lora_kernels_isa() == 256
 * A build for neither reports 0 and holds no kernels; loragen keeps its numpy/BLAS path.
 *
 * nbytes is the mask buffer's size: no byte past it is read (nor any element past x, A or dx: tails use
 * masked loads and stores, which touch only the lanes they select).
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* grad_a reads x down column strips, one cache line per row: fetched this many rows ahead */
#define PREFETCH_ROWS 16

#if defined(__AVX512F__)
#include <immintrin.h>

int lora_kernels_isa(void) { return 512; }

/* The 16 keep flags of elements [first, first + 16) as a lane mask; bytes past last (the mask's last
 * byte) are not read. */
static inline __mmask16 keep16(const uint8_t *restrict bits, int64_t first, int64_t last) {
    const int64_t b = first >> 3;
    uint32_t word = bits[b];
    if (b + 1 <= last) word |= (uint32_t)bits[b + 1] << 8;
    if (b + 2 <= last) word |= (uint32_t)bits[b + 2] << 16;
    return (__mmask16)(word >> (first & 7));
}

/* The flags of elements [first, first + count), count < 16, as a lane mask. */
static inline __mmask16 keep_tail(const uint8_t *restrict bits, int64_t first, int64_t count, int64_t last) {
    return (__mmask16)(keep16(bits, first, last) & ((1u << count) - 1u));
}

/* ---- h = scale * (x * m) A^T ------------------------------------------------------------------------ */

#define MAX_RV 16 /* r <= 256 */

static inline __attribute__((always_inline)) void down_rows(const float *restrict x,
                                                            const uint8_t *restrict bits,
                                                            const float *restrict at, float *restrict h,
                                                            int64_t row0, int64_t rows, int64_t in, int rv,
                                                            float scale, int64_t last) {
    __m512 acc[4][MAX_RV];
    for (int i = 0; i < 4; ++i)
        for (int v = 0; v < rv; ++v) acc[i][v] = _mm512_setzero_ps();
    float xm[4][16] __attribute__((aligned(64)));
    for (int64_t j = 0; j < in; j += 16) {
        const int64_t count = in - j < 16 ? in - j : 16;
        for (int i = 0; i < 4; ++i) {
            if (i < rows) {
                const int64_t first = (row0 + i) * in + j;
                __mmask16 k = count == 16 ? keep16(bits, first, last) : keep_tail(bits, first, count, last);
                _mm512_store_ps(xm[i], _mm512_maskz_loadu_ps(k, x + first));
            } else {
                _mm512_store_ps(xm[i], _mm512_setzero_ps());
            }
        }
        for (int64_t l = 0; l < count; ++l) {
            const float *a = at + (j + l) * rv * 16;
            for (int v = 0; v < rv; ++v) {
                const __m512 av = _mm512_loadu_ps(a + 16 * v);
                acc[0][v] = _mm512_fmadd_ps(_mm512_set1_ps(xm[0][l]), av, acc[0][v]);
                acc[1][v] = _mm512_fmadd_ps(_mm512_set1_ps(xm[1][l]), av, acc[1][v]);
                acc[2][v] = _mm512_fmadd_ps(_mm512_set1_ps(xm[2][l]), av, acc[2][v]);
                acc[3][v] = _mm512_fmadd_ps(_mm512_set1_ps(xm[3][l]), av, acc[3][v]);
            }
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int i = 0; i < rows; ++i)
        for (int v = 0; v < rv; ++v)
            _mm512_storeu_ps(h + (row0 + i) * rv * 16 + 16 * v, _mm512_mul_ps(s, acc[i][v]));
}

void lora_masked_down(const float *x, const uint8_t *bits, const float *at, float *h, int64_t n, int64_t in,
                      int64_t r, float scale, int64_t nbytes, int threads) {
    const int64_t last = nbytes - 1;
    const int rv = (int)(r / 16);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row0 = 0; row0 < n; row0 += 4) {
        const int64_t rows = n - row0 < 4 ? n - row0 : 4;
        switch (rv) { /* literal rv: the register loops unroll */
            case 1: down_rows(x, bits, at, h, row0, rows, in, 1, scale, last); break;
            case 2: down_rows(x, bits, at, h, row0, rows, in, 2, scale, last); break;
            case 4: down_rows(x, bits, at, h, row0, rows, in, 4, scale, last); break;
            default: down_rows(x, bits, at, h, row0, rows, in, rv, scale, last);
        }
    }
}

/* ---- at = (x * m)^T gh ------------------------------------------------------------------------------ */

/* Columns [j0, j0 + cols) of x, cols * rv <= 16: at[j, :] for those columns stays in registers while
 * every row goes by. */
static inline __attribute__((always_inline)) void grad_a_block(const float *restrict x,
                                                               const uint8_t *restrict bits,
                                                               const float *restrict gh, float *restrict at,
                                                               int64_t n, int64_t in, int rv, int64_t j0,
                                                               int cols, int64_t last) {
    __m512 acc[16];
    for (int c = 0; c < cols * rv; ++c) acc[c] = _mm512_setzero_ps();
    float xm[16] __attribute__((aligned(64)));
    const __mmask16 lanes = (__mmask16)((1u << cols) - 1u);
    for (int64_t row = 0; row < n; ++row) {
        const int64_t first = row * in + j0;
        /* the walk down a column strip crosses a page per row, where the hardware prefetchers stop */
        if (row + PREFETCH_ROWS < n) __builtin_prefetch(x + first + PREFETCH_ROWS * in);
        const __mmask16 k = (__mmask16)(keep16(bits, first, last) & lanes);
        _mm512_store_ps(xm, _mm512_maskz_loadu_ps(k, x + first));
        const float *g = gh + row * rv * 16;
        for (int v = 0; v < rv; ++v) {
            const __m512 gv = _mm512_loadu_ps(g + 16 * v);
            for (int c = 0; c < cols; ++c)
                acc[c * rv + v] = _mm512_fmadd_ps(_mm512_set1_ps(xm[c]), gv, acc[c * rv + v]);
        }
    }
    for (int c = 0; c < cols; ++c)
        for (int v = 0; v < rv; ++v) _mm512_storeu_ps(at + (j0 + c) * rv * 16 + 16 * v, acc[c * rv + v]);
}

void lora_masked_grad_a(const float *x, const uint8_t *bits, const float *gh, float *at, int64_t n, int64_t in,
                        int64_t r, int64_t nbytes, int threads) {
    const int64_t last = nbytes - 1;
    const int rv = (int)(r / 16);
    const int cols = 16 / rv;
    const int64_t blocks = (in + cols - 1) / cols;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j0 = b * cols;
        const int width = (int)(in - j0 < cols ? in - j0 : cols);
        if (width == cols && rv == 1)
            grad_a_block(x, bits, gh, at, n, in, 1, j0, 16, last);
        else if (width == cols && rv == 2)
            grad_a_block(x, bits, gh, at, n, in, 2, j0, 8, last);
        else if (width == cols && rv == 4)
            grad_a_block(x, bits, gh, at, n, in, 4, j0, 4, last);
        else
            grad_a_block(x, bits, gh, at, n, in, rv, j0, width, last);
    }
}

/* ---- dx = (gh A) * m ---------------------------------------------------------------------------------- */

static void grad_x_rows(const float *restrict gh, const float *restrict a, const uint8_t *restrict bits,
                        float *restrict dx, int64_t row0, int64_t rows, int64_t in, int64_t r, int64_t last) {
    for (int64_t j = 0; j < in; j += 16) {
        const int64_t count = in - j < 16 ? in - j : 16;
        const __mmask16 lanes = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        const float *g0 = gh + row0 * r;
        /* rows past the last real one repeat it; their results are not stored */
        const float *g1 = rows > 1 ? g0 + r : g0;
        const float *g2 = rows > 2 ? g0 + 2 * r : g0;
        const float *g3 = rows > 3 ? g0 + 3 * r : g0;
        for (int64_t k = 0; k < r; ++k) {
            const __m512 av = _mm512_maskz_loadu_ps(lanes, a + k * in + j);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(g0[k]), av, acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(g1[k]), av, acc1);
            acc2 = _mm512_fmadd_ps(_mm512_set1_ps(g2[k]), av, acc2);
            acc3 = _mm512_fmadd_ps(_mm512_set1_ps(g3[k]), av, acc3);
        }
        const __m512 accs[4] = {acc0, acc1, acc2, acc3};
        for (int i = 0; i < rows; ++i) {
            const int64_t first = (row0 + i) * in + j;
            const __mmask16 k = (__mmask16)(keep16(bits, first, last) & lanes);
            _mm512_mask_storeu_ps(dx + first, lanes, _mm512_maskz_mov_ps(k, accs[i]));
        }
    }
}

void lora_masked_grad_x(const float *gh, const float *a, const uint8_t *bits, float *dx, int64_t n, int64_t in,
                        int64_t r, int64_t nbytes, int threads) {
    const int64_t last = nbytes - 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row0 = 0; row0 < n; row0 += 4)
        grad_x_rows(gh, a, bits, dx, row0, n - row0 < 4 ? n - row0 : 4, in, r, last);
}

#elif defined(__AVX2__) && defined(__FMA__) /* x86-64 without AVX-512: the same kernels on 8-lane AVX2 */
#include <immintrin.h>

int lora_kernels_isa(void) { return 256; }

/* AVX2 has no mask registers: a lane mask is a vector of all-ones / all-zeros 32-bit lanes, and
 * _mm256_maskload_ps reads (and faults on) only the lanes it selects, which covers the tails. */

/* The 16 keep flags of elements [first, first + 16) as the low bits of a word; bytes past last (the
 * mask's last byte) are not read. */
static inline uint32_t keep16(const uint8_t *restrict bits, int64_t first, int64_t last) {
    const int64_t b = first >> 3;
    uint32_t word = bits[b];
    if (b + 1 <= last) word |= (uint32_t)bits[b + 1] << 8;
    if (b + 2 <= last) word |= (uint32_t)bits[b + 2] << 16;
    return word >> (first & 7);
}

/* The 8 keep flags of elements [first, first + 8) (the next byte is read only when first is not on a
 * byte boundary, and never past last). */
static inline uint32_t keep8(const uint8_t *restrict bits, int64_t first, int64_t last) {
    const int64_t b = first >> 3;
    const int shift = (int)(first & 7);
    uint32_t word = bits[b];
    if (shift != 0 && b + 1 <= last) word |= (uint32_t)bits[b + 1] << 8;
    return word >> shift;
}

/* Bits 0..7 of word as a lane mask. */
static inline __m256i lanes_of(uint32_t word) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)word), bit), bit);
}

/* Lanes [0, count) (count may be <= 0 or >= 8). */
static inline __m256i first_lanes(int64_t count) {
    const int64_t c = count < 0 ? 0 : count > 8 ? 8 : count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* ---- h = scale * (x * m) A^T ------------------------------------------------------------------------ */

#define MAX_RV 32 /* r <= 256: a row of at is r / 8 registers */

static inline __attribute__((always_inline)) void down_rows(const float *restrict x,
                                                            const uint8_t *restrict bits,
                                                            const float *restrict at, float *restrict h,
                                                            int64_t row0, int64_t rows, int64_t in, int rv,
                                                            float scale, int64_t last) {
    __m256 acc[4][MAX_RV];
    for (int i = 0; i < 4; ++i)
        for (int v = 0; v < rv; ++v) acc[i][v] = _mm256_setzero_ps();
    float xm[4][8] __attribute__((aligned(32)));
    for (int64_t j = 0; j < in; j += 8) {
        const int64_t count = in - j < 8 ? in - j : 8;
        for (int i = 0; i < 4; ++i) {
            if (i < rows) {
                const int64_t first = (row0 + i) * in + j;
                __m256i k = lanes_of(keep8(bits, first, last));
                if (count < 8) k = _mm256_and_si256(k, first_lanes(count));
                _mm256_store_ps(xm[i], _mm256_maskload_ps(x + first, k));
            } else {
                _mm256_store_ps(xm[i], _mm256_setzero_ps());
            }
        }
        for (int64_t l = 0; l < count; ++l) {
            const float *a = at + (j + l) * rv * 8;
            for (int v = 0; v < rv; ++v) {
                const __m256 av = _mm256_loadu_ps(a + 8 * v);
                acc[0][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(&xm[0][l]), av, acc[0][v]);
                acc[1][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(&xm[1][l]), av, acc[1][v]);
                acc[2][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(&xm[2][l]), av, acc[2][v]);
                acc[3][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(&xm[3][l]), av, acc[3][v]);
            }
        }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int i = 0; i < rows; ++i)
        for (int v = 0; v < rv; ++v)
            _mm256_storeu_ps(h + (row0 + i) * rv * 8 + 8 * v, _mm256_mul_ps(s, acc[i][v]));
}

/* down_rows for r = 16 (two registers per row): the eight accumulators are named, not an array, which
 * GCC would store back to the stack after every FMA. */
static void down_rows16(const float *restrict x, const uint8_t *restrict bits, const float *restrict at,
                        float *restrict h, int64_t row0, int64_t rows, int64_t in, float scale, int64_t last) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
           a31 = a00;
    float xm[4][8] __attribute__((aligned(32)));
    for (int64_t j = 0; j < in; j += 8) {
        const int64_t count = in - j < 8 ? in - j : 8;
        for (int i = 0; i < 4; ++i) {
            if (i < rows) {
                const int64_t first = (row0 + i) * in + j;
                __m256i k = lanes_of(keep8(bits, first, last));
                if (count < 8) k = _mm256_and_si256(k, first_lanes(count));
                _mm256_store_ps(xm[i], _mm256_maskload_ps(x + first, k));
            } else {
                _mm256_store_ps(xm[i], _mm256_setzero_ps());
            }
        }
        for (int64_t l = 0; l < count; ++l) {
            const float *a = at + (j + l) * 16;
            const __m256 lo = _mm256_loadu_ps(a), hi = _mm256_loadu_ps(a + 8);
            const __m256 x0 = _mm256_broadcast_ss(&xm[0][l]), x1 = _mm256_broadcast_ss(&xm[1][l]);
            const __m256 x2 = _mm256_broadcast_ss(&xm[2][l]), x3 = _mm256_broadcast_ss(&xm[3][l]);
            a00 = _mm256_fmadd_ps(x0, lo, a00), a01 = _mm256_fmadd_ps(x0, hi, a01);
            a10 = _mm256_fmadd_ps(x1, lo, a10), a11 = _mm256_fmadd_ps(x1, hi, a11);
            a20 = _mm256_fmadd_ps(x2, lo, a20), a21 = _mm256_fmadd_ps(x2, hi, a21);
            a30 = _mm256_fmadd_ps(x3, lo, a30), a31 = _mm256_fmadd_ps(x3, hi, a31);
        }
    }
    const __m256 s = _mm256_set1_ps(scale);
    const __m256 out[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int i = 0; i < rows; ++i) {
        _mm256_storeu_ps(h + (row0 + i) * 16, _mm256_mul_ps(s, out[i][0]));
        _mm256_storeu_ps(h + (row0 + i) * 16 + 8, _mm256_mul_ps(s, out[i][1]));
    }
}

void lora_masked_down(const float *x, const uint8_t *bits, const float *at, float *h, int64_t n, int64_t in,
                      int64_t r, float scale, int64_t nbytes, int threads) {
    const int64_t last = nbytes - 1;
    const int rv = (int)(r / 8);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row0 = 0; row0 < n; row0 += 4) {
        const int64_t rows = n - row0 < 4 ? n - row0 : 4;
        switch (rv) { /* literal rv: the register loops unroll */
            case 2: down_rows16(x, bits, at, h, row0, rows, in, scale, last); break;
            case 4: down_rows(x, bits, at, h, row0, rows, in, 4, scale, last); break;
            default: down_rows(x, bits, at, h, row0, rows, in, rv, scale, last);
        }
    }
}

/* ---- at = (x * m)^T gh ------------------------------------------------------------------------------ */

/* at[j, k0..k0+16) += sum over rows row0..row0+rows (at most 4) of xm[row, j] * gh[row, k0..k0+16), for
 * the columns j in [j0, j1). The 4 x 16 values of gh stay in eight registers while the columns go by; x is
 * read along its rows (no walk down column strips); each column's 16 accumulators are loaded from and
 * stored to at, which stays in cache (a tile of 256 columns, see below). */
static inline __attribute__((always_inline)) void grad_a_rows(const float *restrict x,
                                                              const uint8_t *restrict bits,
                                                              const float *restrict gh, float *restrict at,
                                                              int64_t row0, int64_t rows, int64_t in, int64_t r,
                                                              int64_t k0, int64_t j0, int64_t j1, int64_t last) {
    __m256 g[4][2];
    for (int i = 0; i < 4; ++i) {
        const float *gi = gh + (row0 + (i < rows ? i : 0)) * r + k0;
        g[i][0] = i < rows ? _mm256_loadu_ps(gi) : _mm256_setzero_ps();
        g[i][1] = i < rows ? _mm256_loadu_ps(gi + 8) : _mm256_setzero_ps();
    }
    float xm[4][8] __attribute__((aligned(32)));
    for (int64_t j = j0; j < j1; j += 8) {
        const int64_t count = j1 - j < 8 ? j1 - j : 8;
        const __m256i columns = first_lanes(count);
        for (int i = 0; i < 4; ++i) {
            if (i < rows) {
                const int64_t first = (row0 + i) * in + j;
                const __m256i keep = _mm256_and_si256(lanes_of(keep8(bits, first, last)), columns);
                _mm256_store_ps(xm[i], _mm256_maskload_ps(x + first, keep));
            } else {
                _mm256_store_ps(xm[i], _mm256_setzero_ps());
            }
        }
        for (int64_t l = 0; l < count; ++l) {
            float *o = at + (j + l) * r + k0;
            const __m256 x0 = _mm256_broadcast_ss(&xm[0][l]), x1 = _mm256_broadcast_ss(&xm[1][l]);
            const __m256 x2 = _mm256_broadcast_ss(&xm[2][l]), x3 = _mm256_broadcast_ss(&xm[3][l]);
            /* two short chains per half instead of one of four: the FMA latency overlaps */
            __m256 lo = _mm256_fmadd_ps(x0, g[0][0], _mm256_loadu_ps(o));
            __m256 hi = _mm256_fmadd_ps(x0, g[0][1], _mm256_loadu_ps(o + 8));
            __m256 lo2 = _mm256_mul_ps(x1, g[1][0]), hi2 = _mm256_mul_ps(x1, g[1][1]);
            lo = _mm256_fmadd_ps(x2, g[2][0], lo);
            hi = _mm256_fmadd_ps(x2, g[2][1], hi);
            lo2 = _mm256_fmadd_ps(x3, g[3][0], lo2);
            hi2 = _mm256_fmadd_ps(x3, g[3][1], hi2);
            _mm256_storeu_ps(o, _mm256_add_ps(lo, lo2));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(hi, hi2));
        }
    }
}

#define GRAD_A_TILE 256 /* columns per tile: at's rows for a tile are 16 KiB at r = 16 */

void lora_masked_grad_a(const float *x, const uint8_t *bits, const float *gh, float *at, int64_t n, int64_t in,
                        int64_t r, int64_t nbytes, int threads) {
    const int64_t last = nbytes - 1;
    const int64_t tiles = (in + GRAD_A_TILE - 1) / GRAD_A_TILE;
    /* tiles of columns are independent (each owns its rows of at): no reduction between threads */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t j0 = t * GRAD_A_TILE, j1 = in - j0 < GRAD_A_TILE ? in : j0 + GRAD_A_TILE;
        memset(at + j0 * r, 0, (size_t)((j1 - j0) * r) * sizeof(float));
        for (int64_t row0 = 0; row0 < n; row0 += 4) {
            const int64_t rows = n - row0 < 4 ? n - row0 : 4;
            for (int64_t k0 = 0; k0 < r; k0 += 16) grad_a_rows(x, bits, gh, at, row0, rows, in, r, k0, j0, j1, last);
        }
    }
}

/* ---- dx = (gh A) * m ---------------------------------------------------------------------------------- */

static void grad_x_rows(const float *restrict gh, const float *restrict a, const uint8_t *restrict bits,
                        float *restrict dx, int64_t row0, int64_t rows, int64_t in, int64_t r, int64_t last) {
    /* rows past the last real one repeat it; their results are not stored */
    const float *g0 = gh + row0 * r, *g1 = rows > 1 ? g0 + r : g0, *g2 = rows > 2 ? g0 + 2 * r : g0,
                *g3 = rows > 3 ? g0 + 3 * r : g0;
    for (int64_t j = 0; j < in; j += 16) { /* 16 columns: two registers per row, four rows */
        const __m256i lo = first_lanes(in - j), hi = first_lanes(in - j - 8);
        /* named accumulators: an array of them is stored back to the stack after every FMA */
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
               c31 = c00;
        for (int64_t k = 0; k < r; ++k) {
            const __m256 a0 = _mm256_maskload_ps(a + k * in + j, lo);
            const __m256 a1 = _mm256_maskload_ps(a + k * in + j + 8, hi);
            const __m256 v0 = _mm256_broadcast_ss(g0 + k), v1 = _mm256_broadcast_ss(g1 + k);
            const __m256 v2 = _mm256_broadcast_ss(g2 + k), v3 = _mm256_broadcast_ss(g3 + k);
            c00 = _mm256_fmadd_ps(v0, a0, c00), c01 = _mm256_fmadd_ps(v0, a1, c01);
            c10 = _mm256_fmadd_ps(v1, a0, c10), c11 = _mm256_fmadd_ps(v1, a1, c11);
            c20 = _mm256_fmadd_ps(v2, a0, c20), c21 = _mm256_fmadd_ps(v2, a1, c21);
            c30 = _mm256_fmadd_ps(v3, a0, c30), c31 = _mm256_fmadd_ps(v3, a1, c31);
        }
        const __m256 acc[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
        for (int i = 0; i < rows; ++i) {
            const int64_t first = (row0 + i) * in + j;
            const uint32_t word = keep16(bits, first, last);
            const __m256 k0 = _mm256_castsi256_ps(lanes_of(word)), k1 = _mm256_castsi256_ps(lanes_of(word >> 8));
            _mm256_maskstore_ps(dx + first, lo, _mm256_and_ps(acc[i][0], k0));
            _mm256_maskstore_ps(dx + first + 8, hi, _mm256_and_ps(acc[i][1], k1));
        }
    }
}

void lora_masked_grad_x(const float *gh, const float *a, const uint8_t *bits, float *dx, int64_t n, int64_t in,
                        int64_t r, int64_t nbytes, int threads) {
    const int64_t last = nbytes - 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row0 = 0; row0 < n; row0 += 4)
        grad_x_rows(gh, a, bits, dx, row0, n - row0 < 4 ? n - row0 : 4, in, r, last);
}

#else /* neither AVX-512 nor AVX2 + FMA: report it; loragen keeps its numpy/BLAS path */

int lora_kernels_isa(void) { return 0; }

void lora_masked_down(const float *x, const uint8_t *bits, const float *at, float *h, int64_t n, int64_t in,
                      int64_t r, float scale, int64_t nbytes, int threads) {
    (void)nbytes, (void)x, (void)bits, (void)at, (void)h, (void)n, (void)in, (void)r, (void)scale;
    (void)threads;
}

void lora_masked_grad_a(const float *x, const uint8_t *bits, const float *gh, float *at, int64_t n, int64_t in,
                        int64_t r, int64_t nbytes, int threads) {
    (void)nbytes, (void)x, (void)bits, (void)gh, (void)at, (void)n, (void)in, (void)r, (void)threads;
}

void lora_masked_grad_x(const float *gh, const float *a, const uint8_t *bits, float *dx, int64_t n, int64_t in,
                        int64_t r, int64_t nbytes, int threads) {
    (void)nbytes, (void)gh, (void)a, (void)bits, (void)dx, (void)n, (void)in, (void)r, (void)threads;
}

#endif
