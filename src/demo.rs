//! `enginescope demo`: run the bundled vLLM-like engine (`samples/engine/`) and profile it the
//! way a user would profile a live vLLM: discover it, record it with its metrics and the
//! default probes, and write the evidence a pull request needs (report, flamegraphs). With a
//! terminal the live dashboard (`top`) runs on it; without one, a recording of `--seconds`.
//! `--fixed` runs the same engine with the three fixes applied and, when the slow run's
//! recording is there, writes the `diff`.
//!
//! The engine measures itself (`--truth`): the closing summary sets enginescope's figures next
//! to the engine's own, so the demo doubles as an end-to-end check (tests/live_engine.rs).

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::record::Recording;
use crate::sampler::RecordOptions;

/// The engine's files, built into the binary so `demo` runs from anywhere.
const ENGINE_FILES: &[(&str, &str)] = &[
    ("__main__.py", include_str!("../samples/engine/__main__.py")),
    (
        "api_server.py",
        include_str!("../samples/engine/api_server.py"),
    ),
    (
        "engine_core.py",
        include_str!("../samples/engine/engine_core.py"),
    ),
    ("frontend.py", include_str!("../samples/engine/frontend.py")),
    (
        "groundtruth.py",
        include_str!("../samples/engine/groundtruth.py"),
    ),
    ("procutil.py", include_str!("../samples/engine/procutil.py")),
    ("prom.py", include_str!("../samples/engine/prom.py")),
    ("serve.py", include_str!("../samples/engine/serve.py")),
    (
        "shm_broadcast.py",
        include_str!("../samples/engine/shm_broadcast.py"),
    ),
    (
        "summarize.py",
        include_str!("../samples/engine/summarize.py"),
    ),
    ("worker.py", include_str!("../samples/engine/worker.py")),
];

/// The probes the demo asks for, in priority order (see docs/probes.md): the three calls that
/// proved the real fix, then the rest of vLLM's default set.
const DEMO_PROBES: &[&str] = &[
    "Worker.execute_model",
    "_evict_to_fit",
    "MessageQueue.enqueue",
    "MessageQueue.dequeue",
    "EngineCore.step",
];

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Interpreter for the engine; `None`: pyenv's newest 3.12, else `python3`.
    pub python: Option<String>,
    /// Output directory; `None`: `enginescope-demo` (`enginescope-demo-fixed` with `fixed`).
    pub out: Option<PathBuf>,
    /// Seconds recorded (without a terminal) .
    pub seconds: f64,
    pub fixed: bool,
    /// Run the live dashboard when stdout is a terminal.
    pub tui: bool,
    pub rate_hz: u32,
    /// Stops the recording early (`main` stops it on SIGINT/SIGTERM); the demo stops it
    /// itself when the engine's run ends.
    pub stop: crate::sys::StopToken,
    /// With `fixed`: the slow run's recording to diff against; default
    /// `enginescope-demo/demo.esrec` next to the output directory.
    pub baseline: Option<PathBuf>,
    /// Native and kernel frames (`record --native`).
    pub native: bool,
}

