// Host emulation of the CUDA features loragen's kernels use, so the rendered kernels run on the CPU
// in tests (no GPU on the CI machines). Every CUDA thread of a block is a std::thread; blocks run
// one after another, so `__shared__` arrays can be function statics. Warp shuffles exchange values
// through a per-warp slot array between two barrier phases; __syncthreads is a block-wide barrier.
// A thread that returns drops out of its barriers, as exited threads do on the GPU.
//
// Only what the kernels need is here: full-warp shuffles, __syncthreads, __umulhi, float/bit casts,
// int min/max, uint2/uint4, the correctly rounded float intrinsics (__fadd_rn, ...). Included ahead of
// the kernel source with g++ -include.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct emu_dim3 { unsigned x, y, z; };

thread_local emu_dim3 threadIdx{0, 0, 0};
thread_local emu_dim3 blockIdx{0, 0, 0};

namespace emu {

struct Warp {
    std::barrier<> barrier{32};
    std::uint64_t slots[32];
};

struct Block {
    explicit Block(int threads) : barrier(threads) {
        for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
    }
    std::barrier<> barrier;
    std::vector<std::unique_ptr<Warp>> warps;
};

thread_local Block* block = nullptr;

inline Warp& warp() { return *block->warps[threadIdx.x / 32]; }

template <typename T>
T exchange(T value, int source_lane) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t), "shuffle of a type wider than 64 bits");
    Warp& w = warp();
    std::uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    w.slots[threadIdx.x % 32] = bits;
    w.barrier.arrive_and_wait();
    std::uint64_t got = w.slots[source_lane & 31];
    w.barrier.arrive_and_wait();  // nobody overwrites a slot before every lane has read
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

// Runs body() as grid_x * grid_y blocks of `threads` threads.
inline void launch(unsigned grid_x, unsigned grid_y, unsigned threads, const std::function<void()>& body) {
    for (unsigned by = 0; by < grid_y; ++by) {
        for (unsigned bx = 0; bx < grid_x; ++bx) {
            Block blk(static_cast<int>(threads));
            std::vector<std::thread> pool;
            pool.reserve(threads);
            for (unsigned t = 0; t < threads; ++t) {
                pool.emplace_back([&blk, &body, t, bx, by] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    block = &blk;
                    body();
                    blk.warps[t / 32]->barrier.arrive_and_drop();
                    blk.barrier.arrive_and_drop();
                });
            }
            for (std::thread& th : pool) th.join();
        }
    }
}

}  // namespace emu

inline void __syncthreads() { emu::block->barrier.arrive_and_wait(); }

template <typename T> inline T __shfl_sync(unsigned, T value, int lane) { return emu::exchange(value, lane); }

template <typename T> inline T __shfl_xor_sync(unsigned, T value, int mask) {
    return emu::exchange(value, static_cast<int>(threadIdx.x % 32) ^ mask);
}

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
