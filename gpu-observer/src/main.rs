//! The `gpu-observer` command: parses the command line and runs the library's `observe` (or
//! `devices`); everything else lives in the library (src/lib.rs).

use clap::Parser;
use gpu_observer::{
    cli::{Cli, Command},
    export, observe, say,
};

fn main() {
    let cli = Cli::parse();
    if matches!(cli.command, Some(Command::Devices)) {
        std::process::exit(match export::devices::print(&cli) {
            Ok(()) => 0,
            Err(e) => {
                say(format_args!("error: {e:#}"));
                1
            }
        });
    }
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            say(format_args!("error: cannot start the runtime: {e}"));
            std::process::exit(1);
        }
    };
    match rt.block_on(observe::observe(cli)) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            say(format_args!("error: {e:#}"));
            std::process::exit(1);
        }
    }
}
