//! The argument groups that `record`, `top` and `agent` share, flattened into each (a flag is
//! declared once, with its help and range), and the one conversion of a command's groups
//! into [`RecordOptions`]. Where a default differs by command (the sampling rate, the probes'
//! rate limit, the scrape interval), one macro declares the group and each command gets its
//! own instance.

use std::path::PathBuf;
use std::time::Duration;

use crate::sampler::{Backend, RecordOptions};

/// The highest `--rate` any backend takes (the BPF backend's perf events; the memory backend
/// samples at most [`crate::sampler::memory::MAX_RATE_HZ`] and says so).
pub(crate) const MAX_RATE_HZ: u32 = 20_000;

/// A struct of one flattened group with a command's own defaults: clap keeps a default's
/// text in one static per field, so a const-generic group would give every command the first
/// one's default; each command's group is its own type, declared here once.
macro_rules! sampling_args {
    ($(#[$m:meta])* $name:ident, $hz:expr) => {
        $(#[$m])*
        #[derive(Debug, Clone, clap::Args)]
        pub struct $name {
            /// Samples per second per CPU (1 to 20000).
            #[arg(long, short, default_value_t = $hz,
                  value_parser = clap::value_parser!(u32).range(1..=MAX_RATE_HZ as i64))]
            pub rate: u32,
        }
    };
}

sampling_args!(
    /// `--rate` of `record` and `top`.
    SamplingArgs,
    99
);
sampling_args!(
    /// `--rate` of `agent` (low: it runs all the time).
    AgentSamplingArgs,
    19
);
sampling_args!(
    /// `--rate` of `demo`.
    DemoSamplingArgs,
    499
);

/// Which engines to find and follow (`--vllm`), besides processes given by `--pid`.
#[derive(Debug, Clone, clap::Args)]
pub struct VllmArgs {
    /// Find every vLLM engine on this host (API servers, engine cores, workers) and watch all
    /// of them, with their roles, their `/metrics` series and the default probes
    /// (MessageQueue.enqueue/dequeue, Worker.execute_model, EngineCore.step, the
    /// router-replay store's put and _evict_to_fit). Processes that start later are added.
    #[arg(long)]
    pub vllm: bool,
    /// With --vllm: scrape this URL instead of the metrics URL found from the API server.
    /// Without --vllm: the `--pid` targets' own Prometheus metrics, scraped as one engine of
    /// those processes (an engine that is not vLLM, or any process that serves a running-
    /// requests gauge): the report's engine figures and per-request growth read them.
    #[arg(long, value_name = "URL")]
    pub metrics_url: Option<String>,
    /// With --vllm: only the engine whose API server (or offline `LLM` script) is PID.
    #[arg(long, value_name = "PID", requires = "vllm")]
    pub engine_pid: Option<i32>,
    /// With --vllm: only the engines whose API server serves on PORT (its metrics URL's port),
    /// followed across restarts (a restarted engine has new pids, the same port); repeat it
    /// for several engines.
    #[arg(long, value_name = "PORT", requires = "vllm")]
    pub engine_port: Vec<u16>,
}

/// How `--vllm` engines are scraped and probed, as [`record_options`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct Scraping {
    pub interval_s: f64,
    pub default_probes: bool,
}

