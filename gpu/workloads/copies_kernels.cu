// copies_kernels.cu - a workload with exactly known CUDA API counts.
//
// Build (cudart is linked statically by default):
//   nvcc -O2 -arch=sm_90 -o copies_kernels copies_kernels.cu
//   nvcc -O2 -arch=sm_90 --default-stream per-thread -o copies_kernels_ptds copies_kernels.cu
//
// Run:
//   ./copies_kernels N OUT.json
//
// Inside a CLOCK_MONOTONIC window [loop_start_ns, loop_end_ns] it performs,
// for each of N iterations:
//   1 x cudaMemcpy          host -> device, 1 MiB (pinned source)
//   1 x kernel launch       add_k<<<grid, block>>> on the default stream
//   1 x cudaMemcpyAsync     device -> host, 1 MiB, on a created stream
//   1 x cudaStreamSynchronize(created stream)
// then one cudaDeviceSynchronize.  Ordering between the default stream and the
// created stream is enforced with an event (cudaEventRecord +
// cudaStreamWaitEvent), which neither launches a kernel nor copies memory, so
// it is correct in both the legacy and the per-thread default stream builds.
// A warm-up iteration (module loading, first-touch) runs before the window.
// Every result is checked on the host; any mismatch or CUDA error exits 1.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <unistd.h>

#define CK(call)                                                              \
    do {                                                                      \
        cudaError_t err_ = (call);                                            \
        if (err_ != cudaSuccess) {                                            \
            std::fprintf(stderr, "copies_kernels: %s:%d: %s failed: %s (%d)\n", \
                         __FILE__, __LINE__, #call, cudaGetErrorString(err_), \
                         static_cast<int>(err_));                             \
            std::exit(1);                                                     \
        }                                                                     \
    } while (0)

static long long now_ns() {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        std::perror("clock_gettime");
        std::exit(1);
    }
    return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// out[i] = in[i] + k
__global__ void add_k(const unsigned int* in, unsigned int* out, unsigned int k, size_t n) {
    size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] + k;
}

// add_k's Itanium-mangled name and its demangled form (size_t is unsigned long on
// Linux x86-64): every launch the observer reports must carry the latter as `kernel`.
static const char* const kKernelMangled = "_Z5add_kPKjPjjm";
static const char* const kKernelName =
    "add_k(unsigned int const*, unsigned int*, unsigned int, unsigned long)";

static const size_t kBytes = 1u << 20;  // 1 MiB per copy
static const size_t kElems = kBytes / sizeof(unsigned int);
static const unsigned int kBlock = 256;

struct Bufs {
    unsigned int* h_in;   // pinned
    unsigned int* h_out;  // pinned
    unsigned int* d_in;
    unsigned int* d_out;
    cudaStream_t stream;
    cudaEvent_t ev;
};

// One iteration: HtoD, launch, DtoH on the created stream, stream sync, check.
static bool iteration(const Bufs& b, unsigned int k) {
    const unsigned int grid = static_cast<unsigned int>((kElems + kBlock - 1) / kBlock);
    CK(cudaMemcpy(b.d_in, b.h_in, kBytes, cudaMemcpyHostToDevice));
    add_k<<<grid, kBlock>>>(b.d_in, b.d_out, k, kElems);
    CK(cudaGetLastError());
    CK(cudaEventRecord(b.ev, 0));
    CK(cudaStreamWaitEvent(b.stream, b.ev, 0));
    CK(cudaMemcpyAsync(b.h_out, b.d_out, kBytes, cudaMemcpyDeviceToHost, b.stream));
    CK(cudaStreamSynchronize(b.stream));
    for (size_t i = 0; i < kElems; ++i) {
        unsigned int want = static_cast<unsigned int>(i) * 2654435761u + k;
        if (b.h_out[i] != want) {
            std::fprintf(stderr, "copies_kernels: mismatch at k=%u i=%zu: got %u want %u\n",
                         k, i, b.h_out[i], want);
            return false;
        }
    }
    return true;
}

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s N OUT.json\n", argv[0]);
        return 2;
    }
    char* end = nullptr;
    long n = std::strtol(argv[1], &end, 10);
    if (end == argv[1] || *end != '\0' || n <= 0 || n > 100000000L) {
        std::fprintf(stderr, "copies_kernels: bad N '%s'\n", argv[1]);
        return 2;
    }
    const char* out_path = argv[2];

    int ndev = 0;
    CK(cudaGetDeviceCount(&ndev));
    if (ndev < 1) {
        std::fprintf(stderr, "copies_kernels: no CUDA device\n");
        return 1;
    }
    CK(cudaSetDevice(0));
    CK(cudaFree(0));  // create the primary context now

    Bufs b;
    CK(cudaMallocHost(reinterpret_cast<void**>(&b.h_in), kBytes));
    CK(cudaMallocHost(reinterpret_cast<void**>(&b.h_out), kBytes));
    CK(cudaMalloc(reinterpret_cast<void**>(&b.d_in), kBytes));
    CK(cudaMalloc(reinterpret_cast<void**>(&b.d_out), kBytes));
    CK(cudaStreamCreate(&b.stream));
    CK(cudaEventCreateWithFlags(&b.ev, cudaEventDisableTiming));
    for (size_t i = 0; i < kElems; ++i) b.h_in[i] = static_cast<unsigned int>(i) * 2654435761u;
    std::memset(b.h_out, 0, kBytes);

    // Warm-up: same sequence once, outside the window.
    if (!iteration(b, 0xFFFFu)) return 1;
    CK(cudaDeviceSynchronize());

    const long long t0 = now_ns();
    for (long it = 0; it < n; ++it) {
        if (!iteration(b, static_cast<unsigned int>(it))) return 1;
    }
    CK(cudaDeviceSynchronize());
    const long long t1 = now_ns();

#ifdef CUDA_API_PER_THREAD_DEFAULT_STREAM
    const char* ptds = "true";
#else
    const char* ptds = "false";
#endif

    FILE* f = std::fopen(out_path, "w");
    if (!f) {
        std::perror(out_path);
        return 1;
    }
    std::fprintf(f,
                 "{\"workload\":\"copies_kernels\",\"pid\":%d,\"per_thread_default_stream\":%s,"
                 "\"loop_start_ns\":%lld,\"loop_end_ns\":%lld,\"iterations\":%ld,"
                 "\"launches\":%ld,\"htod\":%ld,\"dtoh\":%ld,"
                 "\"htod_bytes\":%lld,\"dtoh_bytes\":%lld,"
                 "\"stream_syncs\":%ld,\"device_syncs\":1,\"bytes_per_copy\":%zu,"
                 "\"kernel_name\":\"%s\",\"kernel_mangled\":\"%s\"}\n",
                 static_cast<int>(getpid()), ptds, t0, t1, n, n, n, n,
                 static_cast<long long>(n) * static_cast<long long>(kBytes),
                 static_cast<long long>(n) * static_cast<long long>(kBytes), n, kBytes,
                 kKernelName, kKernelMangled);
    if (std::fclose(f) != 0) {
        std::perror(out_path);
        return 1;
    }

    CK(cudaEventDestroy(b.ev));
    CK(cudaStreamDestroy(b.stream));
    CK(cudaFree(b.d_in));
    CK(cudaFree(b.d_out));
    CK(cudaFreeHost(b.h_in));
    CK(cudaFreeHost(b.h_out));

    std::printf("copies_kernels: ok pid=%d ptds=%s iterations=%ld window_ms=%.3f\n",
                static_cast<int>(getpid()), ptds, n, (t1 - t0) / 1e6);
    return 0;
}