/// Kills the engine (its whole process group) when dropped, so nothing outlives the demo.
struct Engine {
    child: Child,
    pid: i32,
    port: u16,
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: signals to the process group we created (setsid in pre_exec); harmless when
        // it has exited.
        unsafe {
            libc::kill(-self.pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe {
            libc::kill(-self.pid, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// pyenv's newest 3.12 (what the fresh machines of this project have), else `python3`.
pub(crate) fn default_python() -> String {
    let root = std::env::var("PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".pyenv")
        });
    let mut found: Vec<PathBuf> = std::fs::read_dir(root.join("versions"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("3.12."))
        })
        .map(|p| p.join("bin/python3"))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found
        .pop()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|| "python3".into())
}

fn start_engine(
    python: &str,
    engine_dir: &Path,
    truth: &Path,
    go: &Path,
    seconds: Option<f64>,
    fixed: bool,
) -> anyhow::Result<Engine> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(python);
    cmd.arg(engine_dir.join("serve.py"))
        .args(["serve", "--port", "0", "--truth"])
        .arg(truth)
        .arg("--go-fifo")
        .arg(go)
        // The load sweeps its concurrency, as a benchmark over concurrencies does, so that
        // what grows with the requests per step (the per-request pickling) shows.
        .args(["--ramp", RAMP]);
    if let Some(s) = seconds {
        cmd.args(["--seconds", &format!("{s}")]);
    }
    if fixed {
        cmd.arg("--fixed");
    }
    // The engine must not outlive the demo however the demo ends: `Engine`'s drop stops it
    // on every way out that runs destructors, and the kernel sends it SIGTERM when this
    // thread dies (killed, or a panic that aborts). Found when a demo killed by `timeout`
    // left its engine blocked on the go FIFO, its worker polling a core, for 20 minutes.
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: setsid(), prctl() and getppid() in the child before exec are async-signal-safe.
    // setsid puts the engine in its own process group so Ctrl-C in the demo's terminal reaches
    // only us, and we stop it; PR_SET_PDEATHSIG asks for SIGTERM when the parent goes; the
    // getppid check covers a parent that died before the prctl.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::other(
                    "the demo exited before its engine started",
                ));
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting the sample engine with {python} (pass --python PATH to choose another interpreter, CPython 3.10-3.15)"))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut engine = None;
    for line in lines.by_ref() {
        let line = line?;
        println!("   engine: {line}");
        let mut w = line.split_whitespace();
        if w.next() == Some("READY") {
            let pid: i32 = w
                .next()
                .and_then(|x| x.parse().ok())
                .context("READY without a pid")?;
            let port: u16 = w.next().and_then(|x| x.parse().ok()).unwrap_or(0);
            engine = Some((pid, port));
            break;
        }
    }
    // Keep draining its stdout so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines.by_ref() {});
    match engine {
        Some((pid, port)) => Ok(Engine { child, pid, port }),
        None => {
            let _ = child.kill();
            let st = child.wait();
            bail!("the sample engine exited before it was ready ({st:?})")
        }
    }
}

pub fn run(opts: &DemoOptions) -> anyhow::Result<()> {
    let python = opts.python.clone().unwrap_or_else(default_python);
    let out = opts.out.clone().unwrap_or_else(|| {
        PathBuf::from(if opts.fixed {
            "enginescope-demo-fixed"
        } else {
            "enginescope-demo"
        })
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // One place for the engine's files whatever the output directory, so that the slow and the
    // fixed run's functions have the same file names and `diff` matches them.
    let engine_dir = std::env::temp_dir().join("enginescope-demo-engine");
    std::fs::create_dir_all(&engine_dir)?;
    for (name, src) in ENGINE_FILES {
        std::fs::write(engine_dir.join(name), src)?;
    }
    let truth = out.join("truth");
    let _ = std::fs::remove_dir_all(&truth);
    std::fs::create_dir_all(&truth)?;
    let go = out.join("go");
    let _ = std::fs::remove_file(&go);
    let c = std::ffi::CString::new(go.to_string_lossy().as_bytes())?;
    // SAFETY: mkfifo with a valid NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        bail!(
            "mkfifo {}: {}",
            go.display(),
            std::io::Error::last_os_error()
        );
    }
    let rec_path = out.join("demo.esrec");
    let live = opts.tui && std::io::stdout().is_terminal();
    println!(
        "== enginescope demo: a small vLLM-like engine (API server, EngineCore, Worker; {}) under load, profiled from outside",
        if opts.fixed {
            "with the three fixes applied"
        } else {
            "with an LRU eviction scan holding the GIL, a per-request pickled MessageQueue, and gen-2 GC churn"
        }
    );
    // Without a terminal the engine's window is the recording's (plus margin for attaching).
    let engine = start_engine(
        &python,
        &engine_dir,
        &truth,
        &go,
        (!live).then_some(opts.seconds),
        opts.fixed,
    )?;
    println!(
        "   engine up: API server pid {}, its /metrics at http://127.0.0.1:{}/metrics",
        engine.pid, engine.port
    );
    let ropts = RecordOptions {
        rate_hz: opts.rate_hz,
        vllm: true,
        vllm_root_pid: Some(engine.pid),
        default_probes: true,
        probes: DEMO_PROBES.iter().map(|s| s.to_string()).collect(),
        // Every call watched (`--exact-probes`): the demo sets each figure beside the
        // engine's own timers, call for call. A real engine gets the cost budget instead.
        probe_budget: 0.0,
        scrape_interval: Duration::from_millis(500),
        quiet: live,
        native: crate::native::NativeOptions {
            kernel: opts.native,
            user: opts.native,
        },
        stop: opts.stop.clone(),
        ..RecordOptions::new(Vec::new(), rec_path.clone())
    };
    record_engine(ropts, engine, &go, &rec_path, live)?;
    write_views(&rec_path, &out)?;
    let rec = crate::record::read_recording(&rec_path)?;
    print_findings(&rec, &truth)?;
    if opts.fixed {
        print_diff(opts, &out, &rec_path, &rec)?;
    } else {
        println!("\nNext: `enginescope demo --fixed` runs the same engine with the fixes and writes the diff.");
    }
    Ok(())
}

