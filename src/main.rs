use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use enginescope::cpython::{AttachError, PythonProcess};
use enginescope::{doctor, dump};

#[derive(Parser)]
#[command(
    name = "enginescope",
    version,
    about = "See where a running Python inference engine spends its CPU time, from outside"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print every thread's Python stack once, without pausing the process.
    Dump {
        #[arg(long, short)]
        pid: i32,
        /// JSON output (schema: docs/dump-json.md).
        #[arg(long)]
        json: bool,
    },
    /// Show what enginescope detects in a process and what this machine allows.
    Doctor {
        #[arg(long, short)]
        pid: Option<i32>,
        #[arg(long)]
        json: bool,
        /// Print the built-in offset table for a version (3.10, 3.11, 3.12) as name=value lines,
        /// for checking against the CPython headers (tools/pyoffsets.c).
        #[arg(long, value_name = "VERSION")]
        offsets_table: Option<String>,
    },
    /// Sample every thread of running Python processes and write a recording (.esrec).
    Record {
        /// Target process ids (comma-separated or repeated).
        #[arg(long, short, value_delimiter = ',', required_unless_present = "vllm")]
        pid: Vec<i32>,
        /// Find every vLLM engine on this host (API servers, engine cores, workers) and record
        /// all of them, with their roles, their `/metrics` series and the default probes
        /// (MessageQueue.enqueue/dequeue, Worker.execute_model, EngineCore.step, the
        /// router-replay store's put and _evict_to_fit). Processes that start later are added.
        #[arg(long)]
        vllm: bool,
        /// With --vllm: scrape this URL instead of the metrics URL found from the API server.
        #[arg(long, value_name = "URL")]
        metrics_url: Option<String>,
        /// With --vllm: seconds between metric scrapes.
        #[arg(long, default_value_t = 1.0)]
        scrape_interval: f64,
        /// With --vllm: do not add the default probes.
        #[arg(long)]
        no_default_probes: bool,
        /// With --vllm: only the engine whose API server (or offline `LLM` script) is PID.
        #[arg(long, value_name = "PID", requires = "vllm")]
        engine_pid: Option<i32>,
        /// Seconds to record; without it, until Ctrl-C.
        #[arg(long, short)]
        duration: Option<f64>,
        /// Samples per second per CPU.
        #[arg(long, short, default_value_t = 99)]
        rate: u32,
        /// Output file.
        #[arg(long, short, default_value = "enginescope.esrec")]
        output: std::path::PathBuf,
        #[command(flatten)]
        trace: TraceArgs,
        /// Time every call of a function: `[FILE:]QUALNAME`, e.g. `MessageQueue.enqueue` or
        /// `shm_broadcast.py:MessageQueue.dequeue` (repeat for several). Exact (a hardware
        /// watchpoint on the function's code object's reference count, which every call's
        /// frame push and pop write) where possible, sampled otherwise; the recording says
        /// which.
        #[arg(long = "probe", value_name = "[FILE:]QUALNAME")]
        probes: Vec<String>,
        /// An exactly probed function called more often than this (per second) switches to
        /// the sampled method: each exact call costs two debug traps (~30 µs here). 0 = never.
        #[arg(long, default_value_t = 2000)]
        probe_max_rate: u64,
        /// Keep each thread's debug traps under this percentage of its wall time by watching
        /// its exact probes only part of the time (in turns, as when they outnumber the debug
        /// registers): counts are then scaled and marked `~`, percentiles come from the
        /// calls watched, and every figure carries its coverage. Each exact call costs two
        /// traps, whose cost is measured at start (a few µs in a VM, ~1 µs on bare metal).
        /// An engine stepping every 10-50 ms stays under the default with every call
        /// watched. 0 = watch all the time (`--exact-probes`).
        #[arg(long, value_name = "PCT", default_value_t = DEFAULT_PROBE_BUDGET_PCT)]
        probe_budget: f64,
        /// Watch every call of every exact probe, whatever it costs the target (the same as
        /// `--probe-budget 0`).
        #[arg(long, conflicts_with = "probe_budget")]
        exact_probes: bool,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        cost: enginescope::sampler::cost::CostArgs,
    },
    /// Run a bundled sample workload and show what enginescope sees in it.
    Demo {
        /// Python interpreter for the sample engine (CPython 3.10-3.15); default: pyenv's
        /// newest 3.12, else python3.
        #[arg(long)]
        python: Option<String>,
        /// Where to write the recording, report, flamegraphs and the engine's own truth;
        /// default enginescope-demo (enginescope-demo-fixed with --fixed).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// Seconds to record (without a terminal; with one, until you press q).
        #[arg(long, default_value_t = 15.0)]
        seconds: f64,
        /// Run the engine with its three fixes applied; writes the diff against the slow run
        /// when ./enginescope-demo/demo.esrec exists.
        #[arg(long)]
        fixed: bool,
        /// Record and report even when stdout is a terminal (no live dashboard).
        #[arg(long)]
        no_tui: bool,
        /// Samples per second.
        #[arg(long, default_value_t = 499)]
        rate: u32,
        /// With --fixed: the slow run's recording to diff against (default:
        /// enginescope-demo/demo.esrec).
        #[arg(long, value_name = "ESREC")]
        baseline: Option<std::path::PathBuf>,
        /// Record without native and kernel frames (the demo records them by default).
        #[arg(long)]
        no_native: bool,
    },
    /// Draw a recording as a flamegraph SVG (docs/views.md).
    Flame {
        /// Recording (.esrec).
        file: std::path::PathBuf,
        /// Output SVG (`-` for stdout).
        #[arg(long, short)]
        output: std::path::PathBuf,
        #[command(flatten)]
        filter: enginescope::views::FilterArgs,
        /// Off-CPU time (where threads waited) instead of on-CPU time.
        #[arg(long, conflicts_with = "gil_blame")]
        offcpu: bool,
        /// GIL blame: the time threads waited for the GIL, by the holder thread and the
        /// holder's stack when the wait began (the filter selects waiters).
        #[arg(long)]
        gil_blame: bool,
    },
    /// Rewrite a recording of raw events in the agent's aggregated form (events added up per
    /// interval; docs/recording-format.md): to compact old recordings, or to compare views of
    /// the two forms of one run.
    Aggregate {
        /// Recording (.esrec) of raw events.
        file: std::path::PathBuf,
        /// The aggregated recording to write.
        #[arg(long, short)]
        output: std::path::PathBuf,
        /// Seconds of each interval.
        #[arg(long, default_value_t = 10.0)]
        profile_seconds: f64,
    },
    /// Convert a recording for other tools: folded, pprof, speedscope, chrome (docs/views.md).
    Export {
        /// Recording (.esrec).
        file: std::path::PathBuf,
        #[arg(long, short, value_enum)]
        format: enginescope::views::ExportFormat,
        /// Output file (`-` for stdout).
        #[arg(long, short)]
        output: std::path::PathBuf,
        #[command(flatten)]
        filter: enginescope::views::FilterArgs,
    },
    /// Live dashboard: per process and thread CPU, GIL, GC, off-CPU, top functions, GIL blame,
    /// function latency and engine metrics over a sliding window (docs/top.md).
    Top {
        /// Target process ids (comma-separated or repeated).
        #[arg(long, short, value_delimiter = ',', required_unless_present_any = ["replay", "vllm"])]
        pid: Vec<i32>,
        /// Every vLLM engine on this host (as `record --vllm`): processes by engine and role,
        /// engine metrics, default probes.
        #[arg(long)]
        vllm: bool,
        /// With --vllm: scrape this URL instead of the metrics URL found.
        #[arg(long, value_name = "URL")]
        metrics_url: Option<String>,
        /// With --vllm: only the engine whose API server (or offline script) is PID.
        #[arg(long, value_name = "PID", requires = "vllm")]
        engine_pid: Option<i32>,
        /// Time every call of a function (`[FILE:]QUALNAME`, repeatable), as `record --probe`.
        #[arg(long = "probe", value_name = "[FILE:]QUALNAME")]
        probes: Vec<String>,
        /// Samples per second per CPU.
        #[arg(long, short, default_value_t = 99)]
        rate: u32,
        /// Seconds the dashboard's figures cover (a sliding window).
        #[arg(long, short, default_value_t = 10.0)]
        window: f64,
        /// Keep the recording in this file (a temporary file is used and removed otherwise).
        #[arg(long, short)]
        output: Option<std::path::PathBuf>,
        /// bpf (kernel-side stack walks), memory (user-space polling), or auto.
        #[arg(long, value_enum, default_value = "auto")]
        backend: enginescope::sampler::Backend,
        /// Replay a recording (.esrec) instead, paced by its event time.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["pid", "output"])]
        replay: Option<std::path::PathBuf>,
    },
    /// Summarize a recording: CPU per thread, top functions, engines, per-window timeline,
    /// function latency, API-server stalls (docs/report-schema.md).
    Report {
        /// Recording (.esrec).
        file: std::path::PathBuf,
        #[arg(long, short, value_enum, default_value = "md")]
        format: enginescope::views::ReportFormat,
        /// Output file; stdout when absent.
        #[arg(long, short)]
        output: Option<std::path::PathBuf>,
        #[command(flatten)]
        filter: enginescope::views::FilterArgs,
        #[command(flatten)]
        opts: enginescope::views::report::ReportArgs,
    },
    /// Find the vLLM engines on this host: API server, engine cores, workers, metrics URL.
    Discover {
        #[arg(long)]
        json: bool,
        /// Metrics URL to use instead of the one found (or of an engine on another host).
        #[arg(long, value_name = "URL")]
        metrics_url: Option<String>,
    },
    /// Compare two recordings: per-thread, per-function, probe and engine changes against
    /// each run's own noise, and a differential flamegraph (docs/views.md).
    Diff(enginescope::views::diff::DiffArgs),
    /// Profile continuously at a low rate with bounded memory and disk: Prometheus metrics on
    /// --listen, rotating recordings in --dir that report/flame/diff read (docs/deployment.md).
    Agent(AgentArgs),
}

