"""gpucheck: the Python side of gpu-observer's real-GPU validation and benchmarks (gpu/*.sh).
Standard library only.  Run a job as `python3 -m gpucheck.MODULE ...` with gpu/ on PYTHONPATH
(gpu/lib.sh sets it); gpu/README.md lists the modules.

Jobs: compare, compare_ground_truth, compare_cupti (workload runs against the observer's JSON
lines), compare_nvml (NVML sampling against nvidia-smi), compare_verdicts (bottleneck verdicts
of the bottleneck.py workloads, VERDICTS.md), make_report (environment and VALIDATION.md),
bench_report, bench_cupti_report, bench_nvml_report, otlp_report (benchmark and export
reports), bench_nvml_queries (NVML call costs).
Shared: jsonl (the one JSON-lines reader), common, names, checks.
"""