/// Record the engine: behind the live dashboard in a terminal, else for its whole window (which
/// starts once the probes are attached) on a thread of its own.
fn record_engine(
    ropts: RecordOptions,
    engine: Engine,
    go: &Path,
    rec_path: &Path,
    live: bool,
) -> anyhow::Result<()> {
    if live {
        println!(
            "   starting the live dashboard (q to quit; Tab switches views; Enter shows a thread)"
        );
        go_when_probed(go, None)?;
        crate::tui::run_record(ropts, false, Duration::from_secs(10))?;
        // The engine writes its truth when it stops.
        drop(engine);
    } else {
        let handle = std::thread::Builder::new()
            .name("es-recorder".into())
            .spawn({
                let ropts = ropts.clone();
                move || crate::sampler::record(&ropts)
            })
            .context("starting the recorder")?;
        // The engine's window starts once the probes are attached (they attach when the
        // sampler first meets each function), so the whole window is timed.
        go_when_probed(go, Some(rec_path))?;
        let mut engine = engine;
        let status = engine.child.wait()?;
        ropts.stop.stop();
        let summary = handle
            .join()
            .map_err(|_| anyhow::anyhow!("the recorder thread panicked"))??;
        if !status.success() {
            bail!("the sample engine failed ({status})");
        }
        println!(
            "   recorded {} samples, {} off-CPU intervals, {} bytes ({} backend)",
            summary.samples, summary.offcpu_intervals, summary.bytes, summary.backend
        );
    }
    Ok(())
}

/// The report's findings, each with the engine's own figure where it times one, then the
/// demo's comparison of every figure with the engine's truth files.
fn print_findings(rec: &crate::record::Recording, truth: &Path) -> anyhow::Result<()> {
    let report =
        crate::views::report::Report::build(rec, &crate::views::filter::Selection::all(rec));
    println!("\n== findings (report.md, from any recording; ranked by the share of time each explains), with the engine's own figure where it times one\n");
    if report.findings.is_empty() {
        println!("   none");
    }
    for (i, f) in report
        .findings
        .iter()
        .take(crate::views::findings::TOP)
        .enumerate()
    {
        println!(
            "{}. [{}, {:.1}%] {}",
            i + 1,
            f.kind,
            f.score * 100.0,
            f.verdict
        );
        if let Some(own) = own_figure(f, truth) {
            println!("   engine's own: {own}");
        }
    }
    print!("{}", findings(rec, truth)?);
    Ok(())
}

/// The fixed run against the slow one (`--baseline`, else the default output beside): `diff`'s
/// files, and which findings appeared, vanished or changed.
fn print_diff(
    opts: &DemoOptions,
    out: &Path,
    rec_path: &Path,
    rec: &crate::record::Recording,
) -> anyhow::Result<()> {
    let slow = opts.baseline.clone().unwrap_or_else(|| {
        out.parent()
            .unwrap_or(Path::new("."))
            .join("enginescope-demo/demo.esrec")
    });
    if slow.exists() {
        let args = crate::views::diff::DiffArgs {
            a: slow.clone(),
            b: rec_path.to_path_buf(),
            format: crate::views::ReportFormat::Md,
            output: Some(out.join("diff.md")),
            flame: Some(out.join("diff-flame.svg")),
            top: 20,
            no_native: false,
        };
        crate::views::diff::run(&args)?;
        println!(
            "\n== diff against the slow run: {} (and {})",
            out.join("diff.md").display(),
            out.join("diff-flame.svg").display()
        );
        let before = crate::record::read_recording(&slow)?;
        for f in crate::views::diff::finding_deltas(&before, rec) {
            if f.status == "unchanged" {
                continue;
            }
            let what = match &f.figure {
                Some(g) => format!(
                    "{:.1} -> {:.1} {}",
                    g.value.a.unwrap_or(0.0),
                    g.value.b.unwrap_or(0.0),
                    g.name
                ),
                None => format!(
                    "{:.1}% -> {:.1}%",
                    f.score_pct.a.unwrap_or(0.0),
                    f.score_pct.b.unwrap_or(0.0)
                ),
            };
            println!(
                "   {:<9} {} {}/{} {}: {what}",
                f.status, f.kind, f.process, f.thread, f.function
            );
        }
    } else {
        println!("\n(run `enginescope demo` first, then `enginescope demo --fixed` again, to get the diff)");
    }
    Ok(())
}

