// launch_bench.cu - launch-bound micro-benchmark for observer overhead.
//
// Build (cudart static by default):
//   nvcc -O2 -arch=sm_90 -o launch_bench launch_bench.cu
// Run:
//   ./launch_bench L R OUT.json [LB] [B]
//
// Primary metric: for each of R rounds it times L back-to-back launches of an
// empty kernel <<<1,1>>> on the default stream with CLOCK_MONOTONIC around the
// launch loop only; the cudaDeviceSynchronize that drains the queue is outside
// the timed region (its duration is reported separately).  Output JSON:
//   {"ns_per_launch_median":..., "rounds":[ns per launch per round], ...}
// plus the per-round windows so a caller can count observed launches.
//
// Secondary metric ("submit"): once the launch queue is full, the loop above
// is paced by the GPU and a CPU-side cost can hide in the slack.  So each round
// also launches LB kernels (default L/4) in batches of B (default 128, well
// under the queue depth), synchronizing between batches and timing only the
// launch calls: submit_ns_per_launch_median is the CPU cost of one launch.

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
    if (argc < 4 || argc > 6) {
        std::fprintf(stderr, "usage: %s LAUNCHES_PER_ROUND ROUNDS OUT.json [BATCHED_LAUNCHES [BATCH]]\n",
                     argv[0]);
        return 2;
    }
    const long L = parse_pos(argv[1], "L");
    const long R = parse_pos(argv[2], "R");
    const char* out_path = argv[3];
    const long B = argc > 5 ? parse_pos(argv[5], "B") : 128;
    long LB = argc > 4 ? parse_pos(argv[4], "LB") : L / 4;
    LB = (LB / B) * B;  // whole batches
    if (LB < B) LB = B;

    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    // Warm-up: module load + queue steady state, outside every window.
    for (int i = 0; i < 2000; ++i) empty_kernel<<<1, 1>>>();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    std::vector<double> per_launch, submit;
    std::vector<long long> starts, ends, sync_ns, bstarts, bends;
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

        // Batched: time only the launch calls of each batch.
        long long launch_ns = 0;
        const long long b0 = now_ns();
        for (long done = 0; done < LB; done += B) {
            const long long s0 = now_ns();
            for (long i = 0; i < B; ++i) empty_kernel<<<1, 1>>>();
            const long long s1 = now_ns();
            launch_ns += s1 - s0;
            CK(cudaDeviceSynchronize());
        }
        const long long b1 = now_ns();
        CK(cudaGetLastError());
        submit.push_back(static_cast<double>(launch_ns) / static_cast<double>(LB));
        bstarts.push_back(b0);
        bends.push_back(b1);
    }
    auto median_of = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        const size_t k = v.size();
        return (k % 2) ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
    };
    const size_t m = per_launch.size();
    const double median = median_of(per_launch);
    const double submit_median = median_of(submit);

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
    std::fprintf(f, "],\"submit_ns_per_launch_median\":%.3f,\"submit_rounds\":[", submit_median);
    for (size_t i = 0; i < m; ++i) std::fprintf(f, "%s%.3f", i ? "," : "", submit[i]);
    std::fprintf(f, "],\"batched_launches_per_round\":%ld,\"batch\":%ld,\"batched_window_start_ns\":[",
                 LB, B);
    for (size_t i = 0; i < m; ++i) std::fprintf(f, "%s%lld", i ? "," : "", bstarts[i]);
    std::fprintf(f, "],\"batched_window_end_ns\":[");
    for (size_t i = 0; i < m; ++i) std::fprintf(f, "%s%lld", i ? "," : "", bends[i]);
    std::fprintf(f, "]}\n");
    if (std::fclose(f) != 0) {
        std::perror(out_path);
        return 1;
    }
    std::printf("launch_bench: pid=%d L=%ld R=%ld median=%.1f ns/launch rounds=[", static_cast<int>(getpid()),
                L, R, median);
    for (size_t i = 0; i < m; ++i) std::printf("%s%.1f", i ? " " : "", per_launch[i]);
    std::printf("] submit(batched %ld x %ld)=%.1f ns/launch\n", LB / B, B, submit_median);
    return 0;
}
