//! `enginescope record`: sample target processes and write a recording.
//!
//! One loop ([`recorder::Recorder`]) drives any sample [`source::Source`]: `bpf`
//! ([`bpf_source`]: cpu-clock perf events and sched_switch with the Python stack walked in the
//! kernel) or `memory` ([`memory`]: user-space polling through the same CPython reader, for
//! machines without BPF). Both write through one [`Pipeline`]. See ARCHITECTURE.md for one
//! sample's path end to end.

pub mod bpf_source;
pub mod cost;
pub mod engines;
pub mod gc;
pub mod memory;
pub mod output;
pub mod pipeline;
pub mod probes;
pub mod recorder;
pub mod runtime_weight;
pub mod sink;
pub mod source;
pub mod target;
pub mod tasks;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

pub use bpf_source::bpf_selftest;
pub use pipeline::Pipeline;

use crate::cpython::PythonProcess;
use crate::record::rotate::RotationPolicy;
use crate::record::{EndInfo, Meta, ProcessInfo};
use crate::sys::{monotonic_ns, steps, StopToken};
use recorder::Recorder;
use source::Source;
use target::{Target, Targets};

/// The share of each thread's wall time its exact probes' debug traps may take by default
/// (`--probe-budget 0.25`): the traps' cost is measured on this machine at start, and each
/// thread's probes are watched the share of the time that keeps them under it (all the
/// time on an engine whose steps are long beside a trap). An engine's step crosses two
/// probed threads (EngineCore and a worker), so the engine pays up to twice this; and on a
/// real vLLM the throughput the probes cost was up to twice what the calibrated traps
/// account for (cache lines and the hypervisor's exits a bare loop does not see):
/// docs/benchmarks.md.
pub(crate) const DEFAULT_PROBE_BUDGET: f64 = 0.0025;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Auto,
    Bpf,
    Memory,
}

#[derive(Debug, Clone)]
pub struct RecordOptions {
    pub pids: Vec<i32>,
    pub duration: Option<Duration>,
    pub rate_hz: u32,
    pub output: PathBuf,
    pub backend: Backend,
    pub offcpu: bool,
    /// Exact GIL waits (futex tracing; bpf backend).
    pub gil: bool,
    /// Exact GC pauses (write watchpoint on gcstate->collecting; bpf backend).
    pub gc: bool,
    pub quiet: bool,
    /// `record --probe` specs (`[FILE:]QUALNAME`).
    pub probes: Vec<String>,
    /// Calls per second above which an exact probe switches to sampling (0: never).
    pub probe_max_rate: u64,
    /// `--probe-budget`: the most of each thread's wall time its exact probes' debug traps may
    /// take, as a share (0.02 = 2%), met by watching them part of the time; 0 = all the time.
    pub probe_budget: f64,
    /// Find vLLM engines and record all their processes, roles and metrics (`--vllm`).
    pub vllm: bool,
    /// Metrics URL instead of the one discovered.
    pub metrics_url: Option<String>,
    /// How often engine metrics are scraped.
    pub scrape_interval: Duration,
    /// With `vllm`: also probe `probes::VLLM_DEFAULT_PROBES`.
    pub default_probes: bool,
    /// With `vllm`: only the engine whose API server (or offline script) has this pid.
    pub vllm_root_pid: Option<i32>,
    /// With `vllm`: only the engines whose metrics URL has one of these ports (their API
    /// server's); all when empty.
    pub vllm_port: Vec<u16>,
    /// Stops the recording (it then finishes its file) when stopped: clone it before `record`
    /// and call `stop()` from another thread, or let `main` stop it on SIGINT/SIGTERM. A new
    /// one per run (`RecordOptions::new` makes one).
    pub stop: StopToken,
    /// Set once the window has begun (the header holds its start): a reader that follows the
    /// file live (`top`) opens it after that.
    pub window_begun: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Native and kernel frames (bpf backend).
    pub native: crate::native::NativeOptions,
    /// Store events added up per interval of this length instead of one record each
    /// (`record::profile`; the agent's default), and of the engine metrics only the series
    /// views read. `None`: raw events (`record`'s default, `agent --raw-events`).
    pub aggregate: Option<Duration>,
    /// `--measure-cost`: measure what the recording costs instead of recording for a
    /// duration ([`cost`]).
    pub cost: Option<cost::CostPlan>,
}

