//! The end of a run, in order: the started program gets a moment to finish, the probes stop
//! producing, the sampler stops, the reader drains what is left and publishes its last
//! snapshot, the exporter flushes; then the summaries, from that snapshot.

use std::{
    io::Write,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{End, Run};
use crate::{
    cli::Format,
    export::{Summary, terminal},
    say, spawn,
};

/// How long shutdown waits for the NVML sampler's call in progress.
const SAMPLER_STOP_TIMEOUT: Duration = Duration::from_secs(2);

pub(super) async fn shutdown(mut run: Run, end: End) -> Result<i32> {
    let End {
        mut exit_status,
        mut output_failed,
    } = end;
    // The terminal first: what follows (messages, the summary) goes to the normal screen.
    // A dashboard that failed (a draw error, a panic) is a failed output: exit 1, the summary
    // still printed.
    if let Some(d) = run.dashboard.take()
        && let Some(why) = d.stop()
    {
        say(format_args!("error: {why}"));
        output_failed = true;
    }
    // A started program got the same Ctrl-C: give it a moment to finish (and flush CUPTI).
    if let (Some(s), None) = (run.spawned.as_mut(), exit_status) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while exit_status.is_none() && Instant::now() < deadline {
            exit_status = s.child.try_wait()?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if exit_status.is_none() {
            say(format_args!("process {} still runs; no longer observed", s.pid()));
        }
    }
    // --gpu-timing: switched off while the hooks still listen, so the last flush arrives.
    run.withdraw_gpu_timing().await;
    // The probes stop producing first: nothing waits on a program that is still running.
    run.at.probes.disable()?;
    // Then the sampler, so the reader's last drain has its last samples; an NVML call that
    // hangs is left behind rather than holding the exit (the process ends without it).
    if let Some(s) = run.sampler.take()
        && !s.stop(SAMPLER_STOP_TIMEOUT)
    {
        say(format_args!(
            "warning: an NVML call has not returned for {} s; exiting without waiting for it",
            SAMPLER_STOP_TIMEOUT.as_secs()
        ));
    }
    let Run {
        format: run_format,
        at,
        otlp,
        snapshots,
        mut summary_out,
        dest,
        started,
        reader,
        tracker,
        cupti_switch,
        ..
    } = run;
    let capture = tracker.capture.as_ref().map(|l| {
        let now = crate::clock::monotonic_ns();
        serde_json::json!({
            "fraction": (l.fraction(now) * 1e4).round() / 1e4,
            "windows": l.windows(),
            "cupti_writes_failed": cupti_switch.failed,
        })
    });
    let (mut sinks, snap) = match reader.stop() {
        Ok(v) => v,
        Err(e) => {
            say(format_args!("error: {e:#}; stopped observing"));
            output_failed = true;
            // The views still have the last snapshot the reader published.
            (Vec::new(), snapshots.load())
        }
    };
    let exported = otlp.map(|o| {
        let c = o.counters.clone();
        o.shutdown(Duration::from_secs(5));
        let j = c.json();
        say(format_args!(
            "OTLP: {} spans exported, {} dropped, {} sampled out; {} metric exports, {} failed; \
             {} ioctl spans not under their call and {} trace windows closed early (bounds)",
            j["spans_exported"],
            j["spans_dropped"],
            j["spans_sampled_out"],
            j["metric_exports"],
            j["metric_export_failures"],
            j["ioctls_unparented"],
            j["windows_closed_early"]
        ));
        j
    });
    let drops = at.probes.drops()?;
    let wall_ns = started.elapsed().as_nanos() as u64;
    let unattributed = drops
        .by_pid_kind
        .keys()
        .filter(|pid| snap.process(**pid).is_none())
        .map(|pid| drops.of_pid(*pid))
        .sum();
    let agent = [
        ("otlp", exported.unwrap_or(serde_json::Value::Null)),
        ("libraries", at.stats().json()),
        ("capture", capture.unwrap_or(serde_json::Value::Null)),
    ];
    // The whole run's verdicts, from the last snapshot.
    let mut tracker = tracker;
    tracker.last_tick(&snap, &crate::procinfo::ProcInfo::host());
    let verdicts: std::collections::HashMap<u32, crate::analyze::verdict::Verdict> = snap
        .procs
        .iter()
        .filter_map(|p| tracker.whole_run(p.pid).map(|v| (p.pid, v)))
        .collect();
    let text = format!(
        "{}{}\n",
        terminal::final_summary(&snap, &drops, wall_ns, &verdicts),
        at.stats()
    );
    let summary = Summary {
        verdicts: &verdicts,
        snapshot: &snap,
        drops: &drops,
        wall_ns,
        unattributed_drops: unattributed,
        agent: &agent,
    };
    let events_line = format!("{} events, {} dropped", snap.events, drops.total);
    // Every sink's summary, whatever the format: JSON lines writes its summary lines then, and
    // the file outputs (--flamegraph) their files.
    if !output_failed
        && let Err(e) = sinks.iter_mut().try_for_each(|s| {
            s.summary(&summary)
                .with_context(|| format!("writing {} failed", s.describe()))
        })
    {
        say(format_args!("error: {e:#}"));
        output_failed = true;
    }
    let written: Result<()> = if output_failed {
        Err(anyhow::anyhow!("the output had already failed"))
    } else {
        match (run_format, summary_out.as_mut()) {
            (Format::Jsonl, _) => {
                say(&events_line);
                Ok(())
            }
            (Format::Terminal | Format::Dashboard, Some(out)) => out
                .write_all(text.as_bytes())
                .and_then(|()| out.flush())
                .map_err(Into::into),
            _ => {
                say(&events_line);
                Ok(())
            }
        }
    };
    if let Err(e) = written {
        if !output_failed {
            say(format_args!("error: writing the summary to {} failed: {e}", dest));
        }
        output_failed = true;
    }
    for line in terminal::evicted_lines(&snap) {
        say(line);
    }
    if output_failed {
        // The summary still reaches the person: on stderr.
        eprint!("{text}");
    }
    say(at.stats());
    // Detaching: ~0.4 s with uprobe-multi links (see attach/multi.rs).
    drop(at);
    if output_failed {
        return Ok(1);
    }
    Ok(exit_status.map_or(0, spawn::Spawned::exit_code))
}
