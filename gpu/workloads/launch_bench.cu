// launch_bench.cu - launch-bound micro-benchmark for observer overhead.
//
// Build (cudart static by default):
//   nvcc -O2 -arch=sm_90 -o launch_bench launch_bench.cu
// Run:
//   ./launch_bench L R OUT.json
//
// For each of R rounds it times L back-to-back launches of an empty kernel
// <<<1,1>>> on the default stream with CLOCK_MONOTONIC around the launch loop
// only; the cudaDeviceSynchronize that drains the queue is outside the timed
// region (its duration is reported separately).  Output JSON:
//   {"ns_per_launch_median":..., "rounds":[ns per launch per round], ...}
// plus the per-round windows so a caller can count observed launches.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <unistd.h>
#include <vector>

#define CK(call)                                                             \
    do {                                                                     \
        cudaError_t err_ = (call);                                           \
        if (err_ != cudaSuccess) {                                           \
            std::fprintf(stderr, "launch_bench: %s:%d: %s failed: %s (%d)\n", \
                         __FILE__, __LINE__, #call, cudaGetErrorString(err_), \
                         static_cast<int>(err_));                            \
            std::exit(1);                                                    \
        }                                                                    \
    } while (0)

static long long now_ns() {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        std::perror("clock_gettime");
        std::exit(1);
    }
    return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

__global__ void empty_kernel() {}

static long parse_pos(const char* s, const char* what) {
    char* end = nullptr;
    long v = std::strtol(s, &end, 10);
    if (end == s || *end != '\0' || v <= 0 || v > 1000000000L) {
        std::fprintf(stderr, "launch_bench: bad %s '%s'\n", what, s);
        std::exit(2);
    }
    return v;
}

int main(int argc, char** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s LAUNCHES_PER_ROUND ROUNDS OUT.json\n", argv[0]);
        return 2;
    }
    const long L = parse_pos(argv[1], "L");
    const long R = parse_pos(argv[2], "R");
    const char* out_path = argv[3];

    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    // Warm-up: module load + queue steady state, outside every window.
    for (int i = 0; i < 2000; ++i) empty_kernel<<<1, 1>>>();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    std::vector<double> per_launch;
    std::vector<long long> starts, ends, sync_ns;
    for (long r = 0; r < R; ++r) {
        const long long t0 = now_ns();
        for (long i = 0; i < L; ++i) empty_kernel<<<1, 1>>>();
        const long long t1 = now_ns();
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        const long long t2 = now_ns();
        per_launch.push_back(static_cast<double>(t1 - t0) / static_cast<double>(L));
        starts.push_back(t0);
        ends.push_back(t1);
        sync_ns.push_back(t2 - t1);
    }
    std::vector<double> sorted = per_launch;
    std::sort(sorted.begin(), sorted.end());
    const size_t m = sorted.size();
    const double median = (m % 2) ? sorted[m / 2] : 0.5 * (sorted[m / 2 - 1] + sorted[m / 2]);

    FILE* f = std::fopen(out_path, "w");
    if (!f) {
        std::perror(out_path);
        return 1;
    }
    std::fprintf(f, "{\"workload\":\"launch_bench\",\"pid\":%d,\"launches_per_round\":%ld,"
                    "\"ns_per_launch_median\":%.3f,\"rounds\":[",
                 static_cast<int>(getpid()), L, median);
    for (size_t i = 0; i < m; ++i) std::fprintf(f, "%s%.3f", i ? "," : "", per_launch[i]);
    std::fprintf(f, "],\"window_start_ns\":[");
    for (size_t i = 0; i < m; ++i) std::fprintf(f, "%s%lld", i ? "," : "", starts[i]);
    std::fprintf(f, "],\"window_end_ns\":[");
    for (size_t i = 0; i < m; ++i) std::fprintf(f, "%s%lld", i ? "," : "", ends[i]);
    std::fprintf(f, "],\"drain_sync_ns\":[");
    for (size_t i = 0; i < m; ++i) std::fprintf(f, "%s%lld", i ? "," : "", sync_ns[i]);
    std::fprintf(f, "]}\n");
    if (std::fclose(f) != 0) {
        std::perror(out_path);
        return 1;
    }
    std::printf("launch_bench: pid=%d L=%ld R=%ld median=%.1f ns/launch rounds=[", static_cast<int>(getpid()),
                L, R, median);
    for (size_t i = 0; i < m; ++i) std::printf("%s%.1f", i ? " " : "", per_launch[i]);
    std::printf("]\n");
    return 0;
}
