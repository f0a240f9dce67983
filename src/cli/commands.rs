//! Each command's own arguments and what it does with them.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::args::{
    record_options, AgentEngineArgs, AgentProbeArgs, AgentSamplingArgs, DemoSamplingArgs,
    EngineArgs, Groups, ProbeArgs, SamplingArgs, TraceArgs, VllmArgs,
};
use crate::cpython::PythonProcess;

#[derive(clap::Args)]
pub struct DumpCmd {
    #[arg(long, short)]
    pid: i32,
    /// JSON output (schema: docs/dump-json.md).
    #[arg(long)]
    json: bool,
}

impl DumpCmd {
    pub fn run(self) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let p = PythonProcess::attach(self.pid)?;
        let mut snap = p.snapshot()?;
        p.name_threads(
            &mut snap,
            &mut crate::cpython::threading::ThreadNames::default(),
        );
        p.name_tasks(
            &mut snap,
            &mut crate::cpython::asyncio::AsyncioTasks::default(),
        );
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        if self.json {
            println!("{}", crate::dump::to_json(&p, &snap, ms));
        } else {
            print!("{}", crate::dump::to_text(&p, &snap, ms));
        }
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct DoctorCmd {
    #[arg(long, short)]
    pid: Option<i32>,
    #[arg(long)]
    json: bool,
    /// Print the built-in offset table for a version (3.10, 3.11, 3.12) as name=value lines,
    /// for checking against the CPython headers (tools/pyoffsets.c).
    #[arg(long, value_name = "VERSION")]
    offsets_table: Option<String>,
}

impl DoctorCmd {
    pub fn run(self) -> anyhow::Result<()> {
        if let Some(v) = self.offsets_table {
            let ver = crate::cpython::version::PyVersion::parse_version_string(&format!("{v}.0 ("))
                .ok_or_else(|| anyhow::anyhow!("bad version {v:?}; expected e.g. 3.12"))?;
            let t = crate::cpython::offsets::Offsets::static_table(ver).ok_or_else(|| {
                anyhow::anyhow!("no static table for {v}: 3.13+ read _Py_DebugOffsets at run time")
            })?;
            for l in t.header_check_lines() {
                println!("{l}");
            }
            return Ok(());
        }
        let p = match self.pid {
            Some(pid) => Some(PythonProcess::attach(pid)?),
            None => None,
        };
        print!("{}", crate::doctor::report(p.as_ref(), self.json));
        if self.json {
            println!();
        } else if let Some(pid) = self.pid {
            print!("{}", crate::doctor::bpf_check(pid));
        }
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct RecordCmd {
    /// Target process ids (comma-separated or repeated).
    #[arg(long, short, value_delimiter = ',', required_unless_present = "vllm")]
    pid: Vec<i32>,
    #[command(flatten)]
    vllm: VllmArgs,
    #[command(flatten)]
    pub(super) engine: EngineArgs,
    /// Seconds to record; without it, until Ctrl-C.
    #[arg(long, short)]
    duration: Option<f64>,
    #[command(flatten)]
    pub(super) sampling: SamplingArgs,
    /// Output file.
    #[arg(long, short, default_value = "enginescope.esrec")]
    output: PathBuf,
    #[command(flatten)]
    trace: TraceArgs,
    #[command(flatten)]
    pub(super) probes: ProbeArgs,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    cost: crate::sampler::cost::CostArgs,
}

impl RecordCmd {
    pub fn run(self) -> anyhow::Result<()> {
        let cost = self.cost.plan()?;
        anyhow::ensure!(
            cost.is_none() || (self.duration.is_none() && self.vllm.vllm),
            "--measure-cost runs for its slices (--cost-pairs x 2 x --cost-slice), not --duration, and reads the engine's own counter: use it with --vllm and without --duration"
        );
        let duration = match self.duration {
            Some(d) => {
                anyhow::ensure!(
                    d.is_finite() && d >= 0.0,
                    "--duration must be a number of seconds, such as 30"
                );
                Some(Duration::from_secs_f64(d))
            }
            None => None,
        };
        let mut opts = record_options(Groups {
            pids: self.pid,
            output: self.output.clone(),
            rate: self.sampling.rate,
            vllm: &self.vllm,
            scraping: Some(self.engine.scraping()),
            trace: &self.trace,
            probing: self.probes.probing()?,
        })?;
        opts.cost = cost;
        opts.duration = duration;
        opts.stop = crate::sys::stop_on_signals();
        let s = crate::sampler::record(&opts);
        // The exit itself (freeing the ring buffer, the heap, the descriptors) runs as a
        // real-time thread too: at normal priority beside a loaded engine it waited 2-5 s on
        // the run queue after the recording was written.
        let _ = crate::sys::realtime_this_thread();
        let s = s?;
        if self.json {
            println!("{}", serde_json::to_string_pretty(&s)?);
            return Ok(());
        }
        eprintln!(
            "enginescope: wrote {} ({} samples, {} off-CPU intervals, {:.1} s, {} bytes = {:.1} B/sample, {} lost)",
            self.output.display(),
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
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct DemoCmd {
    /// Python interpreter for the sample engine (CPython 3.10-3.15); default: pyenv's newest
    /// 3.12, else python3.
    #[arg(long)]
    python: Option<String>,
    /// Where to write the recording, report, flamegraphs and the engine's own truth; default
    /// enginescope-demo (enginescope-demo-fixed with --fixed).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seconds to record (without a terminal; with one, until you press q).
    #[arg(long, default_value_t = 15.0)]
    seconds: f64,
    /// Run the engine with its three fixes applied; writes the diff against the slow run when
    /// ./enginescope-demo/demo.esrec exists.
    #[arg(long)]
    fixed: bool,
    /// Record and report even when stdout is a terminal (no live dashboard).
    #[arg(long)]
    no_tui: bool,
    #[command(flatten)]
    pub(super) sampling: DemoSamplingArgs,
    /// With --fixed: the slow run's recording to diff against (default:
    /// enginescope-demo/demo.esrec).
    #[arg(long, value_name = "ESREC")]
    baseline: Option<PathBuf>,
    /// Record without native and kernel frames (the demo records them by default).
    #[arg(long)]
    no_native: bool,
}

impl DemoCmd {
    pub fn run(self) -> anyhow::Result<()> {
        crate::demo::run(&crate::demo::DemoOptions {
            native: !self.no_native,
            baseline: self.baseline,
            python: self.python,
            out: self.out,
            seconds: self.seconds,
            fixed: self.fixed,
            tui: !self.no_tui,
            rate_hz: self.sampling.rate,
            // On a terminal the dashboard takes the signals (it must restore the terminal).
            stop: if self.no_tui || !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                crate::sys::stop_on_signals()
            } else {
                crate::sys::StopToken::new()
            },
        })
    }
}

#[derive(clap::Args)]
pub struct FlameCmd {
    /// Recording (.esrec).
    file: PathBuf,
    /// Output SVG (`-` for stdout).
    #[arg(long, short)]
    output: PathBuf,
    #[command(flatten)]
    filter: crate::views::FilterArgs,
    /// Off-CPU time (where threads waited) instead of on-CPU time.
    #[arg(long, conflicts_with = "gil_blame")]
    offcpu: bool,
    /// GIL blame: the time threads waited for the GIL, by the holder thread and the holder's
    /// stack when the wait began (the filter selects waiters).
    #[arg(long)]
    gil_blame: bool,
}

impl FlameCmd {
    pub fn run(self) -> anyhow::Result<()> {
        use crate::views::flame::{render_kind, FlameKind};
        let (rec, sel) = crate::views::open(&self.file, &self.filter)?;
        let kind = if self.gil_blame {
            FlameKind::GilBlame
        } else if self.offcpu {
            FlameKind::OffCpu
        } else {
            FlameKind::OnCpu
        };
        let svg = render_kind(&rec, &sel, kind)?;
        crate::views::write_output(&self.output, &svg)
    }
}

#[derive(clap::Args)]
pub struct AggregateCmd {
    /// Recording (.esrec) of raw events.
    file: PathBuf,
    /// The aggregated recording to write.
    #[arg(long, short)]
    output: PathBuf,
    /// Seconds of each interval.
    #[arg(long, default_value_t = 10.0)]
    profile_seconds: f64,
}

impl AggregateCmd {
    pub fn run(self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.profile_seconds.is_finite() && self.profile_seconds > 0.0,
            "--profile-seconds must be a positive number"
        );
        let rec = crate::record::read_recording(&self.file)?;
        anyhow::ensure!(
            rec.profile_intervals.is_empty(),
            "{} is aggregated already",
            self.file.display()
        );
        let bytes = crate::record::profile::write_aggregated(
            &rec,
            &self.output,
            crate::record::profile::AggregateOptions {
                interval_ns: (self.profile_seconds * 1e9) as u64,
                event_loop_role: crate::vllm::discover::ROLE_API_SERVER,
                keep_series: |_| true,
            },
        )?;
        let before = std::fs::metadata(&self.file).map(|m| m.len()).unwrap_or(0);
        eprintln!(
            "enginescope: wrote {} ({bytes} bytes; {before} before)",
            self.output.display()
        );
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct ExportCmd {
    /// Recording (.esrec).
    file: PathBuf,
    #[arg(long, short, value_enum)]
    format: crate::views::ExportFormat,
    /// Output file (`-` for stdout).
    #[arg(long, short)]
    output: PathBuf,
    #[command(flatten)]
    filter: crate::views::FilterArgs,
}

impl ExportCmd {
    pub fn run(self) -> anyhow::Result<()> {
        let (rec, sel) = crate::views::open(&self.file, &self.filter)?;
        let bytes = crate::views::export(&rec, &sel, self.format)?;
        crate::views::write_output(&self.output, &bytes)
    }
}

#[derive(clap::Args)]
pub struct TopCmd {
    /// Target process ids (comma-separated or repeated).
    #[arg(long, short, value_delimiter = ',', required_unless_present_any = ["replay", "vllm"])]
    pid: Vec<i32>,
    #[command(flatten)]
    vllm: VllmArgs,
    #[command(flatten)]
    pub(super) sampling: SamplingArgs,
    /// Seconds the dashboard's figures cover (a sliding window).
    #[arg(long, short, default_value_t = 10.0)]
    window: f64,
    /// Keep the recording in this file (a temporary file is used and removed otherwise).
    #[arg(long, short)]
    output: Option<PathBuf>,
    #[command(flatten)]
    trace: TraceArgs,
    #[command(flatten)]
    probes: ProbeArgs,
    /// Replay a recording (.esrec) instead, paced by its event time.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["pid", "output"])]
    replay: Option<PathBuf>,
}

impl TopCmd {
    pub fn run(self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.window.is_finite() && (0.5..=3600.0).contains(&self.window),
            "--window must be 0.5 to 3600 seconds"
        );
        let window = Duration::from_secs_f64(self.window);
        if let Some(file) = &self.replay {
            return crate::tui::run_replay(file, window);
        }
        let temporary = self.output.is_none();
        let path = self.output.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("enginescope-top-{}.esrec", std::process::id()))
        });
        // The dashboard records as `record` does, into a file it follows.
        let opts = record_options(Groups {
            pids: self.pid.clone(),
            output: path,
            rate: self.sampling.rate,
            vllm: &self.vllm,
            scraping: None,
            trace: &self.trace,
            probing: self.probes.probing()?,
        })?;
        crate::tui::run_record(opts, temporary, window)
    }
}

#[derive(clap::Args)]
pub struct ReportCmd {
    /// Recording (.esrec).
    file: PathBuf,
    #[arg(long, short, value_enum, default_value = "md")]
    format: crate::views::ReportFormat,
    /// Output file; stdout when absent.
    #[arg(long, short)]
    output: Option<PathBuf>,
    #[command(flatten)]
    filter: crate::views::FilterArgs,
    #[command(flatten)]
    opts: crate::views::report::ReportArgs,
}

impl ReportCmd {
    pub fn run(self) -> anyhow::Result<()> {
        let opts = self.opts.options()?;
        let (rec, sel) = crate::views::open(&self.file, &self.filter)?;
        let bytes = crate::views::report_with(&rec, &sel, self.format, &opts)?;
        let out = self.output.unwrap_or_else(|| "-".into());
        crate::views::write_output(&out, &bytes)
    }
}

#[derive(clap::Args)]
pub struct DiscoverCmd {
    #[arg(long)]
    json: bool,
    /// Metrics URL to use instead of the one found (or of an engine on another host).
    #[arg(long, value_name = "URL")]
    metrics_url: Option<String>,
}

impl DiscoverCmd {
    pub fn run(self) -> anyhow::Result<()> {
        print!(
            "{}",
            crate::vllm::tree::run(self.json, self.metrics_url.as_deref())?
        );
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct AgentCmd {
    /// Target process ids (comma-separated or repeated).
    #[arg(long, short, value_delimiter = ',', required_unless_present = "vllm")]
    pid: Vec<i32>,
    #[command(flatten)]
    vllm: VllmArgs,
    #[command(flatten)]
    pub(super) engine: AgentEngineArgs,
    /// Address for /metrics (port 0: any free port, printed).
    #[arg(long, default_value = "127.0.0.1:9464")]
    listen: String,
    /// Directory of the rotating recording segments.
    #[arg(long, default_value = "/var/lib/enginescope")]
    dir: PathBuf,
    #[command(flatten)]
    pub(super) sampling: AgentSamplingArgs,
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
    /// Seconds between tries to record again after the recorder stopped (no engine yet, every
    /// engine gone, the disk full).
    #[arg(long, default_value_t = 5.0)]
    retry_seconds: f64,
    /// Seconds of each aggregated interval: samples, off-CPU intervals, GIL waits and probed
    /// calls are stored added up per thread and stack (calls as histograms) once per
    /// interval, the exported counters advance then too (docs/deployment.md).
    #[arg(long, default_value_t = 10.0)]
    profile_seconds: f64,
    /// Store every sample, context switch, GIL wait and probed call as its own record, and
    /// every engine metric series, as `record` does (~15x the disk).
    #[arg(long)]
    raw_events: bool,
    /// Push CPU profiles to this Pyroscope server (or Alloy's pyroscope.receive_http), e.g.
    /// http://pyroscope:4040: its ingest API, each profile the seconds since the last.
    #[arg(long, value_name = "URL")]
    push: Option<String>,
    /// Seconds between pushes.
    #[arg(long, default_value_t = 15.0)]
    push_every: f64,
    /// Application name of the pushed profiles (`NAME.cpu{labels}`).
    #[arg(long, default_value = "enginescope")]
    push_app: String,
    /// A label of every pushed profile, KEY=VALUE (repeatable; `host` is added when absent).
    #[arg(long, value_name = "KEY=VALUE")]
    push_label: Vec<String>,
    #[command(flatten)]
    trace: TraceArgs,
    #[command(flatten)]
    pub(super) probes: AgentProbeArgs,
}

impl AgentCmd {
    pub fn run(self) -> anyhow::Result<()> {
        let mut opts = self.options()?;
        opts.record.stop = crate::sys::stop_on_signals();
        crate::agent::run(&opts)
    }

    /// What the agent runs with.
    pub fn options(self) -> anyhow::Result<crate::agent::AgentOptions> {
        use crate::agent::budget::BudgetConfig;
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
        let mut rotation = crate::record::rotate::RotationPolicy::new(self.dir.clone());
        rotation.max_segment_bytes = (pos(self.segment_mb, "--segment-mb")? * 1e6) as u64;
        rotation.max_segment_age =
            Duration::from_secs_f64(pos(self.segment_seconds, "--segment-seconds")?);
        rotation.max_total_bytes = (pos(self.disk_mb, "--disk-mb")? * 1e6) as u64;
        rotation.max_segments = self.max_segments.max(2);
        let mut record = record_options(Groups {
            pids: self.pid.clone(),
            output: "unused.esrec".into(),
            rate: self.sampling.rate,
            vllm: &self.vllm,
            scraping: Some(self.engine.scraping()),
            trace: &self.trace,
            probing: self.probes.probing()?,
        })?;
        record.aggregate = aggregate;
        let push = match &self.push {
            None => None,
            Some(url) => {
                anyhow::ensure!(
                    url.starts_with("http://") || url.starts_with("https://"),
                    "--push {url}: give the server's http:// or https:// URL"
                );
                let labels = self
                    .push_label
                    .iter()
                    .map(|l| {
                        let (k, v) = l
                            .split_once('=')
                            .filter(|(k, _)| !k.is_empty())
                            .with_context(|| format!("--push-label {l}: write it KEY=VALUE"))?;
                        anyhow::ensure!(
                            !(k.contains([',', '{', '}', '=']) || v.contains([',', '{', '}'])),
                            "--push-label {l}: keys and values cannot hold , {{ }} (nor = in a key)"
                        );
                        Ok((k.to_string(), v.to_string()))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Some(crate::agent::push::PushOptions {
                    url: url.clone(),
                    every: Duration::from_secs_f64(pos(self.push_every, "--push-every")?),
                    app: self.push_app.clone(),
                    labels,
                    rate_hz: record.rate_hz,
                })
            }
        };
        Ok(crate::agent::AgentOptions {
            record,
            listen: self.listen,
            rotation,
            poll: Duration::from_secs_f64(poll),
            max_rss_bytes: (self.max_memory_mb.max(0.0) * 1e6) as u64,
            limits: crate::agent::metrics::Limits {
                threads: cap(self.max_threads),
                functions: cap(self.max_functions),
                probes: cap(self.max_probes),
                idle_ticks,
            },
            retry: Duration::from_secs_f64(pos(self.retry_seconds, "--retry-seconds")?),
            push,
        })
    }
}