impl RecordOptions {
    /// Options for `pids` with the defaults `record` uses.
    pub fn new(pids: Vec<i32>, output: PathBuf) -> Self {
        RecordOptions {
            pids,
            duration: None,
            rate_hz: 99,
            output,
            backend: Backend::Auto,
            offcpu: true,
            gil: true,
            gc: true,
            quiet: false,
            probes: Vec::new(),
            probe_max_rate: 2000,
            probe_budget: DEFAULT_PROBE_BUDGET,
            vllm: false,
            metrics_url: None,
            scrape_interval: Duration::from_secs(1),
            default_probes: true,
            vllm_root_pid: None,
            vllm_port: Vec::new(),
            stop: StopToken::new(),
            window_begun: Default::default(),
            native: crate::native::NativeOptions::default(),
            aggregate: None,
            cost: None,
        }
    }
}

/// What a finished recording contains, for the closing line and tests.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RecordSummary {
    pub backend: String,
    pub samples: u64,
    pub offcpu_intervals: u64,
    pub bytes: u64,
    pub duration_s: f64,
    pub lost: u64,
    pub counters: BTreeMap<String, u64>,
    /// `--measure-cost`'s outcome.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<cost::CostResult>,
}

/// Attach to every pid, choose a backend, record until the duration ends or `opts.stop`.
pub fn record(opts: &RecordOptions) -> anyhow::Result<RecordSummary> {
    record_rotating(opts, None)
}

/// [`record`], into a directory of rotating segments when `rotation` is given (`opts.output`
/// is then not used): the always-on agent records this way.
pub(crate) fn record_rotating(
    opts: &RecordOptions,
    rotation: Option<RotationPolicy>,
) -> anyhow::Result<RecordSummary> {
    match &rotation {
        Some(r) => std::fs::create_dir_all(&r.dir)
            .with_context(|| format!("creating {}", r.dir.display()))?,
        None => output::check_writable(&opts.output)?,
    }
    // Start-up and shutdown as a real-time thread: at normal priority beside a loaded engine
    // on 2 CPUs each step waited on the run queue for most of its wall time (attaching 3
    // processes 0.15-3.7 s, timing a trap 0.05-2.9 s, for ~0.1 s of CPU each). Neither is in
    // the window, and both are bounded work; the kernel's real-time throttling keeps 5% of
    // each CPU for normal tasks regardless. Normal again when this returns.
    let _rt = RealtimeScope::enter();
    let asked = opts.pids.clone();
    let (opts, discovery) = {
        let _s = steps::step("discover");
        plan(opts)?
    };
    let opts = &opts;
    let targets = {
        let _s = steps::step("attach");
        attach(opts, &asked, discovery.as_ref())?
    };
    let (source, reason) = {
        let _s = steps::step("bpf_load");
        choose_source(opts)?
    };
    let rate = rate_of(opts, source.as_ref());
    announce(
        opts,
        &targets,
        source.name(),
        &reason,
        rate,
        rotation.as_ref(),
    );
    // Provisional: the window's start is written over it once the targets are attached.
    let start_ns = monotonic_ns();
    let meta = meta(
        source.name(),
        reason,
        rate,
        start_ns,
        crate::sys::unix_now_s(),
    );
    // Where the recording goes, for a full filesystem's error.
    let written_to = match &rotation {
        Some(r) => r.dir.display().to_string(),
        None => opts.output.display().to_string(),
    };
    let (pipe, rotator) = open_pipeline(opts, rotation, &meta, &targets, discovery.as_ref())?;
    let backend = source.name();
    let mut rec = Recorder::new(opts, targets, pipe, source, rotator);
    let result = rec
        .start()
        .and_then(|()| begin_window(&mut rec, &meta, discovery))
        .and_then(|()| rec.run());
    let end_ns = monotonic_ns();
    finish(rec, result, end_ns, &written_to, backend)
}

