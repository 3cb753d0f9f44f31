//! Which events and GPU records become spans, decided on the reader thread before the span
//! queue: what is sampled out costs a few comparisons there, not a clone, a queue slot and
//! the span thread's time (docs/BENCHMARKS.md "OTLP spans in the replay"). The anomaly
//! detector has flagged the batch before any sink sees it, so a flagged call is known here.
//!
//! The rules (docs/DESIGN.md "Rules"): a call sampled by duration is kept when slow, flagged
//! or abandoned; a GPU record the same; launches and ioctls always; then each process may
//! export `max_spans_per_sec` spans a second, and as many again of flagged ones.

use std::{collections::HashMap, sync::atomic::Ordering};

use gpu_observer_common::cupti::GpuRecordKind;

use super::{Config, Counters, Item};
use crate::{
    correlate::cupti_join::GpuActivity,
    decode::{Body, Event},
};

/// Processes whose second's budget is remembered; past it the stalest is forgotten (its next
/// span starts a fresh second).
const MAX_PROCS: usize = 4096;

/// What to do with one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// A span: hand it to the span thread.
    Span,
    /// Needed by the span thread but not a span (a process's exit closes its window).
    Pass,
    /// Sampled out (counted); its ioctls, which the span thread holds until the call returns,
    /// go with it: the thread learns which ones.
    Out { drop_ioctls: bool },
    /// Nothing the span thread uses.
    Skip,
}

#[derive(Clone, Copy, Debug)]
struct Budget {
    second: u64,
    left: u64,
    anomaly_left: u64,
}

#[derive(Clone, Debug)]
pub(super) struct Sampler {
    threshold_ns: u64,
    trace_all: bool,
    per_sec: u64,
    procs: HashMap<u32, Budget>,
}

impl Sampler {
    pub(super) fn new(cfg: &Config) -> Self {
        Self {
            threshold_ns: cfg.threshold_ns,
            trace_all: cfg.trace_all,
            per_sec: cfg.max_spans_per_sec,
            procs: HashMap::new(),
        }
    }

    /// What to queue for `ev`, if anything; what is sampled out is counted here.
    pub(super) fn route(&mut self, ev: &Event, counters: &Counters) -> Option<Item> {
        match self.event(ev) {
            Route::Span | Route::Pass => Some(Item::Event(ev.clone())),
            Route::Out { drop_ioctls } => {
                counters.spans_sampled_out.fetch_add(1, Ordering::Relaxed);
                match &ev.body {
                    Body::Call(c) if drop_ioctls => Some(Item::SampledOut {
                        tid: ev.tid,
                        start_ns: ev.ts_ns,
                        end_ns: ev.ts_ns + c.duration_ns,
                    }),
                    _ => None,
                }
            }
            Route::Skip => None,
        }
    }

    /// What to queue for a GPU record: every kernel record goes (the GPU-time histogram
    /// counts them all), the rest only as spans.
    pub(super) fn route_gpu(&mut self, a: &GpuActivity, counters: &Counters) -> Option<Item> {
        let span = self.gpu(a);
        if !span {
            counters.spans_sampled_out.fetch_add(1, Ordering::Relaxed);
        }
        let kernel = a.kernel.is_some() && a.kind() == Some(GpuRecordKind::Kernel);
        (span || kernel).then(|| Item::Gpu(a.clone(), span))
    }

    pub(super) fn event(&mut self, ev: &Event) -> Route {
        match &ev.body {
            Body::Ioctl(_) => self.budget(ev.pid, ev.ts_ns, false),
            Body::Launch(_) if ev.api.is_some() => self.budget(ev.pid, ev.ts_ns, false),
            Body::Call(c) if ev.api.is_some() => {
                let timed = ev.api.is_some_and(|a| crate::rules::sampled_by_duration(a.family));
                let route = if timed
                    && !c.abandoned
                    && !crate::rules::kept(c.duration_ns, self.threshold_ns, self.trace_all, c.anomalous)
                {
                    Route::Out { drop_ioctls: false }
                } else {
                    self.budget(ev.pid, ev.ts_ns, c.anomalous)
                };
                match route {
                    Route::Out { .. } => Route::Out {
                        drop_ioctls: c.ioctl_count > 0,
                    },
                    r => r,
                }
            }
            Body::ProcessExit => {
                self.procs.remove(&ev.pid);
                Route::Pass
            }
            _ => Route::Skip,
        }
    }

