use std::process::ExitCode;

use clap::Parser;
use enginescope::cli::{advise, run, Cli};

fn main() -> ExitCode {
    let _s = enginescope::sys::steps::step("main_start");
    drop(_s);
    let cli = Cli::parse();
    let out = run(cli);
    enginescope::sys::steps::note("main_end", 0);
    match out {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", advise(&e));
            ExitCode::FAILURE
        }
    }
}
