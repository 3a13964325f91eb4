/* A stand-in for the driver entry points loragen's C++ host path calls (loragen/cuda/native_host.py), for
 * the CPU tests: cuLaunchKernel runs the kernel emulated on the host (the "function" is an emulated
 * build's emu_entry, tests/cuda/cuda_emulation.h), the context calls keep one current context per
 * thread and count pushes, a launch can be made to fail with a chosen error, and the stream can be made
 * to look captured. */
#include <stddef.h>

typedef void (*emu_entry)(void **args, unsigned grid_x, unsigned grid_y, unsigned threads);

static _Thread_local void *current;
static int fail_with;
static int pushes;
static int launches;

int shim_launch(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                unsigned block_y, unsigned block_z, unsigned shared_bytes, void *stream, void **params,
                void **extra) {
    if (fail_with) return fail_with;
    if (grid_z != 1 || block_y != 1 || block_z != 1 || shared_bytes != 0 || extra != NULL) return 1;
    ((emu_entry)function)(params, grid_x, grid_y, block_x);
    launches++;
    return 0;
}

int shim_get_current(void **context) {
    *context = current;
    return 0;
}

int shim_push_current(void *context) {
    current = context;
    pushes++;
    return 0;
}

int shim_pop_current(void **context) {
    *context = current;
    current = NULL;
    return 0;
}

static int capturing;

int shim_is_capturing(void *stream, int *status) { /* CPU tensors pass no stream */
    *status = capturing;
    return 0;
}

int shim_error_name(int error, const char **name) {
    *name = error == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_UNKNOWN";
    return 0;
}

void shim_set_current(void *context) { current = context; }
void shim_fail_with(int error) { fail_with = error; }
void shim_set_capturing(int status) { capturing = status; }
int shim_pushes(void) { return pushes; }
int shim_launches(void) { return launches; }