#[derive(clap::Args)]
struct AgentArgs {
    /// Target process ids (comma-separated or repeated).
    #[arg(long, short, value_delimiter = ',', required_unless_present = "vllm")]
    pid: Vec<i32>,
    /// Find every vLLM engine on this host and follow them as they come and go (waits for
    /// one when there is none yet).
    #[arg(long)]
    vllm: bool,
    /// With --vllm: scrape this URL instead of the metrics URL found from the API server.
    #[arg(long, value_name = "URL")]
    metrics_url: Option<String>,
    /// With --vllm: seconds between scrapes of the engine's /metrics into the recording.
    #[arg(long, default_value_t = 10.0)]
    scrape_interval: f64,
    /// With --vllm: do not add the default probes.
    #[arg(long)]
    no_default_probes: bool,
    /// With --vllm: only the engine whose API server (or offline `LLM` script) is PID.
    #[arg(long, value_name = "PID", requires = "vllm")]
    engine_pid: Option<i32>,
    /// Address for /metrics (port 0: any free port, printed).
    #[arg(long, default_value = "127.0.0.1:9464")]
    listen: String,
    /// Directory of the rotating recording segments.
    #[arg(long, default_value = "/var/lib/enginescope")]
    dir: std::path::PathBuf,
    /// Samples per second per CPU (low: the agent runs all the time).
    #[arg(long, short, default_value_t = 19)]
    rate: u32,
    /// Start a new segment at this size (MB).
    #[arg(long, default_value_t = 32.0)]
    segment_mb: f64,
    /// … or at this age (seconds).
    #[arg(long, default_value_t = 600.0)]
    segment_seconds: f64,
    /// Remove the oldest segments beyond this much disk (MB); at least two segments.
    #[arg(long, default_value_t = 1024.0)]
    disk_mb: f64,
    /// … or beyond this many segments.
    #[arg(long, default_value_t = 1000)]
    max_segments: usize,
    /// Resident memory (MB) above which a new segment is started early (its frame and stack
    /// tables start empty). 0: no check.
    #[arg(long, default_value_t = 256.0)]
    max_memory_mb: f64,
    /// Threads with series of their own; the rest add into thread="_other".
    #[arg(long, default_value_t = 64)]
    max_threads: usize,
    /// Functions with series of their own; the rest add into function="_other".
    #[arg(long, default_value_t = 50)]
    max_functions: usize,
    /// Probed functions with histograms of their own.
    #[arg(long, default_value_t = 32)]
    max_probes: usize,
    /// Minutes after which a series with no activity is dropped.
    #[arg(long, default_value_t = 10.0)]
    series_idle_minutes: f64,
    /// Seconds between updates of the metrics from the recording.
    #[arg(long, default_value_t = 1.0)]
    poll: f64,
    /// Seconds of each aggregated interval: samples, off-CPU intervals, GIL waits and probed
    /// calls are stored added up per thread and stack (calls as histograms) once per
    /// interval, the exported counters advance then too (docs/deployment.md).
    #[arg(long, default_value_t = 10.0)]
    profile_seconds: f64,
    /// Store every sample, context switch, GIL wait and probed call as its own record, and
    /// every engine metric series, as `record` does (~15x the disk).
    #[arg(long)]
    raw_events: bool,
    #[command(flatten)]
    trace: TraceArgs,
    /// Time every call of a function: `[FILE:]QUALNAME` (repeat for several).
    #[arg(long = "probe", value_name = "[FILE:]QUALNAME")]
    probes: Vec<String>,
    /// An exactly probed function called more often than this (per second) switches to
    /// the sampled method. 0 = never.
    #[arg(long, default_value_t = 500)]
    probe_max_rate: u64,
    /// Keep each thread's debug traps under this percentage of its wall time by watching its
    /// exact probes only part of the time (see `record --probe-budget`). 0 = all the time.
    #[arg(long, value_name = "PCT", default_value_t = DEFAULT_PROBE_BUDGET_PCT)]
    probe_budget: f64,
    /// Watch every call of every exact probe (the same as `--probe-budget 0`).
    #[arg(long, conflicts_with = "probe_budget")]
    exact_probes: bool,
}

