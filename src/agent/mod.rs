//! `enginescope agent`: continuous, bounded profiling next to an engine, read through
//! Prometheus and Grafana (docs/deployment.md).
//!
//! Three threads. The recorder (`sampler::record_rotating`, the same code as `record`) writes a
//! directory of rotating segments, each a complete recording that `report`, `flame` and `diff`
//! read; a supervisor starts it again when it ends (targets gone, an error, no vLLM engine
//! yet). The main thread follows the segment being written ([`follow`]), turns its events
//! into Prometheus metrics with bounded label sets ([`metrics`], [`budget`]), and watches the
//! agent's own memory and disk use. The exporter thread ([`exporter`]) serves `/metrics`.
//!
//! Bounds: disk by the rotation policy (segment size and age, total size and count of the
//! directory); memory by one segment's tables (frames, stacks, threads: a new segment starts
//! empty, and the agent asks for a new segment early when its resident memory passes
//! `max_rss_bytes`), by the cardinality caps, and by forgetting exited processes and threads.

pub mod budget;
pub mod exporter;
pub mod follow;
pub mod metrics;
pub mod profiles;
pub mod push;

use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::record::rotate::{list_segments, RotationPolicy};
use crate::sampler::{self, RecordOptions};
use metrics::{Aggregator, InfoLabels, Limits, Metrics};

/// Everything `enginescope agent` is told.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Targets and what to record (as `record`; `output` and `duration` are not used).
    pub record: RecordOptions,
    /// Address for `/metrics`, e.g. `127.0.0.1:9464` (port 0: any free port, printed).
    pub listen: String,
    pub rotation: RotationPolicy,
    /// How often the recording is read and the metrics updated.
    pub poll: Duration,
    /// Resident memory above which the agent starts a new segment early (0: no check).
    pub max_rss_bytes: u64,
    pub limits: Limits,
    /// Wait before starting the recorder again.
    pub retry: Duration,
    /// Push CPU profiles to a Pyroscope server (`--push`).
    pub push: Option<push::PushOptions>,
}

/// The agent's own resource use, from `/proc/self`.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SelfStats {
    pub rss_bytes: u64,
    pub vsize_bytes: u64,
    pub cpu_s: f64,
    pub open_fds: u64,
}

/// Read [`SelfStats`] (fields that cannot be read stay 0).
pub(crate) fn self_stats() -> SelfStats {
    let mut s = SelfStats::default();
    if let Ok(st) = std::fs::read_to_string("/proc/self/status") {
        for l in st.lines() {
            let kb = |l: &str| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
                    * 1024
            };
            if l.starts_with("VmRSS:") {
                s.rss_bytes = kb(l);
            } else if l.starts_with("VmSize:") {
                s.vsize_bytes = kb(l);
            }
        }
    }
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the ")" that ends comm: utime and stime are the 12th and 13th.
        let f: Vec<&str> = stat
            .rsplit_once(')')
            .map(|x| x.1.split_whitespace().collect())
            .unwrap_or_default();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        s.cpu_s = (tick(11) + tick(12)) as f64 / hz;
    }
    if let Ok(rd) = std::fs::read_dir("/proc/self/fd") {
        s.open_fds = rd.take(1 << 20).count() as u64;
    }
    s
}

/// Run the agent until SIGINT or SIGTERM.
pub fn run(opts: &AgentOptions) -> anyhow::Result<()> {
    anyhow::ensure!(
        opts.record.vllm || !opts.record.pids.is_empty(),
        "no target: pass --pid PID[,PID…] or --vllm"
    );
    let pol = &opts.rotation;
    anyhow::ensure!(
        pol.max_total_bytes >= 2 * pol.max_segment_bytes,
        "the disk cap ({} bytes) must hold at least two segments of {} bytes",
        pol.max_total_bytes,
        pol.max_segment_bytes
    );
    let listener = TcpListener::bind(&opts.listen).with_context(|| {
        format!(
            "listening on {} (another agent or exporter on that port?)",
            opts.listen
        )
    })?;
    let (m, registry) = Metrics::new();
    m.start_time.set(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
    );
    let served = exporter::Served {
        registry,
        profiles: Some(profiles::Profiles::of_agent(opts)),
    };
    let exporter = exporter::Exporter::spawn(listener, Arc::new(served), exporter::IO_TIMEOUT)?;
    // Segments already there belong to an earlier run: the follower starts after them.
    let mut follower = follow::Follower::new(&pol.dir)?;
    eprintln!(
        "enginescope: agent serving metrics on http://{}/metrics; recording into {} (segments of {:.1} MB or {:.0} s, at most {:.1} MB and {} segments)",
        exporter.addr,
        pol.dir.display(),
        pol.max_segment_bytes as f64 / 1e6,
        pol.max_segment_age.as_secs_f64(),
        pol.max_total_bytes as f64 / 1e6,
        pol.max_segments
    );
    let mode = if opts.record.vllm { "vllm" } else { "pid" };
    let mut agg =
        Aggregator::new(m.clone(), opts.limits).aggregated(opts.record.aggregate.is_some());
    let rec_opts = RecordOptions {
        duration: None,
        ..opts.record.clone()
    };
    let rec_policy = pol.clone();
    let retry = opts.retry;
    let restarts = m.recorder_restarts.clone();
    let recorder = std::thread::Builder::new()
        .name("es-recorder".into())
        .spawn(move || supervise(&rec_opts, &rec_policy, retry, &restarts))?;

    let push_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pusher = spawn_pusher(opts, &m, &push_stop)?;
    let mut last_rss_rotation: Option<Instant> = None;
    let mut last_error = String::new();
    let mut backend = String::new();
    loop {
        let finished = recorder.is_finished();
        if let Err(e) = follower.poll(&mut agg) {
            let msg = format!("{e:#}");
            if msg != last_error {
                eprintln!("enginescope: agent: following the recording: {msg}");
                last_error = msg;
            }
        }
        if let Some(b) = agg.backend() {
            if b != backend {
                backend = b.to_string();
                m.info.clear();
                m.info
                    .get_or_create(&InfoLabels {
                        version: env!("CARGO_PKG_VERSION").into(),
                        backend: backend.clone(),
                        mode: mode.into(),
                    })
                    .set(1);
            }
        }
        agg.update_process_gauge(&crate::procinfo::is_running);
        agg.tick();
        update_own_metrics(opts, &m, &mut last_rss_rotation);
        if finished {
            break;
        }
        // Sleep in short steps so that a stop is acted on promptly.
        let until = Instant::now() + opts.poll;
        while Instant::now() < until && !recorder.is_finished() {
            std::thread::sleep(Duration::from_millis(50).min(opts.poll));
        }
    }
    exporter.stop();
    push_stop.store(true, Ordering::SeqCst);
    if let Some(p) = pusher {
        // At most one push's timeout.
        let _ = p.join();
    }
    match recorder.join() {
        Ok(r) => r,
        Err(_) => anyhow::bail!("the recorder thread panicked"),
    }
}

