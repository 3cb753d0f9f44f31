//! Command line (hand-parsed: the crate has no argument-parser dependency).

use std::path::PathBuf;
use std::time::Duration;

pub const USAGE: &str = "\
usage: cuda-ground-truth [--out PATH] [--libcuda PATH] [--iters N] [--elems N] [--device N]
                         [--wait-start FILE] [--wait-timeout-s S] [--pause-before-exit-ms MS]

A CUDA driver-API workload whose every call is known (ground truth for gpu-observer).

  --out PATH                 write what was done as JSON (pid, window, calls, bytes, kernels,
                             generic_copies, leaks, hypotheses)
  --libcuda PATH             driver library to dlopen (default libcuda.so.1)
  --iters N                  loop iterations (default 200)
  --elems N                  32-bit elements per buffer (default 1048576 = 4 MiB buffers)
  --device N                 device ordinal (default 0)
  --wait-start FILE          after the context exists, wait for FILE to exist before the
                             measured work (poll every 10 ms)
  --wait-timeout-s S         give up waiting after S seconds (default 60; exit 3)
  --pause-before-exit-ms MS  stay alive MS ms after the work (default 0)

exit: 0 every hypothesis held; 1 one failed or a driver call failed; 2 usage error, no driver
library or no usable GPU; 3 --wait-start file never appeared";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Args {
    pub out: Option<PathBuf>,
    pub libcuda: String,
    pub iters: u32,
    pub elems: u32,
    pub device: i32,
    pub wait_start: Option<PathBuf>,
    pub wait_timeout: Duration,
    pub pause_before_exit: Duration,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            out: None,
            libcuda: "libcuda.so.1".into(),
            iters: 200,
            elems: 1 << 20,
            device: 0,
            wait_start: None,
            wait_timeout: Duration::from_secs(60),
            pause_before_exit: Duration::ZERO,
        }
    }
}

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    Run(Args),
    Help,
}

fn number<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{flag}: not a valid number: {v:?}"))
}

/// Parses the arguments after the program name. Accepts `--flag VALUE` and `--flag=VALUE`.
pub fn parse<I: IntoIterator<Item = String>>(argv: I) -> Result<Parsed, String> {
    let mut a = Args::default();
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Parsed::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if !flag.starts_with("--") {
            return Err(format!("unexpected argument {arg:?}"));
        }
        let known = [
            "--out",
            "--libcuda",
            "--iters",
            "--elems",
            "--device",
            "--wait-start",
            "--wait-timeout-s",
            "--pause-before-exit-ms",
        ];
        if !known.contains(&flag.as_str()) {
            return Err(format!("unknown option {flag}"));
        }
        let v = match inline {
            Some(v) => v,
            None => it.next().ok_or_else(|| format!("{flag} needs a value"))?,
        };
        if v.is_empty() {
            return Err(format!("{flag} needs a non-empty value"));
        }
        match flag.as_str() {
            "--out" => a.out = Some(PathBuf::from(v)),
            "--libcuda" => a.libcuda = v,
            "--iters" => a.iters = number(&flag, &v)?,
            "--elems" => {
                a.elems = number(&flag, &v)?;
                if a.elems == 0 || a.elems > (1 << 28) {
                    return Err(format!("--elems must be between 1 and {}", 1u32 << 28));
                }
            }
            "--device" => a.device = number(&flag, &v)?,
            "--wait-start" => a.wait_start = Some(PathBuf::from(v)),
            "--wait-timeout-s" => a.wait_timeout = Duration::from_secs(number(&flag, &v)?),
            "--pause-before-exit-ms" => a.pause_before_exit = Duration::from_millis(number(&flag, &v)?),
            _ => unreachable!("checked against `known`"),
        }
    }
    Ok(Parsed::Run(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Parsed, String> {
        parse(args.iter().map(|s| s.to_string()))
    }

    fn run(args: &[&str]) -> Args {
        match p(args) {
            Ok(Parsed::Run(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let a = run(&[]);
        assert_eq!(a, Args::default());
        assert_eq!((a.iters, a.elems, a.libcuda.as_str()), (200, 1 << 20, "libcuda.so.1"));
        assert_eq!(a.wait_timeout, Duration::from_secs(60));
        assert!(a.out.is_none() && a.wait_start.is_none());
    }

    #[test]
    fn every_option_both_spellings() {
        let a = run(&[
            "--out",
            "/tmp/x.json",
            "--libcuda=/opt/lib/libcuda.so.1",
            "--iters",
            "5",
            "--elems=1000",
            "--device",
            "1",
            "--wait-start",
            "/tmp/go",
            "--wait-timeout-s=7",
            "--pause-before-exit-ms",
            "250",
        ]);
        assert_eq!(a.out.as_deref(), Some(std::path::Path::new("/tmp/x.json")));
        assert_eq!(a.libcuda, "/opt/lib/libcuda.so.1");
        assert_eq!((a.iters, a.elems, a.device), (5, 1000, 1));
        assert_eq!(a.wait_start.as_deref(), Some(std::path::Path::new("/tmp/go")));
        assert_eq!(a.wait_timeout, Duration::from_secs(7));
        assert_eq!(a.pause_before_exit, Duration::from_millis(250));
    }

    #[test]
    fn help() {
        assert_eq!(p(&["--iters", "3", "--help"]), Ok(Parsed::Help));
        assert_eq!(p(&["-h"]), Ok(Parsed::Help));
    }

    #[test]
    fn errors_are_messages_not_panics() {
        assert!(p(&["--iters"]).unwrap_err().contains("needs a value"));
        assert!(p(&["--iters", "many"]).unwrap_err().contains("not a valid number"));
        assert!(p(&["--iters", "-1"]).is_err());
        assert!(p(&["--elems", "0"]).unwrap_err().contains("between"));
        assert!(p(&["--bogus", "1"]).unwrap_err().contains("unknown option"));
        assert!(p(&["stray"]).unwrap_err().contains("unexpected argument"));
        assert!(p(&["--out="]).unwrap_err().contains("non-empty"));
    }
}