/// What `record` and `agent` trace besides on-CPU samples, and with which backend.
#[derive(clap::Args)]
struct TraceArgs {
    /// bpf (kernel-side stack walks), memory (user-space polling), or auto.
    #[arg(long, value_enum, default_value = "auto")]
    backend: enginescope::sampler::Backend,
    /// Do not trace off-CPU intervals (sched_switch).
    #[arg(long)]
    no_offcpu: bool,
    /// Do not time GIL waits (futex tracing).
    #[arg(long)]
    no_gil: bool,
    /// Do not time GC pauses (hardware write watchpoint on the GC state).
    #[arg(long)]
    no_gc: bool,
    /// Native (C/C++) frames merged with the Python frames, and kernel frames (bpf backend):
    /// the kernel copies the user registers and up to 16 KiB of stack with each sample and
    /// blocking switch-out, unwound here from the libraries' .eh_frame.
    #[arg(long)]
    native: bool,
    /// Kernel frames only (on samples and blocking switch-outs), without the user stack copy.
    #[arg(long)]
    kernel_stacks: bool,
}

impl TraceArgs {
    /// Set these choices in `opts`.
    fn apply(&self, opts: &mut enginescope::sampler::RecordOptions) {
        opts.backend = self.backend;
        opts.offcpu = !self.no_offcpu;
        opts.gil = !self.no_gil;
        opts.gc = !self.no_gc;
        opts.native = enginescope::native::NativeOptions {
            kernel: self.native || self.kernel_stacks,
            user: self.native,
        };
    }
}