    /// Whether a GPU record is a span (the span thread gets every kernel record anyway, for
    /// the GPU-time histogram).
    fn gpu(&mut self, a: &GpuActivity) -> bool {
        crate::rules::kept(a.duration_ns(), self.threshold_ns, self.trace_all, a.anomalous)
            && self.budget(a.pid, a.rec.start_ns, a.anomalous) == Route::Span
    }

    /// Takes one span of `pid`'s budget for the second of `ts`.
    fn budget(&mut self, pid: u32, ts: u64, anomalous: bool) -> Route {
        if self.per_sec == 0 {
            return Route::Span;
        }
        let second = ts / 1_000_000_000;
        if !self.procs.contains_key(&pid)
            && self.procs.len() >= MAX_PROCS
            && let Some(stalest) = self.procs.iter().min_by_key(|(_, b)| b.second).map(|(p, _)| *p)
        {
            self.procs.remove(&stalest);
        }
        let full = Budget {
            second,
            left: self.per_sec,
            anomaly_left: self.per_sec,
        };
        let b = self.procs.entry(pid).or_insert(full);
        if b.second != second {
            *b = full;
        }
        if b.left > 0 {
            b.left -= 1;
        } else if anomalous && b.anomaly_left > 0 {
            b.anomaly_left -= 1;
        } else {
            return Route::Out { drop_ioctls: false };
        }
        Route::Span
    }
}

#[cfg(test)]
mod tests {
    use gpu_observer_common::api;

    use super::*;
    use crate::decode::Launch;

    fn sampler(per_sec: u64) -> Sampler {
        Sampler::new(&Config::for_tests(per_sec))
    }

    fn at(pid: u32, ts_ns: u64, body: Body) -> Event {
        Event {
            ts_ns,
            pid,
            tid: pid,
            comm: [0; 16],
            api: api::by_id(api::id_of("cuLaunchKernel").unwrap()),
            body,
        }
    }

    fn launch(pid: u32, ts_ns: u64) -> Event {
        at(pid, ts_ns, Body::Launch(Launch::of(1)))
    }

    #[test]
    fn each_process_gets_its_budget_each_second_and_an_exit_forgets_it() {
        let mut s = sampler(2);
        let routes: Vec<Route> = [1, 2, 3].map(|k| s.event(&launch(7, k))).to_vec();
        let out = Route::Out { drop_ioctls: false };
        assert_eq!(routes, [Route::Span, Route::Span, out]);
        // Another process has its own; the next second is whole again.
        assert_eq!(s.event(&launch(8, 4)), Route::Span);
        assert_eq!(s.event(&launch(7, 1_000_000_001)), Route::Span);
        // An exit passes and forgets the process: a new one with its pid starts afresh.
        assert_eq!(s.event(&at(8, 5, Body::ProcessExit)), Route::Pass);
        assert_eq!(
            (s.event(&launch(8, 6)), s.event(&launch(8, 7))),
            (Route::Span, Route::Span)
        );
        // No limit: every launch.
        let mut s = sampler(0);
        assert!((0..100).all(|k| s.event(&launch(7, k)) == Route::Span));
    }

    #[test]
    fn processes_past_the_bound_forget_the_stalest() {
        let mut s = sampler(1);
        for pid in 0..MAX_PROCS as u32 {
            assert_eq!(s.event(&launch(pid, 1_000_000_000 + u64::from(pid))), Route::Span);
        }
        // Pid 0 spent its second; one more process evicts the stalest (an earlier second).
        s.procs.get_mut(&0).unwrap().second = 0;
        assert_eq!(s.event(&launch(u32::MAX, 1_500_000_000)), Route::Span);
        assert_eq!(s.procs.len(), MAX_PROCS);
        assert!(!s.procs.contains_key(&0));
    }
}
