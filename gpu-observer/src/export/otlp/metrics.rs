//! The OTLP metrics: observable instruments read, at each export, from the latest snapshot
//! (per-process totals, NVML devices, the agent's drops) and the exporter's own counters, so
//! metrics cost nothing per event and never wait on the reader. Names: OpenTelemetry's `hw.gpu.*` for devices,
//! `gpu.cuda.*` per process, `gpu_observer.*` for the agent itself (deploy/README.md lists
//! them with their Prometheus names).

use std::sync::{Arc, PoisonError, atomic::Ordering};

use gpu_observer_common::api::Direction;
use opentelemetry::{
    KeyValue,
    metrics::{Histogram, MeterProvider as _},
};
use opentelemetry_sdk::metrics::SdkMeterProvider;

use super::{Counters, anomalies::SharedTally, resource::SharedProcAttrs};
use crate::snapshot::{ProcessView, Snapshots};

/// Hands a value and its attributes to the instrument.
type Observe<'a> = &'a mut dyn FnMut(f64, Vec<KeyValue>);
/// What a process or a device contributes to one instrument.
type FromProcess = fn(&ProcessView, Vec<KeyValue>, Observe<'_>);
type FromDevice = fn(&crate::nvml::DeviceSample, Observe<'_>);

fn with(mut v: Vec<KeyValue>, kv: KeyValue) -> Vec<KeyValue> {
    v.push(kv);
    v
}

/// Registers every instrument; returns the kernel GPU-time histogram the span thread records.
pub fn register(
    meters: &SdkMeterProvider,
    snapshots: &Snapshots,
    gpu_time: crate::analyze::gpu_time::Published,
    counters: &Arc<Counters>,
    procs: &SharedProcAttrs,
    anomalies: &SharedTally,
) -> Histogram<f64> {
    let m = meters.meter("gpu-observer");

    // Per process, from the snapshot's totals.
    let per_proc = |name: &'static str, unit: &'static str, desc: &'static str, f: FromProcess| {
        let (s, pa) = (snapshots.clone(), procs.clone());
        m.f64_observable_counter(name)
            .with_unit(unit)
            .with_description(desc)
            .with_callback(move |obs| {
                let snap = s.load();
                let mut pa = pa.lock().unwrap_or_else(PoisonError::into_inner);
                for p in &snap.procs {
                    let attrs = pa.of(p.pid, &p.comm);
                    f(p, Vec::new(), &mut |v, extra| {
                        let mut a = (*attrs).clone();
                        a.extend(extra);
                        obs.observe(v, &a);
                    });
                }
            })
            .build()
    };
    per_proc(
        "gpu.cuda.launches",
        "{launch}",
        "Kernel launches (every launch API)",
        |p, a, o| o(p.stats.launches as f64, a),
    );
    per_proc(
        "gpu.cuda.memcpy.bytes",
        "By",
        "Bytes copied, by direction",
        |p, a, o| {
            for d in Direction::REPORTED {
                let kv = KeyValue::new("gpu_transfer.direction", d.name());
                o(p.stats.copy(d).bytes as f64, with(a.clone(), kv));
            }
        },
    );
    per_proc(
        "gpu.cuda.memcpy.duration",
        "s",
        "CPU time in copy calls, by direction",
        |p, a, o| {
            for d in Direction::REPORTED {
                let kv = KeyValue::new("gpu_transfer.direction", d.name());
                o(p.stats.copy(d).ns as f64 / 1e9, with(a.clone(), kv));
            }
        },
    );
    per_proc(
        "gpu.cuda.sync.duration",
        "s",
        "Time blocked in synchronizations, summed over threads",
        |p, a, o| o(p.stats.syncs.ns as f64 / 1e9, a),
    );
    per_proc("gpu.cuda.ioctl.count", "{ioctl}", "nvidia ioctls", |p, a, o| {
        o(p.stats.ioctls.count as f64, a)
    });
    per_proc("gpu.cuda.ioctl.duration", "s", "Time in nvidia ioctls", |p, a, o| {
        o(p.stats.ioctls.ns as f64 / 1e9, a)
    });
    // Fleet mode: the launch, copy, memset and sync counters above count the capture windows
    // only; this is the share of the time they covered (divide by it for an estimate).
    {
        let s = snapshots.clone();
        m.f64_observable_gauge("gpu.capture.fraction")
            .with_unit("1")
            .with_description(
                "Fleet mode: share of the time the capture windows covered; the launch, copy, memset and sync counters count only those windows",
            )
            .with_callback(move |obs| {
                if let Some(f) = s.load().agent.capture_fraction {
                    obs.observe(f, &[]);
                }
            })
            .build();
    }
    // Outstanding device/managed/pinned memory: bytes, and how many allocations.
    for (name, unit, desc, bytes) in [
        (
            "gpu.cuda.memory.outstanding",
            "By",
            "Device, managed and pinned host memory allocated and not freed",
            true,
        ),
        (
            "gpu.cuda.memory.allocations",
            "{allocation}",
            "Allocations not freed",
            false,
        ),
    ] {
        let (s, pa) = (snapshots.clone(), procs.clone());
        m.f64_observable_gauge(name)
            .with_unit(unit)
            .with_description(desc)
            .with_callback(move |obs| {
                let snap = s.load();
                let mut pa = pa.lock().unwrap_or_else(PoisonError::into_inner);
                for p in snap.procs.iter().filter(|p| !p.exited) {
                    let v = if bytes {
                        p.stats.outstanding_bytes()
                    } else {
                        p.stats.live_allocs
                    };
                    obs.observe(v as f64, &pa.of(p.pid, &p.comm));
                }
            })
            .build();
    }

    // GPU time by bottleneck class: no pid, so a fleet's series stay few (analyze/gpu_time.rs).
    m.f64_observable_counter("gpu.cuda.time")
        .with_unit("s")
        .with_description(
            "Wall time a process held a context on a GPU, attributed to the bottleneck class of its current verdict window",
        )
        .with_callback(move |obs| {
            for (k, s) in &gpu_time.load().seconds {
                let mut a = vec![
                    KeyValue::new("hw.id", k.gpu.to_string()),
                    KeyValue::new("gpu.bottleneck", k.class.name()),
                ];
                if let Some(p) = &k.pod {
                    a.push(KeyValue::new("k8s.pod.name", p.pod.clone()));
                    a.push(KeyValue::new("k8s.namespace.name", p.namespace.clone()));
                    a.push(KeyValue::new("k8s.container.name", p.container.clone()));
                }
                obs.observe(*s, &a);
            }
        })
        .build();

    // Anomalies found, by what was slow and the pod: no pid, no kernel name (cardinality; the
    // span events name them). Counted by the span thread (anomalies.rs).
    {
        let t = anomalies.clone();
        m.u64_observable_counter("gpu.anomalies")
            .with_unit("{anomaly}")
            .with_description(
                "Kernels, calls and copy bandwidths far slower than their series' recent values (docs/DESIGN.md, Anomalies)",
            )
            .with_callback(move |obs| {
                t.lock().unwrap_or_else(PoisonError::into_inner).each(|k, n| {
                    let mut a = vec![
                        KeyValue::new("gpu.anomaly.what", k.what),
                        KeyValue::new("gpu.anomaly.mode", k.mode),
                    ];
                    if let Some(p) = &k.pod {
                        a.push(KeyValue::new("k8s.pod.name", p.pod.clone()));
                        a.push(KeyValue::new("k8s.namespace.name", p.namespace.clone()));
                        a.push(KeyValue::new("k8s.container.name", p.container.clone()));
                    }
                    obs.observe(n, &a);
                });
            })
            .build();
    }

    // Devices, from the latest NVML samples.
    let per_gpu = |name: &'static str, unit: &'static str, counter: bool, f: FromDevice| {
        let snaps = snapshots.clone();
        let cb = move |obs: &dyn opentelemetry::metrics::AsyncInstrument<f64>| {
            let snap = snaps.load();
            for (d, s) in snap.nvml.latest() {
                let Some(s) = s else { continue };
                let base = vec![
                    KeyValue::new("hw.id", d.uuid.clone().unwrap_or_default()),
                    KeyValue::new("hw.name", d.name.clone()),
                    KeyValue::new("gpu.index", i64::from(d.index)),
                ];
                f(s, &mut |v, extra| {
                    let mut a = base.clone();
                    a.extend(extra);
                    obs.observe(v, &a);
                });
            }
        };
        if counter {
            m.f64_observable_counter(name).with_unit(unit).with_callback(cb).build();
        } else {
            m.f64_observable_gauge(name).with_unit(unit).with_callback(cb).build();
        }
    };
    per_gpu("hw.gpu.utilization", "1", false, |s, o| {
        for (task, v) in [
            ("general", s.util_gpu),
            ("encoder", s.util_encoder),
            ("decoder", s.util_decoder),
        ] {
            if let Some(v) = v {
                o(f64::from(v) / 100.0, vec![KeyValue::new("hw.gpu.task", task)]);
            }
        }
    });
    per_gpu("hw.gpu.memory.usage", "By", false, |s, o| {
        if let Some(v) = s.memory_used {
            o(v as f64, vec![]);
        }
    });
    per_gpu("hw.gpu.memory.limit", "By", false, |s, o| {
        if let Some(v) = s.memory_total {
            o(v as f64, vec![]);
        }
    });
    per_gpu("hw.gpu.memory.utilization", "1", false, |s, o| {
        if let (Some(u), Some(t)) = (s.memory_used, s.memory_total.filter(|&t| t > 0)) {
            o(u as f64 / t as f64, vec![]);
        }
    });
    per_gpu("hw.power", "W", false, |s, o| {
        if let Some(mw) = s.power_mw {
            o(f64::from(mw) / 1000.0, vec![KeyValue::new("hw.type", "gpu")]);
        }
    });
    per_gpu("hw.temperature", "Cel", false, |s, o| {
        if let Some(c) = s.temperature_c {
            o(f64::from(c), vec![KeyValue::new("hw.type", "gpu")]);
        }
    });
    per_gpu("hw.gpu.io", "By", true, |s, o| {
        for (dir, v) in [("transmit", s.io_tx_bytes), ("receive", s.io_rx_bytes)] {
            if let Some(v) = v {
                o(v as f64, vec![KeyValue::new("network.io.direction", dir)]);
            }
        }
    });
    per_gpu("hw.gpu.pcie.link.width", "{lane}", false, |s, o| {
        if let Some(v) = s.link.width {
            o(f64::from(v), vec![]);
        }
    });
    per_gpu("hw.gpu.pcie.link.generation", "{generation}", false, |s, o| {
        if let Some(v) = s.link.generation {
            o(f64::from(v), vec![]);
        }
    });
    per_gpu("hw.errors", "{error}", true, |s, o| {
        for (kind, v) in [
            ("ecc_corrected", s.ecc_corrected),
            ("ecc_uncorrected", s.ecc_uncorrected),
            ("xid", s.xid_errors),
        ] {
            if let Some(v) = v {
                o(
                    v as f64,
                    vec![KeyValue::new("error.type", kind), KeyValue::new("hw.type", "gpu")],
                );
            }
        }
    });

    // The agent itself.
    {
        let s = snapshots.clone();
        m.u64_observable_counter("gpu_observer.events")
            .with_unit("{event}")
            .with_callback(move |obs| obs.observe(s.load().events, &[]))
            .build();
    }
    {
        let s = snapshots.clone();
        m.u64_observable_counter("gpu_observer.dropped")
            .with_unit("{record}")
            .with_description("Records the ring buffer had no room for, by kind")
            .with_callback(move |obs| {
                for (kind, n) in &s.load().agent.drops.by_kind {
                    obs.observe(*n, &[KeyValue::new("kind", kind.name())]);
                }
            })
            .build();
    }
    {
        let s = snapshots.clone();
        m.u64_observable_counter("gpu_observer.attach.failures")
            .with_unit("{library}")
            .with_callback(move |obs| obs.observe(s.load().agent.attach_failures, &[]))
            .build();
    }
    {
        let c = counters.clone();
        m.u64_observable_counter("gpu_observer.export.failures")
            .with_unit("{export}")
            .with_callback(move |obs| {
                obs.observe(
                    c.trace_failures.load(Ordering::Relaxed),
                    &[KeyValue::new("signal", "traces")],
                );
                obs.observe(
                    c.metric_failures.load(Ordering::Relaxed),
                    &[KeyValue::new("signal", "metrics")],
                );
            })
            .build();
    }
    {
        let c = counters.clone();
        m.u64_observable_counter("gpu_observer.export.dropped")
            .with_unit("{span}")
            .with_callback(move |obs| {
                obs.observe(
                    c.spans_dropped.load(Ordering::Relaxed),
                    &[KeyValue::new("signal", "traces")],
                )
            })
            .build();
    }

    m.f64_histogram("gpu.cuda.kernel.duration")
        .with_unit("s")
        .with_description("GPU time of kernels (CUPTI), by kernel: the top 20 by GPU time, the rest `other`")
        .with_boundaries(vec![
            1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0,
        ])
        .build()
}