/// `--push`: the thread that pushes profiles until `stop` (None without `--push`).
fn spawn_pusher(
    opts: &AgentOptions,
    m: &Metrics,
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<Option<std::thread::JoinHandle<()>>> {
    let Some(p) = &opts.push else {
        return Ok(None);
    };
    let profiles = profiles::Profiles::of_agent(opts);
    let (p, counts, stop) = (p.clone(), m.profile_pushes.clone(), stop.clone());
    eprintln!(
        "enginescope: agent: pushing CPU profiles to {}/ingest every {:.0} s as {}",
        p.url.trim_end_matches('/'),
        p.every.as_secs_f64(),
        push::app_name(&p)
    );
    Ok(Some(
        std::thread::Builder::new()
            .name("es-push".into())
            .spawn(move || push::run(p, profiles, counts, stop))?,
    ))
}

/// The agent's own gauges (segments and their bytes, memory, CPU, descriptors), and a new
/// segment early when resident memory passes `--max-memory-mb` (at most every 30 s).
fn update_own_metrics(opts: &AgentOptions, m: &Metrics, last_rss_rotation: &mut Option<Instant>) {
    let pol = &opts.rotation;
    let segs = list_segments(&pol.dir).unwrap_or_default();
    m.segments.set(segs.len() as i64);
    m.recording_bytes.set(
        segs.iter()
            .map(|s| s.bytes)
            .sum::<u64>()
            .min(i64::MAX as u64) as i64,
    );
    let st = self_stats();
    m.rss.set(st.rss_bytes.min(i64::MAX as u64) as i64);
    m.vsize.set(st.vsize_bytes.min(i64::MAX as u64) as i64);
    let cpu_before = m.cpu.get();
    if st.cpu_s > cpu_before {
        m.cpu.inc_by(st.cpu_s - cpu_before);
    }
    m.open_fds.set(st.open_fds.min(i64::MAX as u64) as i64);
    if opts.max_rss_bytes > 0
        && st.rss_bytes > opts.max_rss_bytes
        && last_rss_rotation.is_none_or(|t| t.elapsed() >= Duration::from_secs(30))
    {
        // A new segment starts with empty frame and stack tables, here and in the follower.
        pol.rotate_now.store(true, Ordering::SeqCst);
        *last_rss_rotation = Some(Instant::now());
        eprintln!(
            "enginescope: agent: resident memory {:.1} MB over the {:.1} MB cap: starting a new segment",
            st.rss_bytes as f64 / 1e6,
            opts.max_rss_bytes as f64 / 1e6
        );
    }
}

/// Run the recorder until a stop is asked for, starting it again when it ends.
fn supervise(
    opts: &RecordOptions,
    policy: &RotationPolicy,
    retry: Duration,
    restarts: &prometheus_client::metrics::counter::Counter,
) -> anyhow::Result<()> {
    let mut last_msg = String::new();
    let mut runs = 0u64;
    while !opts.stop.is_stopped() {
        if runs > 0 {
            restarts.inc();
        }
        runs += 1;
        // A panic in the recorder (a bug) is reported and the recorder started again: the
        // agent keeps serving. Its BPF programs and breakpoints are dropped while unwinding.
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sampler::record_rotating(opts, Some(policy.clone()))
        }));
        let (msg, recorded) = match run {
            Ok(Ok(s)) => (
                format!(
                    "recorder stopped after {:.1} s ({} samples)",
                    s.duration_s, s.samples
                ),
                true,
            ),
            Ok(Err(e)) => (format!("recorder: {e:#}"), false),
            Err(_) => (
                "the recorder panicked (a bug; please report it with the lines above)".into(),
                false,
            ),
        };
        if opts.stop.is_stopped() {
            break;
        }
        // The same failure again (no engine yet) is said once; every recording that ended
        // (its engine gone) is said.
        if recorded || msg != last_msg {
            eprintln!(
                "enginescope: agent: {msg}; trying again every {} s",
                retry.as_secs_f64()
            );
            last_msg = msg;
        }
        if !opts.vllm && !opts.pids.iter().any(|&p| crate::procinfo::is_running(p)) {
            eprintln!(
                "enginescope: agent: every --pid target has exited; serving the last figures until stopped"
            );
            while !opts.stop.is_stopped() {
                std::thread::sleep(Duration::from_millis(100));
            }
            break;
        }
        let until = Instant::now() + retry;
        while Instant::now() < until && !opts.stop.is_stopped() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}