macro_rules! engine_args {
    ($(#[$m:meta])* $name:ident, $seconds:expr) => {
        $(#[$m])*
        #[derive(Debug, Clone, clap::Args)]
        pub struct $name {
            /// With --vllm or --metrics-url: seconds between scrapes of the engine's /metrics into the
            /// recording.
            #[arg(long, default_value_t = $seconds)]
            pub scrape_interval: f64,
            /// With --vllm: do not add the default probes.
            #[arg(long)]
            pub no_default_probes: bool,
        }

        impl $name {
            pub fn scraping(&self) -> Scraping {
                Scraping {
                    interval_s: self.scrape_interval,
                    default_probes: !self.no_default_probes,
                }
            }
        }
    };
}

engine_args!(
    /// `record`'s scrapes of `--vllm` engines.
    EngineArgs,
    1.0
);
engine_args!(
    /// `agent`'s scrapes of `--vllm` engines (into a recording kept for days).
    AgentEngineArgs,
    10.0
);

/// What is traced besides on-CPU samples, and with which backend.
#[derive(Debug, Clone, clap::Args)]
pub struct TraceArgs {
    /// bpf (kernel-side stack walks), memory (user-space polling), or auto.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// Do not trace off-CPU intervals (sched_switch).
    #[arg(long)]
    pub no_offcpu: bool,
    /// Do not time GIL waits (futex tracing).
    #[arg(long)]
    pub no_gil: bool,
    /// Do not time GC pauses (hardware write watchpoint on the GC state).
    #[arg(long)]
    pub no_gc: bool,
    /// Native (C/C++) frames merged with the Python frames, and kernel frames (bpf backend):
    /// the kernel copies the user registers and up to 16 KiB of stack with each sample and
    /// blocking switch-out, unwound here from the libraries' .eh_frame.
    #[arg(long)]
    pub native: bool,
    /// Kernel frames only (on samples and blocking switch-outs), without the user stack copy.
    #[arg(long)]
    pub kernel_stacks: bool,
}

/// `--probe-budget`'s default, percent: [`crate::sampler::DEFAULT_PROBE_BUDGET`].
pub(crate) const DEFAULT_PROBE_BUDGET_PCT: f64 = crate::sampler::DEFAULT_PROBE_BUDGET * 100.0;

/// The functions to time and what that may cost, as [`record_options`] takes it.
#[derive(Debug, Clone)]
pub struct Probing {
    pub specs: Vec<String>,
    pub max_rate: u64,
    /// The share of each thread's time its debug traps may take (0: no budget).
    pub budget: f64,
}

/// `--probe-budget PCT` as a share of the time (`--exact-probes`: none).
fn budget_share(pct: f64, exact: bool) -> anyhow::Result<f64> {
    if exact {
        return Ok(0.0);
    }
    anyhow::ensure!(
        pct.is_finite() && (0.0..100.0).contains(&pct),
        "--probe-budget must be a percentage from 0 (no budget: probes watched all the time) to under 100, such as 2"
    );
    Ok(pct / 100.0)
}

macro_rules! probe_args {
    ($(#[$m:meta])* $name:ident, $max_rate:expr) => {
        $(#[$m])*
        #[derive(Debug, Clone, clap::Args)]
        pub struct $name {
            /// Time every call of a function: `[FILE:]QUALNAME`, e.g. `MessageQueue.enqueue` or
            /// `shm_broadcast.py:MessageQueue.dequeue` (repeat for several). Exact (a hardware
            /// watchpoint on the function's code object's reference count, which every call's
            /// frame push and pop write) where possible, sampled otherwise; the recording says
            /// which.
            #[arg(long = "probe", value_name = "[FILE:]QUALNAME")]
            pub probes: Vec<String>,
            /// An exactly probed function called more often than this (per second) switches to
            /// the sampled method: each exact call costs two debug traps, whose cost is
            /// calibrated at start. 0 = never.
            #[arg(long, default_value_t = $max_rate)]
            pub probe_max_rate: u64,
            /// Keep each thread's debug traps under this percentage of its wall time by
            /// watching its exact probes only part of the time (in turns, as when they
            /// outnumber the debug registers): counts are then scaled and marked `~`,
            /// percentiles come from the calls watched, and every figure carries its coverage.
            /// Each exact call costs two traps, whose cost is measured at start (a few µs in a
            /// VM, ~1 µs on bare metal). An engine stepping every 10-50 ms stays under the
            /// default with every call watched. 0 = watch all the time (`--exact-probes`).
            #[arg(long, value_name = "PCT", default_value_t = DEFAULT_PROBE_BUDGET_PCT)]
            pub probe_budget: f64,
            /// Watch every call of every exact probe, whatever it costs the target (the same
            /// as `--probe-budget 0`).
            #[arg(long, conflicts_with = "probe_budget")]
            pub exact_probes: bool,
        }

        impl $name {
            pub fn probing(&self) -> anyhow::Result<Probing> {
                Ok(Probing {
                    specs: self.probes.clone(),
                    max_rate: self.probe_max_rate,
                    budget: budget_share(self.probe_budget, self.exact_probes)?,
                })
            }
        }
    };
}

probe_args!(
    /// The probes of `record` and `top`.
    ProbeArgs,
    2000
);
probe_args!(
    /// The probes of `agent` (a lower rate limit: it runs all the time).
    AgentProbeArgs,
    500
);

/// A command's groups, as [`record_options`] reads them.
pub struct Groups<'a> {
    pub pids: Vec<i32>,
    pub output: PathBuf,
    pub rate: u32,
    pub vllm: &'a VllmArgs,
    /// None: the command has no such flags, and `record`'s defaults hold.
    pub scraping: Option<Scraping>,
    pub trace: &'a TraceArgs,
    pub probing: Probing,
}

/// The one conversion of the command line into what the recorder takes.
pub fn record_options(g: Groups<'_>) -> anyhow::Result<RecordOptions> {
    let mut o = RecordOptions::new(g.pids, g.output);
    o.rate_hz = g.rate;
    o.vllm = g.vllm.vllm;
    o.metrics_url = g.vllm.metrics_url.clone();
    o.vllm_root_pid = g.vllm.engine_pid;
    o.vllm_port = g.vllm.engine_port.clone();
    if let Some(e) = g.scraping {
        anyhow::ensure!(
            e.interval_s.is_finite() && e.interval_s >= 0.0,
            "--scrape-interval must be a number of seconds, such as 1"
        );
        o.scrape_interval = Duration::from_secs_f64(e.interval_s.max(0.01));
        o.default_probes = e.default_probes;
    }
    o.backend = g.trace.backend;
    o.offcpu = !g.trace.no_offcpu;
    o.gil = !g.trace.no_gil;
    o.gc = !g.trace.no_gc;
    o.native = crate::native::NativeOptions {
        kernel: g.trace.native || g.trace.kernel_stacks,
        user: g.trace.native,
    };
    o.probes = g.probing.specs;
    o.probe_max_rate = g.probing.max_rate;
    o.probe_budget = g.probing.budget;
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        sampling: SamplingArgs,
        #[command(flatten)]
        vllm: VllmArgs,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        trace: TraceArgs,
        #[command(flatten)]
        probes: ProbeArgs,
    }

    fn opts(args: &[&str]) -> anyhow::Result<RecordOptions> {
        let t = T::try_parse_from(std::iter::once("t").chain(args.iter().copied()))?;
        record_options(Groups {
            pids: vec![1],
            output: "x.esrec".into(),
            rate: t.sampling.rate,
            vllm: &t.vllm,
            scraping: Some(t.engine.scraping()),
            trace: &t.trace,
            probing: t.probes.probing()?,
        })
    }

    #[test]
    fn no_flags_give_records_defaults() {
        let o = opts(&[]).unwrap();
        let d = RecordOptions::new(vec![1], "x.esrec".into());
        assert_eq!(o.rate_hz, d.rate_hz);
        assert_eq!(o.probe_max_rate, d.probe_max_rate);
        assert_eq!(o.probe_budget, d.probe_budget);
        assert_eq!(o.scrape_interval, d.scrape_interval);
        assert_eq!(
            (o.offcpu, o.gil, o.gc, o.default_probes, o.vllm),
            (d.offcpu, d.gil, d.gc, d.default_probes, d.vllm)
        );
        assert_eq!(o.native, d.native);
    }

    #[test]
    fn every_flag_reaches_the_options() {
        let o = opts(&[
            "--rate",
            "499",
            "--vllm",
            "--metrics-url",
            "http://h/metrics",
            "--engine-pid",
            "7",
            "--engine-port",
            "8000",
            "--scrape-interval",
            "2.5",
            "--no-default-probes",
            "--backend",
            "memory",
            "--no-offcpu",
            "--no-gil",
            "--no-gc",
            "--native",
            "--probe",
            "a.f",
            "--probe",
            "b.g",
            "--probe-max-rate",
            "5",
            "--probe-budget",
            "2",
        ])
        .unwrap();
        assert_eq!(o.rate_hz, 499);
        assert!(o.vllm && !o.default_probes && !o.offcpu && !o.gil && !o.gc);
        assert_eq!(o.metrics_url.as_deref(), Some("http://h/metrics"));
        assert_eq!(o.vllm_root_pid, Some(7));
        assert_eq!(o.vllm_port, [8000]);
        assert_eq!(o.scrape_interval, Duration::from_millis(2500));
        assert_eq!(o.backend, Backend::Memory);
        assert!(o.native.user && o.native.kernel);
        assert_eq!(o.probes, ["a.f", "b.g"]);
        assert_eq!(o.probe_max_rate, 5);
        assert!((o.probe_budget - 0.02).abs() < 1e-12);
        assert_eq!(opts(&["--exact-probes"]).unwrap().probe_budget, 0.0);
        let k = opts(&["--kernel-stacks"]).unwrap().native;
        assert!(k.kernel && !k.user);
    }

    #[test]
    fn the_parser_refuses_what_the_recorder_cannot_do() {
        for bad in [
            &["--rate", "0"][..],
            &["--rate", "20001"],
            &["--engine-pid", "7"],
            &["--exact-probes", "--probe-budget", "1"],
        ] {
            assert!(opts(bad).is_err(), "{bad:?}");
        }
        assert!(opts(&["--rate", "20000"]).is_ok());
        let e = opts(&["--probe-budget", "100"]).unwrap_err().to_string();
        assert!(e.contains("--probe-budget"), "{e}");
    }
}
