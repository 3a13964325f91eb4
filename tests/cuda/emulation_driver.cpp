// A stand-alone program that runs one emulated kernel launch, so that it can be built with ASan, UBSan
// or TSan and run as its own process (the sanitizers' runtimes cannot be loaded into Python).
//
//   driver KERNEL LAUNCH_FILE OUTPUT_FILE
//
// KERNEL names one of the kernels built into the program (emu_find, written by cuda_emulation.py).
// LAUNCH_FILE (little-endian, written by tests/cuda/cuda_emulation.py):
//   "EMU1", u32 grid_x, u32 grid_y, u32 threads, u32 argument count, then per argument
//   u32 kind: 0 scalar (u32 size, bytes), 1 buffer (u64 lead, u64 size, bytes), 2 null pointer.
// Each buffer gets an allocation of its own of exactly lead + size bytes, and the kernel sees the
// pointer `lead` bytes in (lead = the tensor's address modulo 64, so its alignment is the tensor's):
// ASan's red zones then start right after the last byte of the tensor. OUTPUT_FILE receives every
// buffer's bytes after the launch, in argument order.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" emu_entry emu_find(const char* name);  // emu_entry: cuda_emulation.h, included by -include

namespace {

struct Reader {
    std::FILE* file;
    template <typename T> T get() {
        T value{};
        if (std::fread(&value, sizeof(T), 1, file) != 1) fail("truncated launch file");
        return value;
    }
    void bytes(void* dst, std::size_t size) {
        if (size != 0 && std::fread(dst, 1, size, file) != size) fail("truncated launch file");
    }
    [[noreturn]] static void fail(const char* why) {
        std::fprintf(stderr, "emulation_driver: %s\n", why);
        std::exit(2);
    }
};

struct Argument {
    std::uint32_t kind = 0;
    alignas(8) unsigned char scalar[8] = {};  // a u64 parameter is read as one
    unsigned char* base = nullptr;
    unsigned char* data = nullptr;
    std::uint64_t size = 0;
    void* pointer = nullptr;  // what the kernel receives for a pointer parameter
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 4) Reader::fail("usage: driver KERNEL LAUNCH_FILE OUTPUT_FILE");
    const emu_entry run = emu_find(argv[1]);
    if (run == nullptr) Reader::fail("no such kernel in this program");
    std::FILE* in = std::fopen(argv[2], "rb");
    if (in == nullptr) Reader::fail("cannot open the launch file");
    Reader read{in};
    char magic[4];
    read.bytes(magic, 4);
    if (std::memcmp(magic, "EMU1", 4) != 0) Reader::fail("not a launch file");
    const auto grid_x = read.get<std::uint32_t>();
    const auto grid_y = read.get<std::uint32_t>();
    const auto threads = read.get<std::uint32_t>();
    const auto count = read.get<std::uint32_t>();
    std::vector<Argument> arguments(count);
    std::vector<void*> values(count);
    for (std::uint32_t i = 0; i < count; ++i) {
        Argument& a = arguments[i];
        a.kind = read.get<std::uint32_t>();
        if (a.kind == 0) {
            const auto size = read.get<std::uint32_t>();
            if (size > sizeof(a.scalar)) Reader::fail("scalar argument wider than 8 bytes");
            read.bytes(a.scalar, size);
            values[i] = a.scalar;
        } else if (a.kind == 1) {
            const auto lead = read.get<std::uint64_t>();
            a.size = read.get<std::uint64_t>();
            void* base = nullptr;
            if (posix_memalign(&base, 64, lead + a.size + (lead + a.size == 0)) != 0) Reader::fail("out of memory");
            a.base = static_cast<unsigned char*>(base);
            a.data = a.base + lead;
            read.bytes(a.data, a.size);
            a.pointer = a.data;
            values[i] = &a.pointer;
        } else if (a.kind == 2) {
            values[i] = &a.pointer;
        } else {
            Reader::fail("unknown argument kind");
        }
    }
    std::fclose(in);

    run(values.data(), grid_x, grid_y, threads);

    std::FILE* out = std::fopen(argv[3], "wb");
    if (out == nullptr) Reader::fail("cannot open the output file");
    for (Argument& a : arguments) {
        if (a.kind == 1 && a.size != 0 && std::fwrite(a.data, 1, a.size, out) != a.size) {
            Reader::fail("cannot write the output file");
        }
        std::free(a.base);
    }
    std::fclose(out);
    return 0;
}
