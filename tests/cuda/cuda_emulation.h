// Host emulation of the CUDA features loragen's kernels use, so the rendered kernels run on the CPU
// in tests (no GPU on the CI machines). Included ahead of the kernel source with g++ -include.
//
// It is built to show the bugs a GPU has, not to hide them:
// - every CUDA thread of a block is a real thread; __syncthreads and the warp shuffles are barriers made
//   of a std::mutex and a std::condition_variable, so ThreadSanitizer sees exactly the ordering a GPU
//   barrier gives (and a race the barriers leave open is a TSan report); a shuffle is one barrier;
// - blocks run one at a time in a shuffled order (seeded: EMU_BLOCK_SEED, 0 = launch order);
// - `__shared__` arrays live in the section "emu_shared" and are filled with a NaN pattern before every
//   block (EMU_SHARED_POISON), so nothing a block reads there comes from zero-initialisation or from the
//   block before it; built with -fsanitize-sections=emu_shared, ASan puts red zones around them;
// - the vector types are aligned like CUDA's (uint4/float4: 16 bytes), so with -fsanitize=alignment a
//   misaligned vector load or store is a run-time error naming the type and the address.
// A thread that returns drops out of its barriers, as exited threads do on the GPU.
//
// Only what the kernels need is here: full-warp shuffles, __syncthreads, __umulhi, float/bit casts,
// int min/max, the CUDA vector types, the correctly rounded float intrinsics (__fadd_rn, ...).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// One static object per kernel, in a section of its own: emu::launch poisons it before every block.
#define __shared__ static __attribute__((section("emu_shared")))

// CUDA's vector types, with CUDA's alignment (so misaligned accesses through them are caught).
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) ulonglong2 { unsigned long long x, y; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct emu_dim3 { unsigned x, y, z; };
// A kernel's entry point in a build (cuda_emulation.py's wrapper): the argument array, grid and block size.
typedef void (*emu_entry)(void** args, unsigned grid_x, unsigned grid_y, unsigned threads);

inline thread_local emu_dim3 threadIdx{0, 0, 0};
inline emu_dim3 blockIdx{0, 0, 0};  // written by the launching thread between blocks, under the block barrier
inline emu_dim3 blockDim{0, 1, 1};
inline emu_dim3 gridDim{0, 0, 1};

extern "C" {
// Provided by the linker for the section holding the kernels' __shared__ arrays (null without one).
extern char __start_emu_shared[] __attribute__((weak));
extern char __stop_emu_shared[] __attribute__((weak));
}

namespace emu {

// A reusable barrier for `count` threads that ThreadSanitizer understands (a mutex and a condition
// variable, no spinning on atomics). Threads that leave for good call drop().
class Barrier {
  public:
    explicit Barrier(int count = 0) : expected_(count) {}

    void reset(int count) {
        std::lock_guard<std::mutex> lock(mutex_);
        expected_ = count;
        arrived_ = 0;
    }

    void arrive_and_wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        const unsigned long generation = generation_;
        if (++arrived_ >= expected_) {
            release(lock);
        } else {
            wake_.wait(lock, [&] { return generation_ != generation; });
        }
    }

    void drop() {
        std::unique_lock<std::mutex> lock(mutex_);
        --expected_;
        if (arrived_ > 0 && arrived_ >= expected_) release(lock);
    }

  private:
    // Opens the barrier, then wakes the waiters with the mutex already free: woken under it, each
    // would block on it again at once (twice the thread switches, which dominate an emulated launch).
    // The barriers outlive every thread that uses them (emu::launch joins its pool first).
    void release(std::unique_lock<std::mutex>& lock) {
        arrived_ = 0;
        ++generation_;
        lock.unlock();
        wake_.notify_all();
    }

    std::mutex mutex_;
    std::condition_variable wake_;
    int expected_ = 0;
    int arrived_ = 0;
    unsigned long generation_ = 0;
};

struct Warp {
    Barrier barrier{32};
    std::uint64_t slots[2][32];  // successive shuffles alternate between the two rows
    unsigned row[32] = {};  // per lane: the row its next shuffle writes (reset before every block)
};

struct Block {
    Barrier barrier;
    std::vector<std::unique_ptr<Warp>> warps;
};

inline Block* block = nullptr;  // the block running now (blocks run one at a time)

inline Warp& warp() { return *block->warps[threadIdx.x / 32]; }

// One barrier per shuffle: every lane writes its value, waits for the others, reads its source lane.
// The next shuffle writes the other row of slots; this row is written again only by the shuffle after
// that, past the next shuffle's barrier, which every lane reaches after its read here.
template <typename T>
T exchange(T value, int source_lane) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t), "shuffle of a type wider than 64 bits");
    Warp& w = warp();
    const unsigned lane = threadIdx.x % 32;
    std::uint64_t* slots = w.slots[w.row[lane]];
    w.row[lane] ^= 1u;
    std::uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    slots[lane] = bits;
    w.barrier.arrive_and_wait();
    std::uint64_t got = slots[source_lane & 31];
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

inline unsigned long env_number(const char* name, unsigned long fallback) {
    const char* text = std::getenv(name);
    return text == nullptr || *text == '\0' ? fallback : std::strtoul(text, nullptr, 0);
}