/// The recording's writer (rotating or one file), aggregating when asked, with a process
/// record per target, in a pipeline that starts before the window.
fn open_pipeline(
    opts: &RecordOptions,
    rotation: Option<RotationPolicy>,
    meta: &Meta,
    targets: &Targets,
    discovery: Option<&crate::vllm::discover::Discovery>,
) -> anyhow::Result<(Pipeline, Option<output::Rotator>)> {
    let (mut writer, rotator) = output::open(&opts.output, rotation, meta)?;
    if let Some(every) = opts.aggregate {
        writer.aggregate(crate::record::profile::AggregateOptions {
            interval_ns: every.as_nanos().min(u64::MAX as u128) as u64,
            event_loop_role: crate::vllm::discover::ROLE_API_SERVER,
            keep_series: crate::metrics::names::is_read,
        });
    }
    let mut pipe = Pipeline::new(writer, meta.start_mono_ns, meta.rate_hz);
    pipe.pre_window = true;
    for t in targets.iter() {
        pipe.writer.process(&ProcessInfo {
            pid: t.pid,
            cmdline: t.cmdline.clone(),
            python_version: t.proc.version.to_string(),
            role: discovery
                .and_then(|d| d.roles.get(&t.pid).cloned())
                .unwrap_or_default(),
        })?;
    }
    Ok((pipe, rotator))
}

/// The window begins: after the warm-up, with the targets attached and their probes set; the
/// header rewritten with its start, and the engines' scrapers started.
fn begin_window(
    rec: &mut Recorder,
    meta: &Meta,
    discovery: Option<crate::vllm::discover::Discovery>,
) -> anyhow::Result<()> {
    rec.warm_up()?;
    let (mono, unix) = (monotonic_ns(), crate::sys::unix_now_s());
    {
        let _s = steps::step("window_header");
        rec.pipe.writer.restart_meta(&Meta {
            start_mono_ns: mono,
            start_unix_s: unix,
            ..meta.clone()
        })?;
    }
    rec.begin_window(mono)?;
    rec.opts
        .window_begun
        .store(true, std::sync::atomic::Ordering::Release);
    if let Some(d) = discovery {
        let _s = steps::step("scraper_start");
        rec.engines = Some(engines::EngineSession::start(d, &mut rec.pipe, rec.opts)?);
    }
    Ok(())
}

/// The end: the recorder finished and its counters written, the source and scrapers
/// dropped, the file ended; what `run` returned and the finish's errors (a full filesystem
/// named by `written_to`) are the result's.
fn finish(
    mut rec: Recorder,
    result: anyhow::Result<String>,
    end_ns: u64,
    written_to: &str,
    backend: &'static str,
) -> anyhow::Result<RecordSummary> {
    // run() leaves the thread normal.
    let _rt = RealtimeScope::enter();
    let finished = {
        let _s = steps::step("finish");
        rec.finish(end_ns)
    };
    let mut counters = rec.counters();
    for (name, us) in steps::totals() {
        counters.insert(format!("step_{name}_us"), us);
    }
    rec.pipe.writer.counters(&counters)?;
    let reason = match (&result, &finished) {
        (Ok(r), Ok(())) => r.clone(),
        (Err(e), _) | (Ok(_), Err(e)) => format!("error: {e:#}"),
    };
    let Recorder {
        pipe,
        source,
        engines,
        cost,
        ..
    } = rec;
    let cost = cost.map(|c| c.result());
    {
        let _s = steps::step("drop_source");
        drop(source);
    }
    {
        let _s = steps::step("drop_engines");
        drop(engines);
    }
    let written = pipe.written;
    let window_start = pipe.start_ns;
    // The last segment's own length when rotating (each segment's times start at its start).
    let bytes = pipe.writer.finish(&EndInfo {
        duration_ns: end_ns.saturating_sub(pipe.start_ns),
        reason,
    })?;
    // A full filesystem stopped the recording: say where, and that what is there reads.
    let full = |e: anyhow::Error| {
        if e.downcast_ref::<crate::record::format::DiskFull>()
            .is_some()
        {
            e.context(format!("writing {written_to}"))
        } else {
            e
        }
    };
    result.map_err(full)?;
    finished.map_err(full)?;
    Ok(RecordSummary {
        backend: backend.into(),
        samples: written.samples,
        offcpu_intervals: written.offcpu,
        bytes,
        duration_s: end_ns.saturating_sub(window_start) as f64 / 1e9,
        lost: counters.get("bpf_ringbuf_full_lost").copied().unwrap_or(0),
        counters,
        cost,
    })
}