impl AgentArgs {
    fn options(self) -> anyhow::Result<enginescope::agent::AgentOptions> {
        use enginescope::agent::budget::BudgetConfig;
        use std::time::Duration;
        let pos = |v: f64, what: &str| {
            anyhow::ensure!(v.is_finite() && v > 0.0, "{what} must be a positive number");
            Ok(v)
        };
        let poll = pos(self.poll, "--poll")?;
        let aggregate = if self.raw_events {
            None
        } else {
            Some(Duration::from_secs_f64(pos(
                self.profile_seconds,
                "--profile-seconds",
            )?))
        };
        let idle_ticks =
            (pos(self.series_idle_minutes, "--series-idle-minutes")? * 60.0 / poll).ceil() as u64;
        let cap = |n: usize| BudgetConfig {
            idle_ticks,
            min_residency: idle_ticks / 2,
            ..BudgetConfig::new(n.max(1))
        };
        let mut rotation = enginescope::record::rotate::RotationPolicy::new(self.dir);
        rotation.max_segment_bytes = (pos(self.segment_mb, "--segment-mb")? * 1e6) as u64;
        rotation.max_segment_age =
            Duration::from_secs_f64(pos(self.segment_seconds, "--segment-seconds")?);
        rotation.max_total_bytes = (pos(self.disk_mb, "--disk-mb")? * 1e6) as u64;
        rotation.max_segments = self.max_segments.max(2);
        let mut record = enginescope::sampler::RecordOptions {
            rate_hz: self.rate,
            probes: self.probes,
            probe_max_rate: self.probe_max_rate,
            probe_budget: budget_share(self.probe_budget, self.exact_probes)?,
            vllm: self.vllm,
            metrics_url: self.metrics_url,
            scrape_interval: Duration::from_secs_f64(self.scrape_interval.max(0.01)),
            default_probes: !self.no_default_probes,
            vllm_root_pid: self.engine_pid,
            aggregate,
            ..enginescope::sampler::RecordOptions::new(self.pid, "unused.esrec".into())
        };
        self.trace.apply(&mut record);
        Ok(enginescope::agent::AgentOptions {
            record,
            listen: self.listen,
            rotation,
            poll: Duration::from_secs_f64(poll),
            max_rss_bytes: (self.max_memory_mb.max(0.0) * 1e6) as u64,
            limits: enginescope::agent::metrics::Limits {
                threads: cap(self.max_threads),
                functions: cap(self.max_functions),
                probes: cap(self.max_probes),
                idle_ticks,
            },
            retry: Duration::from_secs(5),
        })
    }
}

