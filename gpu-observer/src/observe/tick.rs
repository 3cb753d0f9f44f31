//! One tick of a run (every `--interval-ms`): attach to libraries newly mapped, notice the end
//! of the observed process, report drops, refresh the live view.

use std::io::Write;

use anyhow::Result;

use super::{End, Run};
use crate::{attach::Scope, pipeline::Request, say, snapshot::AgentStats};

impl Run {
    /// `Some(why)` when the run should end.
    pub(super) fn tick(&mut self, end: &mut End) -> Result<Option<String>> {
        let mapped = self.at.rescan();
        if self.waiting && mapped > 0 {
            self.waiting = false;
        }
        // The observed process's end; with its descendants followed, the end of the last.
        if end.exit_status.is_none()
            && let Some(s) = self.spawned.as_mut()
            && let Some(status) = s.child.try_wait()?
        {
            end.exit_status = Some(status);
            self.root_gone = Some(format!("process {} exited ({status})", s.pid()));
        }
        if self.root_gone.is_none()
            && let Some(pid) = self.cli.pid
            && !crate::procinfo::ProcInfo::host().exists(pid)
        {
            self.root_gone = Some(format!("process {pid} exited"));
        }
        if let Some(why) = &self.root_gone {
            let left = match self.at.scope {
                Scope::Tree(_) => self.at.probes.followed().len(),
                _ => 0,
            };
            if left == 0 {
                return Ok(Some(why.clone()));
            }
            if !self.told_descendants {
                say(format_args!("{why}; observing its {left} descendants until they exit"));
                self.told_descendants = true;
            }
        }
        let missed = self.at.probes.follow_missed();
        if missed > self.last_follow_missed {
            say(format_args!(
                "warning: {missed} new processes of the followed tree were not followed (its map is full at {} processes)",
                gpu_observer_common::limits::MAX_PROCESSES
            ));
            self.last_follow_missed = missed;
        }
        let drops = self.at.probes.drops().unwrap_or_default();
        if drops.total > self.last_drops {
            say(format_args!(
                "warning: ring buffer full: {} records dropped so far; raise --ring-buffer-size (now {} bytes) or narrow with --pid",
                drops.total, self.cli.ring_buffer_size
            ));
            self.last_drops = drops.total;
        }
        self.reader.ask(Request::Agent(AgentStats {
            drops: drops.clone(),
            attach_failures: self.at.stats().refused_total(),
            capture_fraction: self
                .tracker
                .capture
                .as_ref()
                .map(|l| l.fraction(crate::clock::monotonic_ns())),
        }));
        // Verdicts over the last window: shown live; written once a window, or when the class
        // changes.
        let snap = self.snapshots.load();
        // Fleet mode between windows: a library that started collecting is paused.
        if self.capture.as_ref().is_some_and(|c| c.cupti() && !c.is_open()) {
            self.cupti_switch.between(&snap);
        }
        let now = self.tracker.tick(&snap, &crate::procinfo::ProcInfo::host());
        let mut write = Vec::new();
        for v in now {
            let due = self.verdict_written.get(&v.pid).is_none_or(|(at, class)| {
                *class != v.verdict.class || snap.taken_ns.saturating_sub(*at) >= crate::analyze::window::WINDOW_NS
            });
            if due {
                self.verdict_written.insert(v.pid, (snap.taken_ns, v.verdict.class));
                write.push(v.clone());
            }
            self.verdicts.insert(v.pid, v);
        }
        self.verdicts
            .retain(|pid, _| snap.process(*pid).is_some_and(|p| !p.exited));
        self.verdict_written.retain(|pid, _| snap.process(*pid).is_some());
        if !write.is_empty() {
            self.reader.ask(Request::Verdicts(snap.taken_ns, write));
        }
        if let Some(d) = &self.dashboard {
            d.publish(super::dashboard::Published {
                verdicts: self.verdicts.clone(),
                drops: drops.clone(),
                attach: super::start::attach_line(&self.at, self.waiting),
            });
        }
        if self.live {
            let interval_s = self.cli.interval_ms as f64 / 1000.0;
            let text = self.view.render(
                &snap,
                &drops,
                &self.verdicts,
                interval_s,
                self.started.elapsed().as_secs_f64(),
            );
            let mut so = std::io::stdout().lock();
            if let Err(e) = write!(so, "\x1b[H\x1b[2J{text}").and_then(|()| so.flush()) {
                end.output_failed = true;
                return Ok(Some(format!(
                    "error: writing the live view to {} failed: {e}; stopping",
                    self.dest
                )));
            }
        }
        Ok(None)
    }
}