/// The calling thread as a real-time one until dropped (nothing if that is refused).
struct RealtimeScope(bool);

impl RealtimeScope {
    fn enter() -> Self {
        RealtimeScope(crate::sys::realtime_this_thread().is_ok())
    }
}

impl Drop for RealtimeScope {
    fn drop(&mut self) {
        if self.0 {
            crate::sys::normal_this_thread();
        }
    }
}

/// The options with what `--vllm` adds (the engines' processes, the default probes), and the
/// discovery.
fn plan(
    opts: &RecordOptions,
) -> anyhow::Result<(RecordOptions, Option<crate::vllm::discover::Discovery>)> {
    let discovery = if opts.vllm {
        Some(engines::discover_engines(opts)?)
    } else {
        opts.metrics_url
            .as_deref()
            .map(|url| engines::of_targets(&opts.pids, url))
    };
    let mut opts = opts.clone();
    if let Some(d) = discovery.as_ref().filter(|_| opts.vllm) {
        for pid in d.python_pids() {
            if !opts.pids.contains(&pid) {
                opts.pids.push(pid);
            }
        }
        if !opts.quiet {
            for p in d
                .processes
                .iter()
                .filter(|p| p.role == crate::vllm::discover::ROLE_RUST_FRONTEND)
            {
                eprintln!(
                    "enginescope: {}: vLLM's Rust front-end (pid {}) serves its HTTP API: not a Python process, so its metrics are scraped but its threads are not sampled",
                    p.engine, p.pid
                );
            }
        }
        if opts.default_probes {
            for p in probes::VLLM_DEFAULT_PROBES {
                if !opts.probes.iter().any(|q| q == p) {
                    opts.probes.push(p.to_string());
                }
            }
        }
    }
    anyhow::ensure!(
        !opts.pids.is_empty() || discovery.is_some(),
        "no target: pass --pid PID[,PID…] or --vllm"
    );
    anyhow::ensure!(
        (1..=20_000).contains(&opts.rate_hz),
        "--rate must be 1..=20000 Hz"
    );
    Ok((opts, discovery))
}