/// `--probe-budget`'s default, percent: [`enginescope::sampler::DEFAULT_PROBE_BUDGET`].
const DEFAULT_PROBE_BUDGET_PCT: f64 = enginescope::sampler::DEFAULT_PROBE_BUDGET * 100.0;

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

fn advise(e: &anyhow::Error) -> String {
    let mut msg = format!("error: {e:#}");
    if e.downcast_ref::<enginescope::record::format::DiskFull>()
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

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Dump { pid, json } => {
            let t0 = Instant::now();
            let p = PythonProcess::attach(pid)?;
            let mut snap = p.snapshot()?;
            p.name_threads(
                &mut snap,
                &mut enginescope::cpython::threading::ThreadNames::default(),
            );
            p.name_tasks(
                &mut snap,
                &mut enginescope::cpython::asyncio::AsyncioTasks::default(),
            );
            let ms = t0.elapsed().as_secs_f64() * 1000.0;
            if json {
                println!("{}", dump::to_json(&p, &snap, ms));
            } else {
                print!("{}", dump::to_text(&p, &snap, ms));
            }
        }
        Cmd::Doctor {
            pid,
            json,
            offsets_table,
        } => {
            if let Some(v) = offsets_table {
                let ver = enginescope::cpython::version::PyVersion::parse_version_string(&format!(
                    "{v}.0 ("
                ))
                .ok_or_else(|| anyhow::anyhow!("bad version {v:?}; expected e.g. 3.12"))?;
                let t =
                    enginescope::cpython::offsets::Offsets::static_table(ver).ok_or_else(|| {
                        anyhow::anyhow!(
                            "no static table for {v}: 3.13+ read _Py_DebugOffsets at run time"
                        )
                    })?;
                for l in t.header_check_lines() {
                    println!("{l}");
                }
                return Ok(());
            }
            let p = match pid {
                Some(pid) => Some(PythonProcess::attach(pid)?),
                None => None,
            };
            print!("{}", doctor::report(p.as_ref(), json));
            if json {
                println!();
            } else if let Some(pid) = pid {
                print!("{}", doctor::bpf_check(pid));
            }
        }
        Cmd::Record {
            pid,
            duration,
            rate,
            output,
            trace,
            probes,
            probe_max_rate,
            probe_budget,
            exact_probes,
            vllm,
            metrics_url,
            scrape_interval,
            no_default_probes,
            engine_pid,
            json,
            cost,
        } => {
            let cost = cost.plan()?;
            anyhow::ensure!(
                cost.is_none() || (duration.is_none() && vllm),
                "--measure-cost runs for its slices (--cost-pairs x 2 x --cost-slice), not --duration, and reads the engine's own counter: use it with --vllm and without --duration"
            );
            let mut opts = enginescope::sampler::RecordOptions {
                cost,
                duration: duration.map(std::time::Duration::from_secs_f64),
                rate_hz: rate,
                probes,
                probe_max_rate,
                probe_budget: budget_share(probe_budget, exact_probes)?,
                vllm,
                metrics_url,
                scrape_interval: std::time::Duration::from_secs_f64(scrape_interval.max(0.01)),
                default_probes: !no_default_probes,
                vllm_root_pid: engine_pid,
                ..enginescope::sampler::RecordOptions::new(pid, output.clone())
            };
            trace.apply(&mut opts);
            opts.stop = enginescope::sys::stop_on_signals();
            let s = enginescope::sampler::record(&opts);
            // The exit itself (freeing the ring buffer, the heap, the descriptors) runs as a
            // real-time thread too: at normal priority beside a loaded engine it waited 2-5 s
            // on the run queue after the recording was written.
            let _ = enginescope::sys::realtime_this_thread();
            let s = s?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                eprintln!(
                    "enginescope: wrote {} ({} samples, {} off-CPU intervals, {:.1} s, {} bytes = {:.1} B/sample, {} lost)",
                    output.display(),
                    s.samples,
                    s.offcpu_intervals,
                    s.duration_s,
                    s.bytes,
                    s.bytes as f64 / s.samples.max(1) as f64,
                    s.lost
                );
                if let Some(c) = &s.cost {
                    print!("{}", c.text());
                }
                if let Some(calls) = s.counters.get("probe_calls") {
                    eprintln!(
                        "enginescope: {calls} probed calls timed ({} unfinished, {} probe(s) switched to sampling)",
                        s.counters.get("probe_calls_unfinished").copied().unwrap_or(0),
                        s.counters.get("probes_switched_to_sampling").copied().unwrap_or(0)
                    );
                }
            }
        }
        Cmd::Demo {
            python,
            out,
            seconds,
            fixed,
            no_tui,
            rate,
            baseline,
            no_native,
        } => enginescope::demo::run(&enginescope::demo::DemoOptions {
            native: !no_native,
            baseline,
            python,
            out,
            seconds,
            fixed,
            tui: !no_tui,
            rate_hz: rate,
            // On a terminal the dashboard takes the signals (it must restore the terminal).
            stop: if no_tui || !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                enginescope::sys::stop_on_signals()
            } else {
                enginescope::sys::StopToken::new()
            },
        })?,
        Cmd::Flame {
            file,
            output,
            filter,
            offcpu,
            gil_blame,
        } => {
            use enginescope::views::flame::{render_kind, FlameKind};
            let (rec, sel) = enginescope::views::open(&file, &filter)?;
            let kind = if gil_blame {
                FlameKind::GilBlame
            } else if offcpu {
                FlameKind::OffCpu
            } else {
                FlameKind::OnCpu
            };
            let svg = render_kind(&rec, &sel, kind)?;
            enginescope::views::write_output(&output, &svg)?;
        }
        Cmd::Aggregate {
            file,
            output,
            profile_seconds,
        } => {
            anyhow::ensure!(
                profile_seconds.is_finite() && profile_seconds > 0.0,
                "--profile-seconds must be a positive number"
            );
            let rec = enginescope::record::read_recording(&file)?;
            anyhow::ensure!(
                rec.profile_intervals.is_empty(),
                "{} is aggregated already",
                file.display()
            );
            let bytes = enginescope::record::profile::write_aggregated(
                &rec,
                &output,
                enginescope::record::profile::AggregateOptions {
                    interval_ns: (profile_seconds * 1e9) as u64,
                    event_loop_role: enginescope::vllm::discover::ROLE_API_SERVER,
                    keep_series: |_| true,
                },
            )?;
            let before = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
            eprintln!(
                "enginescope: wrote {} ({bytes} bytes; {before} before)",
                output.display()
            );
        }
        Cmd::Export {
            file,
            format,
            output,
            filter,
        } => {
            let (rec, sel) = enginescope::views::open(&file, &filter)?;
            let bytes = enginescope::views::export(&rec, &sel, format)?;
            enginescope::views::write_output(&output, &bytes)?;
        }
        Cmd::Top {
            pid,
            vllm,
            metrics_url,
            engine_pid,
            probes,
            rate,
            window,
            output,
            backend,
            replay,
        } => {
            anyhow::ensure!(
                window.is_finite() && (0.5..=3600.0).contains(&window),
                "--window must be 0.5 to 3600 seconds"
            );
            let window = std::time::Duration::from_secs_f64(window);
            match replay {
                Some(file) => enginescope::tui::run_replay(&file, window)?,
                None if vllm || !probes.is_empty() => {
                    let temporary = output.is_none();
                    let path = output.unwrap_or_else(|| {
                        std::env::temp_dir()
                            .join(format!("enginescope-top-{}.esrec", std::process::id()))
                    });
                    enginescope::tui::run_record(
                        enginescope::sampler::RecordOptions {
                            rate_hz: rate,
                            backend,
                            vllm,
                            metrics_url,
                            vllm_root_pid: engine_pid,
                            probes,
                            ..enginescope::sampler::RecordOptions::new(pid, path)
                        },
                        temporary,
                        window,
                    )?
                }
                None => enginescope::tui::run_live(
                    &enginescope::tui::LiveOptions {
                        pids: pid,
                        rate_hz: rate,
                        backend,
                        output,
                    },
                    window,
                )?,
            }
        }
        Cmd::Report {
            file,
            format,
            output,
            filter,
            opts,
        } => {
            let opts = opts.options()?;
            let (rec, sel) = enginescope::views::open(&file, &filter)?;
            let bytes = enginescope::views::report_with(&rec, &sel, format, &opts)?;
            let out = output.unwrap_or_else(|| "-".into());
            enginescope::views::write_output(&out, &bytes)?;
        }
        Cmd::Discover { json, metrics_url } => {
            print!(
                "{}",
                enginescope::vllm::tree::run(json, metrics_url.as_deref())?
            );
        }
        Cmd::Diff(args) => enginescope::views::diff::run(&args)?,
        Cmd::Agent(args) => {
            let mut opts = args.options()?;
            opts.record.stop = enginescope::sys::stop_on_signals();
            enginescope::agent::run(&opts)?
        }
    }
    Ok(())
}

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
