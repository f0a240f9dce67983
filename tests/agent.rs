//! `enginescope agent` end to end: the exported metrics and the rotating segments against the
//! workloads' own ground truth, a real Prometheus server scraping the agent and answering
//! PromQL, and a soak with processes and threads coming and going (memory and disk stay flat).
//!
//! Workloads signal readiness themselves (READY, GO); waits on the agent poll a condition with
//! a deadline (a line on its stderr, a value on /metrics, Prometheus answering).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use common::*;
use enginescope::record::{read_recording, Recording};
use serde_json::Value;

/// One live test at a time: each loads the 2-core machine and measures against truth.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A running `enginescope agent`; killed on drop.
struct Agent {
    child: Child,
    lines: Receiver<String>,
    log: String,
    addr: String,
}

impl Agent {
    fn start(args: &[&str]) -> Agent {
        let mut child = Command::new(env!("CARGO_BIN_EXE_enginescope"))
            .arg("agent")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn enginescope agent");
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in stderr.lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut a = Agent {
            child,
            lines,
            log: String::new(),
            addr: String::new(),
        };
        let l = a.wait_line("serving metrics on http://", Duration::from_secs(30));
        a.addr = l
            .split("http://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .unwrap()
            .to_string();
        a
    }

    /// Wait for a stderr line containing `needle`.
    fn wait_line(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.log.push_str(&l);
                    self.log.push('\n');
                    if l.contains(needle) {
                        return l;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no line with {needle:?} within {within:?}:\n{}", self.log)
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("agent exited before {needle:?}:\n{}", self.log)
                }
            }
        }
    }

    fn drain_log(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.log.push_str(&l);
            self.log.push('\n');
        }
    }

    fn metrics(&self) -> String {
        http_get(&format!("http://{}/metrics", self.addr)).expect("GET /metrics")
    }

    /// SIGINT, then wait (bounded) for a clean exit.
    fn stop(mut self) -> String {
        // SAFETY: kill(2) on the agent we started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.drain_log();
                assert!(st.success(), "agent exit {st:?}:\n{}", self.log);
                return std::mem::take(&mut self.log);
            }
            assert!(
                Instant::now() < deadline,
                "agent did not stop on SIGINT:\n{}",
                self.log
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http_get(url: &str) -> Result<String, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut r = agent.get(url).call().map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let body = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{url}: HTTP {status}: {body}"));
    }
    Ok(body)
}

/// One exposed sample: name, labels, value.
#[derive(Debug, Clone)]
struct Exposed {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parse the Prometheus text format (as the agent writes it: no timestamps).
fn parse_exposition(text: &str) -> Vec<Exposed> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((n, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or(rest);
                let mut labels = BTreeMap::new();
                let mut chars = body.chars().peekable();
                loop {
                    let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
                    if key.is_empty() {
                        break;
                    }
                    assert_eq!(chars.next(), Some('"'));
                    let mut v = String::new();
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => {
                                if let Some(e) = chars.next() {
                                    v.push(if e == 'n' { '\n' } else { e });
                                }
                            }
                            '"' => break,
                            c => v.push(c),
                        }
                    }
                    labels.insert(key.trim_start_matches(',').to_string(), v);
                    if chars.peek() == Some(&',') {
                        chars.next();
                    }
                }
                (n.to_string(), labels)
            }
        };
        out.push(Exposed {
            name,
            labels,
            value,
        });
    }
    out
}