/// Attach to every pid. Processes asked for by pid must attach; discovered engine processes
/// may exit while we attach (rediscovery attaches the processes that replace them).
fn attach(
    opts: &RecordOptions,
    asked: &[i32],
    discovery: Option<&crate::vllm::discover::Discovery>,
) -> anyhow::Result<Targets> {
    let mut targets = Targets::default();
    for &pid in &opts.pids {
        match PythonProcess::attach(pid) {
            Ok(p) => {
                targets.push(Target::new(p));
            }
            Err(e) if discovery.is_some() && !asked.contains(&pid) => {
                if !opts.quiet {
                    eprintln!("enginescope: engine process {pid} skipped: {e}");
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::ensure!(
        !targets.is_empty() || discovery.is_some_and(|d| !d.engines.is_empty()),
        "no process to record"
    );
    Ok(targets)
}

/// The source `--backend` asks for (`auto`: BPF when it loads, else memory), and why.
fn choose_source(opts: &RecordOptions) -> anyhow::Result<(Box<dyn Source>, String)> {
    let specs = opts
        .probes
        .iter()
        .map(|s| probes::ProbeSpec::parse(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let tracing = bpf_source::BpfTracing {
        offcpu: opts.offcpu,
        gil: opts.gil,
        gc: opts.gc,
        probe_max_rate: opts.probe_max_rate,
        quiet: opts.quiet,
        native: opts.native,
        // Aggregated recordings add off-CPU time up by stack: an engine thread preempted at
        // hundreds of different lines a second gave one key and one new stack each (~2.9
        // KB/s of an agent's ~9.8 on a real vllm serve; docs/deployment.md).
        preempted_stacks: opts.aggregate.is_none(),
        // The agent (aggregated, always on) gives way to an engineer's recording.
        yields_registers: opts.aggregate.is_some(),
    };
    let bpf = || {
        let period = crate::record::Period::of_hz(opts.rate_hz).ns();
        let mut probes = probes::Probes::new(specs.clone(), period, opts.quiet);
        probes.set_budget(opts.probe_budget);
        bpf_source::BpfSource::start(opts.rate_hz, tracing, probes)
    };
    let memory = || -> Box<dyn Source> {
        if !specs.is_empty() && !opts.quiet {
            eprintln!(
                "enginescope: the memory backend times probed functions by sampling (exact timing needs the bpf backend)"
            );
        }
        let period = memory::MemorySource::period_ns(opts.rate_hz);
        let probes = probes::Probes::new(specs.clone(), period, opts.quiet);
        Box::new(memory::MemorySource::new(opts.rate_hz, probes))
    };
    Ok(match opts.backend {
        Backend::Memory => (memory(), "asked for with --backend memory".into()),
        Backend::Bpf => (
            Box::new(bpf().context("starting the BPF sampler (try --backend memory)")?),
            "asked for with --backend bpf".into(),
        ),
        Backend::Auto => match crate::bpf::unavailable_reason() {
            Some(why) => (memory(), format!("BPF unavailable: {why}")),
            None => match bpf() {
                Ok(b) => (Box::new(b), "BPF available".into()),
                Err(e) => (memory(), format!("BPF failed to start: {e:#}")),
            },
        },
    })
}

/// The rate the source samples at (the memory source has a ceiling).
fn rate_of(opts: &RecordOptions, source: &dyn Source) -> u32 {
    if source.name() == "memory" {
        opts.rate_hz.min(memory::MAX_RATE_HZ)
    } else {
        opts.rate_hz
    }
}

fn announce(
    opts: &RecordOptions,
    targets: &Targets,
    backend: &str,
    reason: &str,
    rate: u32,
    rotation: Option<&RotationPolicy>,
) {
    if opts.quiet {
        return;
    }
    let output = match rotation {
        Some(r) => format!("{}/ (rotating segments)", r.dir.display()),
        None => opts.output.display().to_string(),
    };
    eprintln!(
        "enginescope: recording {} process(es) with the {backend} backend ({reason}) at {rate} Hz{} -> {output}",
        targets.len(),
        opts.duration.map(|d| format!(" for {:.1} s", d.as_secs_f64())).unwrap_or_default(),
    );
    if rate != opts.rate_hz {
        eprintln!(
            "enginescope: the memory backend samples at most {} Hz",
            memory::MAX_RATE_HZ
        );
    }
}

fn meta(backend: &str, reason: String, rate: u32, start_ns: u64, start_unix_s: f64) -> Meta {
    Meta {
        tool_version: env!("CARGO_PKG_VERSION").into(),
        start_unix_s,
        start_mono_ns: start_ns,
        rate_hz: rate,
        backend: backend.into(),
        backend_reason: reason,
        hostname: crate::sys::hostname(),
        kernel: crate::sys::machine_facts().kernel,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        cpus: aya::util::online_cpus()
            .map(|c| c.len() as u32)
            .unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_url_without_vllm_makes_the_targets_one_engine() {
        let mut o = RecordOptions::new(vec![41, 42], PathBuf::from("x.esrec"));
        o.metrics_url = Some("http://127.0.0.1:9/metrics".into());
        let (planned, d) = plan(&o).unwrap();
        let d = d.expect("an engine of the targets");
        assert_eq!(d.engines.len(), 1);
        let e = &d.engines[0];
        assert_eq!(e.pids(), vec![41, 42]);
        assert_eq!(e.metrics_url, "http://127.0.0.1:9/metrics");
        assert_eq!(e.metrics_url_source, "--metrics-url");
        // Not vLLM: no default probes, no other process.
        assert!(planned.probes.is_empty(), "{:?}", planned.probes);
        assert_eq!(planned.pids, vec![41, 42]);
        // Without a URL nothing is scraped.
        o.metrics_url = None;
        assert!(plan(&o).unwrap().1.is_none());
    }
}