/// Let the engine's window start: at once with no recording to watch, else once the recording
/// holds a probe for each of the demo's three key functions (or after 20 s, say so).
fn go_when_probed(go: &Path, rec: Option<&Path>) -> anyhow::Result<()> {
    if let Some(rec) = rec {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut reader = crate::record::format::RecordingReader::default();
        let mut file = None;
        let mut offset = 0usize;
        loop {
            if file.is_none() {
                file = std::fs::File::open(rec).ok();
            }
            if let Some(f) = file.as_mut() {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(f, &mut buf)?;
                offset += buf.len();
                reader.feed(&buf)?;
            }
            let have = |f: &str| {
                reader
                    .recording
                    .probes
                    .iter()
                    .any(|p| p.function.ends_with(f))
            };
            if have("execute_model") && have("_evict_to_fit") && have("enqueue") {
                break;
            }
            if Instant::now() >= deadline {
                println!("   (not every probe attached after 20 s; {offset} bytes recorded; starting anyway)");
                break;
            }
            // Polling a file the recorder is writing: the condition, not the time, decides.
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(go)
        .with_context(|| format!("opening {}", go.display()))?;
    f.write_all(b"GO\n")?;
    Ok(())
}

fn write_views(rec_path: &Path, out: &Path) -> anyhow::Result<()> {
    use crate::views::flame::FlameKind;
    let (rec, sel) = crate::views::open(rec_path, &crate::views::filter::FilterArgs::default())?;
    for (name, kind) in [
        ("flame.svg", FlameKind::OnCpu),
        ("flame-offcpu.svg", FlameKind::OffCpu),
        ("gil-blame.svg", FlameKind::GilBlame),
    ] {
        std::fs::write(
            out.join(name),
            crate::views::flame::render_kind(&rec, &sel, kind)?,
        )?;
    }
    let opts = crate::views::report::ReportOptions {
        flame_links: vec![
            "flame.svg".into(),
            "flame-offcpu.svg".into(),
            "gil-blame.svg".into(),
        ],
        ..Default::default()
    };
    let md = crate::views::report_with(&rec, &sel, crate::views::ReportFormat::Md, &opts)?;
    std::fs::write(out.join("report.md"), &md)?;
    let json = crate::views::report_with(&rec, &sel, crate::views::ReportFormat::Json, &opts)?;
    std::fs::write(out.join("report.json"), &json)?;
    println!(
        "\n== written in {}: demo.esrec (recording), report.md + report.json, flame.svg (on-CPU), flame-offcpu.svg (where threads waited), gil-blame.svg (what GIL holders ran while others waited), truth/ (the engine's own measurements)",
        out.display()
    );
    Ok(())
}

fn read_truth(dir: &Path, role: &str) -> Option<serde_json::Value> {
    let rd = std::fs::read_dir(dir).ok()?;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("{role}-")) && name.ends_with(".json") {
            return std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
        }
    }
    None
}

/// The sample engine's load: requests in flight up and down, each level held 0.625 s: one
/// sweep takes 7.5 s, half the engine's window, so each half of a recording holds about one
/// (`diff` takes a recording's noise from the difference of its halves).
pub(crate) const RAMP: &str = "8,16,24,32,40,48,64,48,40,32,24,16:0.625";