// Fills the __shared__ section with a 32-bit pattern (a NaN as float, a huge value as int). Byte by
// byte through a volatile pointer and without ASan's checks: the red zones between the arrays are
// written too (harmlessly: ASan keeps its state in shadow memory), and memset would be reported.
__attribute__((no_sanitize_address)) inline void poison_shared(std::uint32_t pattern) {
    if (__start_emu_shared == nullptr || __stop_emu_shared == nullptr) return;
    volatile unsigned char* p = reinterpret_cast<volatile unsigned char*>(__start_emu_shared);
    const std::size_t size = static_cast<std::size_t>(__stop_emu_shared - __start_emu_shared);
    for (std::size_t i = 0; i < size; ++i) p[i] = static_cast<unsigned char>(pattern >> (8 * (i % 4)));
}

// The order the blocks of a grid run in: launch order for seed 0, else a seeded shuffle.
inline std::vector<emu_dim3> block_order(unsigned grid_x, unsigned grid_y, unsigned long seed) {
    std::vector<emu_dim3> order;
    order.reserve(static_cast<std::size_t>(grid_x) * grid_y);
    for (unsigned by = 0; by < grid_y; ++by) {
        for (unsigned bx = 0; bx < grid_x; ++bx) order.push_back({bx, by, 0});
    }
    if (seed != 0) {
        std::mt19937_64 rng(seed);
        std::shuffle(order.begin(), order.end(), rng);
    }
    return order;
}

// Runs body() as grid_x * grid_y blocks of `threads` threads. One pool of `threads` real threads runs
// the blocks one after another; the launching thread sets each block up (index, barriers, poisoned
// shared memory) between two barriers with the pool. Options are read from the environment:
// EMU_BLOCK_SEED (block order; default 1, 0 = launch order) and EMU_SHARED_POISON (the 32-bit fill
// of shared memory; default 0xFFC0DEAD, a quiet NaN).
inline void launch(unsigned grid_x, unsigned grid_y, unsigned threads, const std::function<void()>& body) {
    const std::vector<emu_dim3> order = block_order(grid_x, grid_y, env_number("EMU_BLOCK_SEED", 1));
    const std::uint32_t poison = static_cast<std::uint32_t>(env_number("EMU_SHARED_POISON", 0xFFC0DEADul));
    if (order.empty() || threads == 0) return;
    Block blk;
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) blk.warps.push_back(std::make_unique<Warp>());
    Barrier start(static_cast<int>(threads) + 1), finish(static_cast<int>(threads) + 1);
    block = &blk;
    blockDim = {threads, 1, 1};
    gridDim = {grid_x, grid_y, 1};

    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            for (std::size_t b = 0; b < order.size(); ++b) {
                start.arrive_and_wait();
                body();
                blk.warps[t / 32]->barrier.drop();
                blk.barrier.drop();
                finish.arrive_and_wait();
            }
        });
    }
    for (const emu_dim3& index : order) {
        blockIdx = index;
        blk.barrier.reset(static_cast<int>(threads));
        for (unsigned w = 0; w < blk.warps.size(); ++w) {
            blk.warps[w]->barrier.reset(static_cast<int>(std::min(32u, threads - 32 * w)));
            std::fill(std::begin(blk.warps[w]->row), std::end(blk.warps[w]->row), 0u);
        }
        poison_shared(poison);
        start.arrive_and_wait();
        finish.arrive_and_wait();
    }
    for (std::thread& th : pool) th.join();
    block = nullptr;
}

}  // namespace emu

inline void __syncthreads() { emu::block->barrier.arrive_and_wait(); }

template <typename T> inline T __shfl_sync(unsigned, T value, int lane) { return emu::exchange(value, lane); }

template <typename T> inline T __shfl_xor_sync(unsigned, T value, int mask) {
    return emu::exchange(value, static_cast<int>(threadIdx.x % 32) ^ mask);
}

template <typename T> inline T __shfl_down_sync(unsigned, T value, unsigned delta) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    return emu::exchange(value, lane + static_cast<int>(delta) < 32 ? lane + static_cast<int>(delta) : lane);
}

template <typename T> inline T __shfl_up_sync(unsigned, T value, unsigned delta) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    return emu::exchange(value, lane >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
    unsigned bits = 0;
    for (int lane = 0; lane < 32; ++lane) bits |= (emu::exchange(predicate != 0, lane) ? 1u : 0u) << lane;
    return bits & mask;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp().barrier.arrive_and_wait(); }

// Cache-hinted loads and stores: plain typed accesses here, so a misaligned vector pointer still traps.
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline T __ldlu(const T* p) { return *p; }
template <typename T> inline void __stcg(T* p, T value) { *p = value; }
template <typename T> inline void __stcs(T* p, T value) { *p = value; }
template <typename T> inline void __stwt(T* p, T value) { *p = value; }

inline unsigned __umulhi(unsigned a, unsigned b) {
    return static_cast<unsigned>((static_cast<std::uint64_t>(a) * b) >> 32);
}

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// Correctly rounded float arithmetic (g++ contracts nothing into FMAs at -O1 without -mfma).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
