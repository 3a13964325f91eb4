/* A stand-in for the CUDA driver library, for timing the host side of loragen's kernel launches on a
 * machine without a GPU (benchmarks/cuda_host.py --time --stand-in-driver): every entry point returns
 * CUDA_SUCCESS at once, and the few that hand back a value hand back a fixed one. cuda-python finds
 * the entry points through cuGetProcAddress, so that is what the calls go through, as with the real
 * driver. Nothing runs: kernels, memory and streams do not exist here. */
#include <stdint.h>
#include <string.h>

typedef int CUresult;

static void *const STAND_IN_CONTEXT = (void *)0x1000;

CUresult cuInit(unsigned flags) { return 0; }

CUresult cuDriverGetVersion(int *version) {
    *version = 13000;
    return 0;
}

CUresult cuCtxGetCurrent(void **context) {
    *context = STAND_IN_CONTEXT; /* the device's primary context is current: no push and pop */
    return 0;
}

CUresult cuDevicePrimaryCtxRetain(void **context, int device) {
    *context = STAND_IN_CONTEXT;
    return 0;
}

CUresult cuLaunchKernel(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                        unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                        void *stream, void **params, void **extra) {
    return 0;
}

static CUresult succeed(void) { return 0; }

CUresult cuGetProcAddress_v2(const char *symbol, void **function, int version, uint64_t flags,
                             int *status) {
    if (!strcmp(symbol, "cuInit")) *function = (void *)cuInit;
    else if (!strcmp(symbol, "cuDriverGetVersion")) *function = (void *)cuDriverGetVersion;
    else if (!strcmp(symbol, "cuCtxGetCurrent")) *function = (void *)cuCtxGetCurrent;
    else if (!strcmp(symbol, "cuDevicePrimaryCtxRetain")) *function = (void *)cuDevicePrimaryCtxRetain;
    else if (!strcmp(symbol, "cuLaunchKernel")) *function = (void *)cuLaunchKernel;
    else if (!strcmp(symbol, "cuGetProcAddress")) *function = (void *)cuGetProcAddress_v2;
    else *function = (void *)succeed;
    if (status) *status = 0;
    return 0;
}

CUresult cuGetProcAddress(const char *symbol, void **function, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, function, version, flags, 0);
}