/// Sum of the samples named `name` whose labels include every pair of `want`.
fn sum_of(exp: &[Exposed], name: &str, want: &[(&str, &str)]) -> f64 {
    exp.iter()
        .filter(|e| e.name == name)
        .filter(|e| {
            want.iter()
                .all(|(k, v)| e.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|e| e.value)
        .sum()
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    enginescope::record::rotate::list_segments(dir)
        .unwrap()
        .into_iter()
        .map(|s| s.path)
        .collect()
}

/// (thread name → on-CPU s, off-CPU s) over all segments, all of it and within [a, b)
/// (absolute CLOCK_MONOTONIC ns).
#[derive(Default, Debug)]
struct Totals {
    cpu: BTreeMap<String, f64>,
    offcpu: BTreeMap<String, f64>,
    cpu_in: BTreeMap<String, f64>,
    offcpu_in: BTreeMap<String, f64>,
}

fn totals(recs: &[Recording], a: u64, b: u64) -> Totals {
    let mut t = Totals::default();
    for r in recs {
        let t0 = r.meta.start_mono_ns;
        for s in &r.samples {
            let name = r.thread_name(s.pid, s.tid).to_string();
            let secs = s.weight_ns as f64 / 1e9;
            *t.cpu.entry(name.clone()).or_default() += secs;
            if (a..b).contains(&(t0 + s.t_ns)) {
                *t.cpu_in.entry(name).or_default() += secs;
            }
        }
        for o in &r.offcpu {
            let name = r.thread_name(o.pid, o.tid).to_string();
            *t.offcpu.entry(name.clone()).or_default() += o.dur_ns as f64 / 1e9;
            let s = t0 + o.start_ns;
            let e = s + o.dur_ns;
            let clipped = e.min(b).saturating_sub(s.max(a));
            *t.offcpu_in.entry(name).or_default() += clipped as f64 / 1e9;
        }
    }
    t
}

/// Poll `cond` until it holds or `within` passes; the last value either way.
fn poll_until<T>(within: Duration, every: Duration, mut f: impl FnMut() -> (bool, T)) -> T {
    let deadline = Instant::now() + within;
    loop {
        let (ok, v) = f();
        if ok || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(every);
    }
}

/// cpu_mix under the agent with segments of 1.5 s: the exported per-thread CPU and off-CPU
/// counters equal the segments' sums exactly (nothing lost or counted twice across
/// rotations), the segments' in-window figures match the truth (on/off-CPU within 3 points of
/// the window, as for `record`), and every segment reads on its own in report, diff and flame.
#[test]
fn agent_metrics_and_segments_match_truth_across_rotations() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let mut w = start(
        &i,
        "cpu_mix.py",
        &[
            "--truth",
            "{dir}/truth.json",
            "--duration",
            "6",
            "--go-fifo",
            "{dir}/go",
        ],
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("segs");
    let pid = w.pid.to_string();
    let mut agent = Agent::start(&[
        "--pid",
        &pid,
        "--backend",
        "bpf",
        "--listen",
        "127.0.0.1:0",
        "--dir",
        dir.to_str().unwrap(),
        "--rate",
        "499",
        "--segment-seconds",
        "1.5",
        "--poll",
        "0.2",
    ]);
    agent.wait_line("sampling started", Duration::from_secs(30));
    w.go();
    let st = w.child.wait().unwrap();
    assert!(st.success(), "workload failed: {st:?}");
    let truth = read_json(&w.dir.join("truth.json"));
    agent.wait_line("every --pid target has exited", Duration::from_secs(30));

    // Every segment is complete now; the agent has caught up when its counters equal them.
    let recs: Vec<Recording> = segments(&dir)
        .iter()
        .map(|p| read_recording(p).unwrap())
        .collect();
    assert!(
        recs.len() >= 4,
        "{} segments for ~7 s at 1.5 s each",
        recs.len()
    );
    for r in &recs[..recs.len() - 1] {
        assert_eq!(r.end.as_ref().unwrap().reason, "rotated");
    }
    let a = truth["window"]["start_mono_ns"].as_u64().unwrap();
    let b = truth["window"]["end_mono_ns"].as_u64().unwrap();
    let wall = (b - a) as f64 / 1e9;
    let seg = totals(&recs, a, b);
    let names: Vec<String> = truth["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    let role = format!("pid{}", w.pid);
    let exported = |exp: &[Exposed], fam: &str, name: &str| {
        sum_of(
            exp,
            fam,
            &[("engine", ""), ("role", role.as_str()), ("thread", name)],
        )
    };
    let exp = poll_until(Duration::from_secs(15), Duration::from_millis(200), || {
        let exp = parse_exposition(&agent.metrics());
        let caught_up = names.iter().all(|n| {
            let c = exported(&exp, "enginescope_thread_cpu_seconds_total", n);
            let o = exported(&exp, "enginescope_thread_offcpu_seconds_total", n);
            (c - seg.cpu.get(n).copied().unwrap_or(0.0)).abs() < 1e-6
                && (o - seg.offcpu.get(n).copied().unwrap_or(0.0)).abs() < 1e-6
        });
        (caught_up, exp)
    });
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for t in truth["threads"].as_array().unwrap() {
        let n = t["name"].as_str().unwrap();
        let truth_cpu = t["cpu_s"].as_f64().unwrap();
        let truth_off = t["offcpu_s"].as_f64().unwrap();
        let got_cpu = exported(&exp, "enginescope_thread_cpu_seconds_total", n);
        let got_off = exported(&exp, "enginescope_thread_offcpu_seconds_total", n);
        let seg_cpu = seg.cpu.get(n).copied().unwrap_or(0.0);
        let seg_off = seg.offcpu.get(n).copied().unwrap_or(0.0);
        let in_cpu = seg.cpu_in.get(n).copied().unwrap_or(0.0);
        let in_off = seg.offcpu_in.get(n).copied().unwrap_or(0.0);
        report.push(format!(
            "{n}: exported cpu {got_cpu:.3} s (segments {seg_cpu:.3}), off {got_off:.3} (segments {seg_off:.3}); in window cpu {in_cpu:.3} (truth {truth_cpu:.3}), off {in_off:.3} (truth {truth_off:.3}) of {wall:.3} s"
        ));
        if (got_cpu - seg_cpu).abs() > 1e-6 || (got_off - seg_off).abs() > 1e-6 {
            failures.push(format!("{n}: exported counters differ from the segments"));
        }
        if ((in_cpu - truth_cpu) / wall).abs() > 0.03 {
            failures.push(format!("{n}: on-CPU share off by more than 3 points"));
        }
        if ((in_off - truth_off) / wall).abs() > 0.03 {
            failures.push(format!("{n}: off-CPU share off by more than 3 points"));
        }
        // Outside the window the workload only started up and wound down: well under 0.5 s.
        if got_cpu < in_cpu - 1e-6 || got_cpu - in_cpu > 0.5 {
            failures.push(format!(
                "{n}: CPU outside the window {:.3} s",
                got_cpu - in_cpu
            ));
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{failures:?}\n{}", report.join("\n"));
    // Other families present, with their labels.
    assert!(exp
        .iter()
        .any(|e| e.name == "enginescope_samples_lost_total"));
    assert_eq!(
        sum_of(
            &exp,
            "enginescope_info",
            &[("backend", "bpf"), ("mode", "pid")]
        ),
        1.0
    );
    assert!(sum_of(&exp, "enginescope_recording_rotations_total", &[]) >= (recs.len() - 1) as f64);
    assert_eq!(
        sum_of(&exp, "enginescope_recording_segments", &[]),
        recs.len() as f64
    );
    let hot_a = sum_of(
        &exp,
        "enginescope_function_cpu_seconds_total",
        &[("function", "hot_a"), ("file", "cpu_mix.py")],
    );
    let truth_hot_a = truth["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "mix-cpu")
        .map(|t| t["functions"]["hot_a"]["cpu_s"].as_f64().unwrap())
        .unwrap();
    assert!(
        hot_a >= truth_hot_a * 0.9 && hot_a <= truth_hot_a * 1.1 + 0.5,
        "hot_a self time {hot_a:.3} s, truth {truth_hot_a:.3} s in the window"
    );

    // Each segment reads on its own.
    let segs = segments(&dir);
    let bin = env!("CARGO_BIN_EXE_enginescope");
    for (k, p) in segs.iter().enumerate() {
        let out = Command::new(bin)
            .args(["report", "--format", "json"])
            .arg(p)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "report {}: {}",
            p.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let j: Value = serde_json::from_slice(&out.stdout).unwrap();
        let threads: Vec<&str> = j["threads"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|t| t["name"].as_str())
            .collect();
        // Every thread of the process is named in every segment (the tables are carried).
        if k + 1 < segs.len() {
            for n in ["mix-cpu", "mix-main"] {
                assert!(threads.contains(&n), "{}: {threads:?}", p.display());
            }
        }
    }
    let svg = tmp.path().join("f.svg");
    let out = Command::new(bin)
        .arg("flame")
        .arg(&segs[1])
        .arg("-o")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(bin)
        .arg("diff")
        .arg(&segs[1])
        .arg(&segs[2])
        .args(["--format", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = agent.stop();
    assert!(!log.contains("panicked"), "{log}");
}