/// The engine's own figure for a finding about the bundled engine, from its truth files: the
/// worker's GIL fight (its `execute_model` and the writer's `_evict_to_fit` as its timers saw
/// them), the EngineCore's GC (its `gc.callbacks`), a MessageQueue call's growth per request
/// (its CPU time per record handled, least squares over the window's calls).
pub(crate) fn own_figure(f: &crate::views::findings::Finding, truth_dir: &Path) -> Option<String> {
    let role = ["worker", "engine_core"].into_iter().find_map(|r| {
        read_truth(truth_dir, r).filter(|t| t["pid"].as_i64() == Some(f.pid as i64))
    })?;
    let ms = |v: &serde_json::Value| v.as_f64().map(|x| x / 1e6);
    match f.kind.as_str() {
        "gil_contention" if role["role"] == "worker" && f.tid == Some(f.pid) => {
            let fs = &role["functions"];
            let exec = ms(&fs["Worker.execute_model"]["wall_ns"]["mean"])?;
            let evict = ms(&fs["AuxOutputStore._evict_to_fit"]["wall_ns"]["mean"]);
            Some(format!(
                "Worker.execute_model {exec:.2} ms per call{} (its timers, around each call)",
                evict.map_or(String::new(), |e| format!(
                    ", AuxOutputStore._evict_to_fit {e:.2} ms per call on the writer"
                ))
            ))
        }
        "gc_pressure" if role["role"] == "engine_core" => {
            let gc = &role["gc"];
            let g2 = &gc["by_generation"]["2"];
            // A collection, seen from outside, lasts until the collector returns: through the
            // engine's own stop callback, whose calls can hand the GIL to a waiting thread
            // for up to its switch interval (the last column of each pause: that callback's
            // last clock read).
            let w = &role["window"];
            let wall = w["end_mono_ns"]
                .as_u64()?
                .saturating_sub(w["start_mono_ns"].as_u64()?);
            let through: u64 = gc["pauses"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| {
                    let (t0, dur) = (p[0].as_u64()?, p[1].as_u64()?);
                    Some(p[6].as_u64().unwrap_or(0).max(t0 + dur) - t0)
                })
                .sum();
            let through = if wall > 0 && gc["pauses_truncated"] == false {
                format!(
                    ", {:.1}% through its stop callbacks",
                    through as f64 / wall as f64 * 100.0
                )
            } else {
                String::new()
            };
            Some(format!(
                "{:.1}% of its window collecting{through} (gen 2: {} × {:.2} ms)",
                gc["share_of_wall"].as_f64()? * 100.0,
                g2["count"].as_u64().unwrap_or(0),
                g2["total_ns"].as_f64().unwrap_or(0.0)
                    / g2["count"].as_f64().filter(|&n| n > 0.0).unwrap_or(1.0)
                    / 1e6
            ))
        }
        "per_request_growth" => {
            let per = &role["functions"][&f.function]["per_item_cpu"];
            Some(format!(
                "{:.1} µs more CPU per record handled (r {:.2}, {}-{} records a call)",
                per["slope_ns"].as_f64()? / 1e3,
                per["r"].as_f64().unwrap_or(0.0),
                per["items_min"],
                per["items_max"]
            ))
        }
        _ => None,
    }
}

