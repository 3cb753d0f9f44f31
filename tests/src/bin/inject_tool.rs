//! `inject_tool PID LIB [on|off]`: runs gpu-observer's injection (`attach::inject`) alone,
//! without eBPF, and prints one JSON line with the outcome; `on`/`off` then writes the
//! library's control word. The tests use it for what needs no observer: the refusals, and
//! SIGKILL at each step (`GPU_OBSERVER_INJECT_DIE_AT`).

use gpu_observer::attach::inject::{self, Library, Outcome};
use serde_json::json;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: inject_tool PID LIB [on|off]");
        std::process::exit(2);
    }
    let pid: u32 = args[1].parse().expect("a pid");
    let lib = match Library::load(std::path::Path::new(&args[2])) {
        Ok(l) => l,
        Err(e) => {
            println!("{}", json!({"outcome": "bad_library", "message": e}));
            std::process::exit(1);
        }
    };
    // On a thread of its own, as the observer runs it (the tracer is a thread).
    let result = std::thread::spawn(move || inject::inject(pid, &lib))
        .join()
        .expect("the injection thread");
    let line = match &result {
        Ok(Outcome::Injected(i)) => json!({
            "outcome": "injected",
            "tid": i.tid,
            "pause_us": i.pause.as_micros() as u64,
            "diverted_us": i.diverted.as_micros() as u64,
        }),
        Ok(Outcome::AlreadyLoaded { late }) => json!({"outcome": "already_loaded", "late": late}),
        Err(r) => json!({"outcome": "refused", "reason": r.reason.as_str(), "message": r.message}),
    };
    println!("{line}");
    if let Some(word) = args.get(3)
        && result.is_ok()
        && let Err(e) = inject::set_control(
            pid,
            if word == "on" {
                gpu_observer_common::cupti::control::ON
            } else {
                gpu_observer_common::cupti::control::OFF
            },
        )
    {
        println!("{}", json!({"outcome": "control_failed", "message": e}));
        std::process::exit(1);
    }
}
