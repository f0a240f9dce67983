//! The `enginescope` command line: the commands ([`Cmd`]), the argument groups they share
//! ([`args`]: targets, sampling, tracing, probes, each declared once and flattened), one
//! function per command, and the advice printed with an error. `main` parses and calls
//! [`run`].

pub mod args;
mod commands;

use clap::{Parser, Subcommand};

pub use args::{record_options, Groups, Probing, Scraping, TraceArgs, VllmArgs};
pub use commands::AgentCmd;

#[derive(Parser)]
#[command(
    name = "enginescope",
    version,
    about = "See where a running Python inference engine spends its CPU time, from outside"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Print every thread's Python stack once, without pausing the process.
    Dump(commands::DumpCmd),
    /// Show what enginescope detects in a process and what this machine allows.
    Doctor(commands::DoctorCmd),
    /// Sample every thread of running Python processes and write a recording (.esrec).
    Record(commands::RecordCmd),
    /// Run a bundled sample workload and show what enginescope sees in it.
    Demo(commands::DemoCmd),
    /// Draw a recording as a flamegraph SVG (docs/views.md).
    Flame(commands::FlameCmd),
    /// Rewrite a recording of raw events in the agent's aggregated form (events added up per
    /// interval; docs/recording-format.md): to compact old recordings, or to compare views of
    /// the two forms of one run.
    Aggregate(commands::AggregateCmd),
    /// Convert a recording for other tools: folded, pprof, speedscope, chrome (docs/views.md).
    Export(commands::ExportCmd),
    /// Live dashboard: per process and thread CPU, GIL, GC, off-CPU, top functions, GIL blame,
    /// function latency and engine metrics over a sliding window (docs/top.md).
    Top(commands::TopCmd),
    /// Summarize a recording: CPU per thread, top functions, engines, per-window timeline,
    /// function latency, API-server stalls (docs/report-schema.md).
    Report(commands::ReportCmd),
    /// Find the vLLM engines on this host: API server, engine cores, workers, metrics URL.
    Discover(commands::DiscoverCmd),
    /// Compare two recordings: per-thread, per-function, probe and engine changes against
    /// each run's own noise, and a differential flamegraph (docs/views.md).
    Diff(crate::views::diff::DiffArgs),
    /// Profile continuously at a low rate with bounded memory and disk: Prometheus metrics on
    /// --listen, rotating recordings in --dir that report/flame/diff read (docs/deployment.md).
    Agent(AgentCmd),
}

/// Run one command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Dump(a) => a.run(),
        Cmd::Doctor(a) => a.run(),
        Cmd::Record(a) => a.run(),
        Cmd::Demo(a) => a.run(),
        Cmd::Flame(a) => a.run(),
        Cmd::Aggregate(a) => a.run(),
        Cmd::Export(a) => a.run(),
        Cmd::Top(a) => a.run(),
        Cmd::Report(a) => a.run(),
        Cmd::Discover(a) => a.run(),
        Cmd::Diff(a) => crate::views::diff::run(&a),
        Cmd::Agent(a) => a.run(),
    }
}

/// The error as printed, with what to do about it where the kind of error says.
pub fn advise(e: &anyhow::Error) -> String {
    use crate::cpython::AttachError;
    let mut msg = format!("error: {e:#}");
    if e.downcast_ref::<crate::record::format::DiskFull>()
        .is_some()
    {
        msg.push_str("\nhint: free space on that filesystem, or write the recording elsewhere with -o; `enginescope report` reads what was written");
    }
    if let Some(a) = e.downcast_ref::<AttachError>() {
        let hint = match a {
            AttachError::Gone(_) => "check the PID (`ps -ef | grep python`); the process may have exited",
            AttachError::Permission(_) => "",
            AttachError::NotPython { .. } => "point --pid at the Python process itself (for vLLM: the API server, EngineCore or worker PIDs), not a shell or launcher",
            AttachError::Unsupported { .. } => "supported: CPython 3.10 to 3.15 with the GIL (not free-threaded builds)",
            AttachError::UnknownVersion(_) | AttachError::DebugOffsets { .. } => {
                "please report this with the output of `enginescope doctor --pid PID`"
            }
            AttachError::Read { .. } | AttachError::Proc { .. } => "the process may be exiting; try again",
        };
        if !hint.is_empty() {
            msg.push_str(&format!("\nhint: {hint}"));
        }
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        // clap's own checks: every `requires`/`conflicts_with` names an argument of its
        // command, no flag is declared twice in one command.
        Cli::command().debug_assert();
    }

    #[test]
    fn shared_groups_keep_each_commands_defaults() {
        let parse = |a: &[&str]| Cli::try_parse_from(a.iter().copied()).unwrap().cmd;
        let Cmd::Record(r) = parse(&["es", "record", "--pid", "1"]) else {
            panic!()
        };
        assert_eq!(r.sampling.rate, 99);
        assert_eq!(r.probes.probe_max_rate, 2000);
        assert_eq!(r.engine.scraping().interval_s, 1.0);
        let Cmd::Agent(a) = parse(&["es", "agent", "--pid", "1"]) else {
            panic!()
        };
        assert_eq!(a.sampling.rate, 19);
        assert_eq!(a.probes.probe_max_rate, 500);
        assert_eq!(a.engine.scraping().interval_s, 10.0);
        let Cmd::Top(t) = parse(&["es", "top", "--pid", "1"]) else {
            panic!()
        };
        assert_eq!(t.sampling.rate, 99);
        let Cmd::Demo(d) = parse(&["es", "demo"]) else {
            panic!()
        };
        assert_eq!(d.sampling.rate, 499);
        // A target is required, but --vllm (and for top, --replay) is one.
        for a in [
            &["es", "record"][..],
            &["es", "top"],
            &["es", "agent"],
            &["es", "record", "--engine-pid", "3"],
        ] {
            assert!(Cli::try_parse_from(a.iter().copied()).is_err(), "{a:?}");
        }
        for a in [
            &["es", "record", "--vllm"][..],
            &["es", "top", "--vllm"],
            &["es", "top", "--replay", "x.esrec"],
            &["es", "agent", "--vllm"],
        ] {
            assert!(Cli::try_parse_from(a.iter().copied()).is_ok(), "{a:?}");
        }
    }
}