/// The per-call latency of the probed functions and the throughput, enginescope's figure
/// next to the engine's own.
pub fn findings(rec: &Recording, truth_dir: &Path) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let mut s = String::new();
    let worker_t = read_truth(truth_dir, "worker");
    let core_t = read_truth(truth_dir, "engine_core");
    let api_t = read_truth(truth_dir, "api_server");
    // The engine's window, on our clock.
    let window = api_t.as_ref().and_then(|t| {
        Some((
            t["window"]["start_mono_ns"].as_u64()?,
            t["window"]["end_mono_ns"].as_u64()?,
        ))
    });
    let (w0, w1) = window.unwrap_or((
        rec.meta.start_mono_ns,
        rec.meta.start_mono_ns + rec.duration_ns(),
    ));
    let rel = |t: u64| t.saturating_sub(rec.meta.start_mono_ns);
    let in_window = |t_rel: u64| t_rel >= rel(w0) && t_rel < rel(w1);
    let wall_s = (w1 - w0) as f64 / 1e9;
    writeln!(s, "\n== what enginescope found (over the engine's {wall_s:.1} s window), next to the engine's own measurements\n")?;

    // 2. Per-call latency of the probed functions, against the engine's timers.
    writeln!(
        s,
        "per-call latency (p50), enginescope vs the engine's own perf_counter timers:"
    )?;
    // Like with like: the engine times each call from its caller, so its timer holds the two
    // debug traps every exactly probed call takes (its start and its end), which
    // enginescope's figure leaves out by design; the engine's figure is also shown less them.
    let trap_ns = rec.counters.get("probe_trap_cost_ns").copied().unwrap_or(0);
    // One line per function and process, whatever its method over time; only exact
    // figures stand beside the engine's own.
    let mut seen = std::collections::BTreeSet::new();
    for p in &rec.probes {
        if !seen.insert((p.pid, p.function.clone())) {
            continue;
        }
        let group: Vec<_> = rec
            .probes
            .iter()
            .filter(|q| q.pid == p.pid && q.function == p.function)
            .collect();
        let mut d: Vec<u64> = rec
            .calls
            .iter()
            .filter(|c| group.iter().any(|q| q.id == c.probe) && in_window(c.start_ns))
            .map(|c| c.dur_ns)
            .collect();
        if d.is_empty() {
            continue;
        }
        d.sort_unstable();
        let role = rec
            .processes
            .iter()
            .rev()
            .find(|x| x.pid == p.pid)
            .map(|x| x.role.clone())
            .unwrap_or_default();
        let exact = group.iter().all(|q| q.method == "exact");
        if !exact {
            let res = group.iter().map(|q| q.resolution_ns).max().unwrap_or(0);
            writeln!(
                s,
                "   {:<30} {:<12} >= {} calls, sampled ({:.0} ms resolution): a lower bound, not comparable with the engine's timers",
                p.function,
                role,
                d.len(),
                res as f64 / 1e6
            )?;
            continue;
        }
        let own = [&worker_t, &core_t]
            .into_iter()
            .flatten()
            .find(|t| t["pid"].as_i64() == Some(p.pid as i64))
            .map(|t| &t["functions"][&p.function]);
        let truth = own.and_then(|f| f["wall_ns"]["p50"].as_f64());
        // Where the engine also times the call inside it (first statement to last), that is
        // where the probe times it: the figure to compare.
        let body = own.and_then(|f| f["body_wall_ns"]["p50"].as_f64());
        writeln!(
            s,
            "   {:<30} {:<12} {:>5} calls  p50 {:>7.3} ms (exact)   engine's own: {}",
            p.function,
            role,
            d.len(),
            d[d.len() / 2] as f64 / 1e6,
            match (body, truth) {
                (Some(b), Some(t)) => format!(
                    "{:.3} ms inside the call ({:.3} ms around it, from its caller)",
                    b / 1e6,
                    t / 1e6
                ),
                _ => truth.map_or("-".to_string(), |t| if trap_ns > 0 {
                    format!(
                        "{:.3} ms ({:.3} less traps)",
                        t / 1e6,
                        (t - 2.0 * trap_ns as f64) / 1e6
                    )
                } else {
                    format!("{:.3} ms", t / 1e6)
                }),
            }
        )?;
    }
    if trap_ns > 0 {
        writeln!(
            s,
            "   (the engine times each call around it, from its caller: that holds the probe's own two debug traps, {:.0} µs each here, calibrated, and whatever the caller waited for around the call (the GIL, on a thread that shares it); \"less traps\" takes the traps out, and where the engine also times the call inside it, that figure is the one to compare)",
            trap_ns as f64 / 1e3
        )?;
    }
    // Throughput from the engine's own /metrics, as scraped (every engine of the recording).
    let ix = crate::metrics::MetricIndex::new(rec);
    let ours: Option<f64> = ix
        .engines()
        .filter_map(|e| {
            ix.rate(
                e,
                &crate::metrics::names::GENERATION_TOKENS,
                rel(w0),
                rel(w1),
            )
        })
        .reduce(|a, b| a + b);
    if let Some(ours) = ours {
        let truth = api_t
            .as_ref()
            .and_then(|t| t["generation_tokens"]["per_s_window"].as_f64());
        writeln!(
            s,
            "throughput: {ours:.0} generated tokens/s from vllm:generation_tokens_total   engine's own: {}",
            truth.map_or("-".to_string(), |t| format!("{t:.0}"))
        )?;
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_engine_file_is_built_in() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/engine");
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".py") {
                assert!(
                    super::ENGINE_FILES.iter().any(|(n, _)| *n == name),
                    "samples/engine/{name} is missing from demo::ENGINE_FILES"
                );
            }
        }
    }
}
