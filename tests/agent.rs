//! `enginescope agent` end to end: the exported metrics and the rotating segments against the
//! workloads' own ground truth, a real Prometheus server scraping the agent and answering
//! PromQL, and a soak with processes and threads coming and going (memory and disk stay flat).
//!
//! Workloads signal readiness themselves (READY, GO); waits on the agent poll a condition with
//! a deadline (a line on its stderr, a value on /metrics, Prometheus answering).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::agent::*;
use common::*;
use enginescope::record::{read_recording, Recording};
use serde_json::Value;

/// One live test at a time: each loads the 2-core machine and measures against truth.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Records of raw samples, off-CPU intervals and GIL waits (tags 6, 7, 10) in a recording.
fn raw_event_records(path: &Path) -> usize {
    let b = std::fs::read(path).unwrap();
    let mut i = 8;
    let mut n = 0;
    while i < b.len() {
        let tag = b[i];
        let (mut len, mut shift, mut j) = (0usize, 0, i + 1);
        while j < b.len() {
            len |= ((b[j] & 0x7f) as usize) << shift;
            shift += 7;
            j += 1;
            if b[j - 1] & 0x80 == 0 {
                break;
            }
        }
        if matches!(tag, 6 | 7 | 10) {
            n += 1;
        }
        i = j + len;
    }
    n
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

/// cpu_mix under the agent with segments of 1.5 s: the exported per-thread CPU and off-CPU
/// counters equal the segments' sums exactly (nothing lost or counted twice across
/// rotations), the segments' in-window figures match the truth (on/off-CPU within 3 points of
/// the window, as for `record`), and every segment reads on its own in report, diff and flame.
/// Raw events (`--raw-events`).
#[test]
fn agent_metrics_and_segments_match_truth_across_rotations() {
    agent_matches_truth(None);
}

/// The same in the agent's default, aggregated form (`--profile-seconds 0.1`): every segment
/// holds aggregated intervals and no raw sample, off-CPU or GIL-wait record, the exported
/// counters still equal the segments' sums exactly, and the in-window figures match the truth
/// within 3 points plus the two intervals at the window's edges (events read back spread over
/// their interval).
#[test]
fn agent_metrics_and_aggregated_segments_match_truth_across_rotations() {
    agent_matches_truth(Some(0.1));
}

fn agent_matches_truth(profile_seconds: Option<f64>) {
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
    let interval = profile_seconds.map(|s| s.to_string());
    let mut args = vec![
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
    ];
    match &interval {
        Some(s) => args.extend(["--profile-seconds", s.as_str()]),
        None => args.push("--raw-events"),
    }
    let mut agent = Agent::start(&args);
    agent.wait_line("sampling started", Duration::from_secs(30));
    let steal_before = common::cpu::steal_s();
    w.go();
    let st = w.child.wait().unwrap();
    let stolen_s = common::cpu::steal_s() - steal_before;
    assert!(st.success(), "workload failed: {st:?}");
    let truth = read_json(&w.dir.join("truth.json"));
    agent.wait_line("every --pid target has exited", Duration::from_secs(30));

    // Every segment is complete now; the agent has caught up when its counters equal them.
    let recs: Vec<Recording> = segments(&dir)
        .iter()
        .map(|p| read_recording(p).unwrap())
        .collect();
    // ~7 s at 1.5 s each: 4-5 segments. What is checked here is that nothing is lost or
    // counted twice across rotations, which needs two of them at least; a segment that lasts
    // longer than its 1.5 s (the recording loop held up on a loaded machine: 2.64 s once, 3
    // segments in all once, in CI runs beside the other agent tests) is a defect of its own,
    // shown here with the loop's priority, not this test's subject.
    let ages: Vec<String> = recs
        .iter()
        .map(|r| {
            format!(
                "{:.2} s (real-time {:?}, regained {:?})",
                r.end.as_ref().map_or(0.0, |e| e.duration_ns as f64 / 1e9),
                r.counters.get("recorder_realtime"),
                r.counters.get("recorder_realtime_regained"),
            )
        })
        .collect();
    eprintln!("segments: {ages:?}");
    assert!(
        recs.len() >= 3,
        "{} segments for ~7 s at 1.5 s each: {ages:?}",
        recs.len()
    );
    for r in &recs[..recs.len() - 1] {
        assert_eq!(r.end.as_ref().unwrap().reason, "rotated");
    }
    // The form asked for: aggregated segments have intervals, and no thread of cpu_mix (no
    // event loop) keeps raw events; raw ones have none.
    let with_intervals = recs
        .iter()
        .filter(|r| !r.profile_intervals.is_empty())
        .count();
    match profile_seconds {
        Some(_) => {
            // A segment in which nothing happened (the workload still waiting for its go, or
            // gone right after a rotation) has no interval to write; every other one is
            // aggregated.
            for (i, r) in recs.iter().enumerate() {
                let events = r.samples.len() + r.offcpu.len() + r.gil_waits.len() + r.calls.len();
                eprintln!(
                    "segment {i}: {} intervals, {events} events, {:.2} s",
                    r.profile_intervals.len(),
                    r.end.as_ref().map_or(0.0, |e| e.duration_ns as f64 / 1e9)
                );
                assert!(
                    !r.profile_intervals.is_empty() || events == 0,
                    "segment {i}: {events} events and no aggregated interval"
                );
            }
            assert!(with_intervals >= recs.len() - 2, "every segment aggregated");
            for p in segments(&dir) {
                let raw = raw_event_records(&p);
                assert_eq!(raw, 0, "{}: {raw} raw event records", p.display());
            }
        }
        None => assert_eq!(with_intervals, 0, "raw events asked for"),
    }
    // Events read back from an interval are spread over it: in-window sums are exact to an
    // interval at each edge of the window.
    let edge_s = 2.0 * profile_seconds.unwrap_or(0.0);
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
    // The recorder ends its last segment with the threads' last intervals, then its counters
    // (rotations among them), then the end record; the agent may read a prefix of that. It
    // has read the whole when the rotations counted equal the segments' boundaries.
    let rotations = (recs.len() - 1) as f64;
    let exp = poll_until(Duration::from_secs(15), Duration::from_millis(200), || {
        let exp = parse_exposition(&agent.metrics());
        let caught_up = sum_of(&exp, "enginescope_recording_rotations_total", &[]) == rotations
            && names.iter().all(|n| {
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
            "{n}: exported cpu {got_cpu:.3} s (segments {seg_cpu:.3}), off {got_off:.3} (segments {seg_off:.3}); in window cpu {in_cpu:.3} (truth {truth_cpu:.3}), off {in_off:.3} (truth {truth_off:.3}) of {wall:.3} s; machine steal {stolen_s:.3} s"
        ));
        if (got_cpu - seg_cpu).abs() > 1e-6 || (got_off - seg_off).abs() > 1e-6 {
            failures.push(format!("{n}: exported counters differ from the segments"));
        }
        if (in_cpu - truth_cpu).abs() / wall > 0.03 + edge_s / wall {
            failures.push(format!("{n}: on-CPU share off by more than 3 points"));
        }
        // The truth's off-CPU is wall less CPU time: it holds what the hypervisor took while
        // the thread ran, which the recording has as stolen intervals (the machine's steal is
        // in the message, for a miss).
        if (in_off - truth_off).abs() / wall > 0.03 + edge_s / wall {
            failures.push(format!("{n}: off-CPU share off by more than 3 points"));
        }
        // Outside the window the workload only started up and wound down: well under 0.5 s.
        if got_cpu < in_cpu - 1e-6 || got_cpu - in_cpu > 0.5 + edge_s {
            failures.push(format!(
                "{n}: CPU outside the window {:.3} s",
                got_cpu - in_cpu
            ));
        }
    }
    // For a miss: whether the recorder lost events (a full ring buffer) or fell behind.
    let mut lost: BTreeMap<String, u64> = BTreeMap::new();
    for r in &recs {
        for (k, v) in &r.counters {
            if k.contains("lost") || k.contains("late") || k.contains("drain") {
                // Counters are the recorder's running totals: the last segment's are the most.
                let e = lost.entry(k.clone()).or_default();
                *e = (*e).max(*v);
            }
        }
    }
    report.push(format!(
        "recorder counters (the most any segment says): {lost:?}"
    ));
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
    assert_eq!(
        sum_of(&exp, "enginescope_recording_rotations_total", &[]),
        rotations,
        "rotations exported against the segments written"
    );
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

/// A Prometheus server on loopback with a temporary config and storage; killed on drop.
struct Prometheus {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(bin: &Path, target: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: enginescope\n    scrape_interval: 1s\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        let ready = poll_until(Duration::from_secs(60), Duration::from_millis(200), || {
            let ok = http_get(&format!("{}/-/ready", p.base)).is_ok();
            (ok, ok)
        });
        assert!(ready, "prometheus did not become ready");
        p
    }

    /// An instant query (at `time`, Unix seconds, or now): (labels, value) per series.
    fn query(&self, q: &str, time: Option<f64>) -> Vec<(BTreeMap<String, String>, f64)> {
        let mut url = format!("{}/api/v1/query?query={}", self.base, urlencode(q));
        if let Some(t) = time {
            url.push_str(&format!("&time={t:.3}"));
        }
        let body = http_get(&url).unwrap_or_else(|e| panic!("{q}: {e}"));
        let j: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(j["status"], "success", "{q}: {body}");
        j["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let labels = r["metric"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                    .collect();
                let v = r["value"][1].as_str().unwrap().parse::<f64>().unwrap();
                (labels, v)
            })
            .collect()
    }

    /// The single value of a query that must return one series.
    fn one(&self, q: &str, time: Option<f64>) -> f64 {
        let r = self.query(q, time);
        assert_eq!(r.len(), 1, "{q}: {r:?}");
        r[0].1
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// CLOCK_MONOTONIC ns → Unix seconds (the offset read now).
fn mono_to_unix(mono_ns: u64) -> f64 {
    let now_mono = enginescope::sys::monotonic_ns();
    let now_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    now_unix - (now_mono as f64 - mono_ns as f64) / 1e9
}

/// A real Prometheus (Debian's package, on loopback, scraping every second) scrapes the agent
/// recording cpu_mix (probing `hot_b`) and gc_churn; its PromQL answers are checked against
/// the workloads' truth: per-thread CPU rates mid-window, the thread-name label set, gen-0 GC
/// pause rate and median (histogram_quantile), and, at the end, totals that equal the agent's
/// own /metrics and whose in-window part matches the truth (GC pauses per generation, probed
/// calls and their total duration).
#[test]
fn prometheus_scrapes_the_agent_and_answers_promql() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(prom_bin) = tool_binary("prometheus", "prometheus") else {
        return;
    };
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let args = [
        "--truth",
        "{dir}/truth.json",
        "--duration",
        "10",
        "--go-fifo",
        "{dir}/go",
    ];
    let mut mix = start(&i, "cpu_mix.py", &args);
    let mut gcw = start(&i, "gc_churn.py", &args);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("segs");
    let pids = format!("{},{}", mix.pid, gcw.pid);
    let mut agent = Agent::start(&[
        "--pid",
        &pids,
        "--backend",
        "bpf",
        "--listen",
        "127.0.0.1:0",
        "--dir",
        dir.to_str().unwrap(),
        "--rate",
        "199",
        "--poll",
        "0.25",
        "--segment-seconds",
        "4",
        // Aggregated (the default form) in intervals short against PromQL's 6 s ranges.
        "--profile-seconds",
        "0.25",
        "--probe",
        "cpu_mix.py:hot_b",
        "--exact-probes",
    ]);
    // The probe is placed before the window begins (`sampling started`).
    agent.wait_line("probe cpu_mix.py:hot_b -> hot_b", Duration::from_secs(30));
    agent.wait_line("sampling started", Duration::from_secs(30));
    let t0 = Instant::now();
    let prom = Prometheus::start(&prom_bin, &agent.addr);
    eprintln!("prometheus ready after {:?}", t0.elapsed());
    let up = poll_until(Duration::from_secs(30), Duration::from_millis(250), || {
        let r = prom.query(r#"up{job="enginescope"}"#, None);
        (r.first().is_some_and(|x| x.1 == 1.0), r)
    });
    assert!(
        up.first().is_some_and(|x| x.1 == 1.0),
        "agent not scraped: {up:?}"
    );
    eprintln!("scraped after {:?}", t0.elapsed());
    mix.go();
    gcw.go();
    assert!(mix.child.wait().unwrap().success());
    assert!(gcw.child.wait().unwrap().success());
    let t_mix = read_json(&mix.dir.join("truth.json"));
    let t_gc = read_json(&gcw.dir.join("truth.json"));
    agent.wait_line("every --pid target has exited", Duration::from_secs(30));
    eprintln!("workloads done after {:?}", t0.elapsed());

    let mut report = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut check = |ok: bool, what: String| {
        report.push(format!("{} {what}", if ok { "ok  " } else { "FAIL" }));
        if !ok {
            failures.push(what);
        }
    };

    // Thread names as labels: every thread of cpu_mix has a series.
    let mix_role = format!("pid{}", mix.pid);
    let series = prom.query(
        &format!(r#"enginescope_thread_offcpu_seconds_total{{role="{mix_role}"}}"#),
        None,
    );
    let mut got_names: Vec<String> = series
        .iter()
        .filter_map(|(l, _)| l.get("thread").cloned())
        .collect();
    got_names.sort();
    let mut want_names: Vec<String> = t_mix["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    want_names.sort();
    check(
        got_names == want_names,
        format!("thread label values {got_names:?} = truth {want_names:?}"),
    );

    // Rates mid-window: a 6 s range ending 1 s before the window's end (the agent's figures
    // trail the workload by up to half a second).
    let a = t_mix["window"]["start_mono_ns"].as_u64().unwrap();
    let b = t_mix["window"]["end_mono_ns"].as_u64().unwrap();
    let wall = (b - a) as f64 / 1e9;
    let at = mono_to_unix(b) - 1.0;
    for t in t_mix["threads"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        if !["mix-cpu", "mix-sleeper"].contains(&name) {
            continue;
        }
        let want = t["cpu_s"].as_f64().unwrap() / wall;
        let got = prom.one(
            &format!(
                r#"rate(enginescope_thread_cpu_seconds_total{{role="{mix_role}",thread="{name}"}}[6s])"#
            ),
            Some(at),
        );
        check(
            (got - want).abs() <= 0.05 + 0.1 * want,
            format!("rate(thread_cpu {name}[6s]) = {got:.3} CPU, truth {want:.3}"),
        );
    }
    let ga = t_gc["window"]["start_mono_ns"].as_u64().unwrap();
    let gb = t_gc["window"]["end_mono_ns"].as_u64().unwrap();
    let gc_role = format!("pid{}", gcw.pid);
    // The truth over the same 6 s as the query, from the workload's own list of pauses (their
    // rate follows the CPU the allocators get: against the whole window's mean, a loaded
    // machine's slower last seconds read as a wrong rate, 65.1/s against 94.9/s once).
    let (r0, r1) = (gb - 7_000_000_000, gb - 1_000_000_000);
    let want_rate = t_gc["pause_list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p[2].as_i64() == Some(0))
        .filter(|p| p[0].as_u64().is_some_and(|t| (r0..r1).contains(&t)))
        .count() as f64
        / 6.0;
    let got_rate = prom.one(
        &format!(
            r#"sum(rate(enginescope_gc_pause_seconds_count{{role="{gc_role}",generation="0"}}[6s]))"#
        ),
        Some(mono_to_unix(r1)),
    );
    check(
        (got_rate / want_rate - 1.0).abs() <= 0.15,
        format!("gen-0 pauses {got_rate:.1}/s, truth {want_rate:.1}/s"),
    );
    // Median gen-0 pause: histogram_quantile interpolates inside a bucket (buckets 2-2.5x
    // apart), so it is held to within one bucket of the truth.
    let mut durs: Vec<f64> = t_gc["pause_list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p[2].as_i64() == Some(0))
        .map(|p| p[1].as_f64().unwrap() / 1e9)
        .collect();
    durs.sort_by(f64::total_cmp);
    let want_median = durs[durs.len() / 2];
    let got_median = prom.one(
        &format!(
            r#"histogram_quantile(0.5, sum by (le) (rate(enginescope_gc_pause_seconds_bucket{{role="{gc_role}",generation="0"}}[6s])))"#
        ),
        Some(mono_to_unix(gb) - 1.0),
    );
    check(
        got_median / want_median <= 2.5 && want_median / got_median <= 2.5,
        format!("gen-0 median pause {got_median:.6} s, truth {want_median:.6} s"),
    );

    // Totals at the end: what Prometheus stored equals what the agent serves, and their
    // in-window part (from the segments the counters were made from) matches the truth.
    let recs: Vec<Recording> = segments(&dir)
        .iter()
        .map(|p| read_recording(p).unwrap())
        .collect();
    // The agent has caught up once it serves every pause and call the segments hold.
    let seg_pauses = recs.iter().map(|r| r.gc_pauses.len()).sum::<usize>() as f64;
    let seg_calls = recs.iter().map(|r| r.calls.len()).sum::<usize>() as f64;
    let exp = poll_until(Duration::from_secs(15), Duration::from_millis(200), || {
        let exp = parse_exposition(&agent.metrics());
        let p = sum_of(&exp, "enginescope_gc_pause_seconds_count", &[]);
        let c = sum_of(&exp, "enginescope_probe_call_duration_seconds_count", &[]);
        (p == seg_pauses && c == seg_calls, exp)
    });
    check(
        sum_of(&exp, "enginescope_gc_pause_seconds_count", &[]) == seg_pauses,
        format!("agent serves the segments' {seg_pauses} GC pauses"),
    );
    for g in 0..3 {
        let q = format!(
            r#"sum(enginescope_gc_pause_seconds_count{{role="{gc_role}",generation="{g}"}})"#
        );
        let served = sum_of(
            &exp,
            "enginescope_gc_pause_seconds_count",
            &[("role", gc_role.as_str()), ("generation", &g.to_string())],
        );
        let stored = poll_until(Duration::from_secs(10), Duration::from_millis(250), || {
            let v = prom.query(&q, None).first().map(|x| x.1).unwrap_or(-1.0);
            (v == served, v)
        });
        check(
            stored == served,
            format!("gen {g}: Prometheus {stored} pauses = agent {served}"),
        );
        let starts: Vec<u64> = recs
            .iter()
            .flat_map(|r| {
                r.gc_pauses
                    .iter()
                    .filter(|p| p.pid == gcw.pid && p.generation == g as i8)
                    .map(move |p| r.meta.start_mono_ns + p.start_ns)
            })
            .collect();
        let in_window = starts.iter().filter(|t| (ga..gb).contains(*t)).count() as f64;
        // Pauses read back from an aggregated interval (0.25 s) are spread over it, as calls
        // are: those of the intervals at the window's edges may fall on the wrong side.
        let near_edge = starts
            .iter()
            .filter(|t| t.abs_diff(ga) < 250_000_000 || t.abs_diff(gb) < 250_000_000)
            .count() as f64;
        let want = t_gc["by_generation"][g.to_string()]["pauses"]
            .as_f64()
            .unwrap_or(0.0);
        check(
            (in_window - want).abs() <= (0.01 * want).max(1.0) + near_edge && served >= in_window,
            format!(
                "gen {g}: {in_window} pauses in the window (truth {want}, {near_edge} within \
                 an interval of its edges), {served} in all"
            ),
        );
    }
    let mix_pid = mix.pid;
    let probe_q = format!(
        r#"enginescope_probe_call_duration_seconds_count{{role="{mix_role}",function="hot_b",method="exact"}}"#
    );
    let served = sum_of(
        &exp,
        "enginescope_probe_call_duration_seconds_count",
        &[("role", mix_role.as_str()), ("function", "hot_b")],
    );
    let stored = poll_until(Duration::from_secs(10), Duration::from_millis(250), || {
        let v = prom
            .query(&probe_q, None)
            .first()
            .map(|x| x.1)
            .unwrap_or(-1.0);
        (v == served, v)
    });
    check(
        stored == served && served > 0.0,
        format!("hot_b: Prometheus {stored} calls = agent {served}"),
    );
    let calls: Vec<(u64, u64)> = recs
        .iter()
        .flat_map(|r| {
            r.calls
                .iter()
                .filter(|c| c.pid == mix_pid)
                .map(move |c| (r.meta.start_mono_ns + c.start_ns, c.dur_ns))
        })
        .filter(|(s, _)| (a..b).contains(s))
        .collect();
    // Calls read back from an interval are spread over it: those of the intervals at the
    // window's edges may fall on the wrong side.
    let edge_ns = 250_000_000;
    let near_edge = calls
        .iter()
        .filter(|(s, _)| s.abs_diff(a) < edge_ns || s.abs_diff(b) < edge_ns)
        .count() as f64;
    let mix_cpu = t_mix["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "mix-cpu")
        .unwrap();
    let want_calls = mix_cpu["functions"]["hot_b"]["calls"].as_f64().unwrap();
    let want_wall = mix_cpu["functions"]["hot_b"]["wall_s"].as_f64().unwrap();
    let got_wall: f64 = calls.iter().map(|c| c.1 as f64 / 1e9).sum();
    check(
        (calls.len() as f64 - want_calls).abs() <= 0.02 * want_calls + 2.0 + near_edge,
        format!(
            "hot_b: {} calls in the window, truth {want_calls}",
            calls.len()
        ),
    );
    check(
        (got_wall / want_wall - 1.0).abs() <= 0.10,
        format!("hot_b: {got_wall:.3} s in calls, truth {want_wall:.3} s"),
    );
    let sum_stored = prom.one(
        &format!(
            r#"enginescope_probe_call_duration_seconds_sum{{role="{mix_role}",function="hot_b"}}"#
        ),
        None,
    );
    check(
        sum_stored >= got_wall * 0.999,
        format!("hot_b: Prometheus _sum {sum_stored:.3} s covers the window's {got_wall:.3} s"),
    );
    let lost = prom.one("enginescope_samples_lost_total", None);
    check(lost >= 0.0, format!("samples lost series present ({lost})"));
    eprintln!("{}", report.join("\n"));
    drop(prom);
    agent.stop();
    assert!(failures.is_empty(), "{failures:?}\n{}", report.join("\n"));
}

/// A GIL fight (samples/gil_contention.py: a writer scanning in `_evict_to_fit` holds the GIL
/// against a launcher stepping a model) under the agent, scraped by a real Prometheus: the
/// writer and the launcher have series of their own, labelled by Python name, and PromQL's
/// per-thread CPU, GIL-held and GIL-wait totals match the workload's truth. With
/// `--thread-names python` the two threads have distinct Python names and share the process's
/// OS name (Python before 3.14); with `same` both are `engine-worker` and only their thread ids
/// tell them apart: the lower id keeps the bare name, the other is `engine-worker#2`.
///
/// The workers run only inside the window (`--gate`: blocked from READY to GO, stopped at its
/// end), so the totals Prometheus stores are the window's, give or take the step and the put
/// straddling its end. Tolerances: CPU and GIL-held time are sampled (--rate 499: ~1000
/// samples of the launcher, ~1500 of the writer in 8 s; 1σ 2.5-3%): within 15% + 50 ms of the
/// thread's CPU time (time.thread_time_ns); a thread on CPU runs Python and so holds the GIL,
/// apart from its few instructions around each blocking call: held within [0.8, 1.1] of it.
/// GIL waits are timed exactly (futex waits on the GIL) and compared with the truth's
/// brackets, which widen with the run queue (other processes on the 2 cores): the launcher's
/// [gil_wait_excl_runq_s, gil_wait_upper_s] and the writer's [gil_wait_lower_s,
/// gil_wait_upper_s], each ±10% and ± the truth's error (one step's wait at each window edge
/// and the calibration's random error) for the launcher, ± one put (10 ms) for the writer.
const SWITCH_WAIT: &str = "enginescope_thread_gil_switch_wait_seconds_total";

fn gil_fight_series(names: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(prom_bin) = tool_binary("prometheus", "prometheus") else {
        return;
    };
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let mut w = start(
        &i,
        "gil_contention.py",
        &[
            "--truth",
            "{dir}/truth.json",
            "--duration",
            "8",
            "--go-fifo",
            "{dir}/go",
            "--thread-names",
            names,
            "--gate",
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
        "--poll",
        "0.25",
    ]);
    agent.wait_line("sampling started", Duration::from_secs(30));
    let prom = Prometheus::start(&prom_bin, &agent.addr);
    let up = poll_until(Duration::from_secs(30), Duration::from_millis(250), || {
        let r = prom.query(r#"up{job="enginescope"}"#, None);
        (r.first().is_some_and(|x| x.1 == 1.0), r)
    });
    assert!(
        up.first().is_some_and(|x| x.1 == 1.0),
        "agent not scraped: {up:?}"
    );
    // The OS name every thread of the workload shares (its process's, before Python 3.14).
    let os_name = std::fs::read_to_string(format!("/proc/{}/comm", w.pid))
        .unwrap()
        .trim_end()
        .to_string();
    w.go();
    assert!(w.child.wait().unwrap().success());
    let truth = read_json(&w.dir.join("truth.json"));
    agent.wait_line("every --pid target has exited", Duration::from_secs(30));

    // The expected label of each worker, from its Python name and thread id.
    let threads = truth["threads"].as_array().unwrap();
    let worker = |role: &str| {
        threads
            .iter()
            .find(|t| t["name"] == role)
            .unwrap_or_else(|| panic!("{role} in the truth: {threads:?}"))
    };
    let (lt, wt) = (worker("launcher"), worker("aux-writer"));
    let id = |t: &Value| t["native_id"].as_i64().unwrap();
    let pyname = |t: &Value| t["python_name"].as_str().unwrap().to_string();
    let (l_label, w_label) = if names == "same" {
        assert_eq!(pyname(lt), pyname(wt));
        let n = pyname(lt);
        if id(lt) < id(wt) {
            (n.clone(), format!("{n}#2"))
        } else {
            (format!("{n}#2"), n)
        }
    } else {
        (pyname(lt), pyname(wt))
    };
    assert_ne!(l_label, w_label);

    // Prometheus has stored what the agent serves, and the agent serves its final figures
    // (the workload has exited; it has caught up once two reads in a row agree).
    let role = format!("pid{}", w.pid);
    let metrics = [
        "enginescope_thread_cpu_seconds_total",
        "enginescope_thread_gil_held_seconds_total",
        "enginescope_thread_gil_wait_seconds_total",
    ];
    let by_thread = |metric: &str| -> BTreeMap<String, f64> {
        prom.query(
            &format!(r#"sum by (thread) ({metric}{{job="enginescope",role="{role}"}})"#),
            None,
        )
        .into_iter()
        .map(|(l, v)| (l.get("thread").cloned().unwrap_or_default(), v))
        .collect()
    };
    let served = || -> Vec<f64> {
        let exp = parse_exposition(&agent.metrics());
        metrics
            .iter()
            .flat_map(|m| {
                let exp = &exp;
                let role = role.as_str();
                [&l_label, &w_label]
                    .map(move |l| sum_of(exp, m, &[("role", role), ("thread", l.as_str())]))
            })
            .collect()
    };
    // The agent has caught up when it serves the CPU the finished segments hold for the two
    // workers (the last aggregated interval is written when the recorder ends: agreeing
    // reads alone may both come before the agent's next poll).
    let recs: Vec<Recording> =
        poll_until(Duration::from_secs(30), Duration::from_millis(100), || {
            let recs: Vec<Recording> = segments(&dir)
                .iter()
                .filter_map(|p| read_recording(p).ok())
                .collect();
            (recs.last().is_some_and(|r| r.end.is_some()), recs)
        });
    assert!(
        recs.last().is_some_and(|r| r.end.is_some()),
        "the recorder did not finish"
    );
    let seg_cpu = |tid: i64| -> f64 {
        recs.iter()
            .flat_map(|r| r.samples.iter())
            .filter(|s| s.tid as i64 == tid)
            .map(|s| s.weight_ns as f64 / 1e9)
            .sum()
    };
    let want_cpu = [seg_cpu(id(lt)), seg_cpu(id(wt))];
    let mut last = served();
    let (stored, agent_final) =
        poll_until(Duration::from_secs(30), Duration::from_millis(250), || {
            let now = served();
            let stored: BTreeMap<&str, BTreeMap<String, f64>> =
                metrics.iter().map(|&m| (m, by_thread(m))).collect();
            let in_prom: Vec<f64> = metrics
                .iter()
                .flat_map(|m| {
                    [&l_label, &w_label].map(|l| stored[m].get(l).copied().unwrap_or(-1.0))
                })
                .collect();
            let done = now == last
                && in_prom == now
                && (now[0] - want_cpu[0]).abs() < 1e-6
                && (now[1] - want_cpu[1]).abs() < 1e-6;
            last = now.clone();
            (done, (stored, now))
        });
    let in_prom: Vec<f64> = metrics
        .iter()
        .flat_map(|m| [&l_label, &w_label].map(|l| stored[m].get(l).copied().unwrap_or(-1.0)))
        .collect();
    assert_eq!(
        in_prom, agent_final,
        "{names}: Prometheus stores the agent's final figures ({metrics:?} x [{l_label}, {w_label}])"
    );

    let mut report = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut check = |ok: bool, what: String| {
        report.push(format!("{} {what}", if ok { "ok  " } else { "FAIL" }));
        if !ok {
            failures.push(what);
        }
    };
    // Separate series: both workers have their own, and none is labelled with the OS name
    // that all three threads share (before 3.14 the process's: python3.12).
    let labels: Vec<String> = stored[metrics[0]].keys().cloned().collect();
    check(
        labels.contains(&l_label) && labels.contains(&w_label) && !labels.contains(&os_name),
        format!(
            "thread labels {labels:?}: launcher {l_label:?}, writer {w_label:?}, not {os_name:?}"
        ),
    );
    let switch_waits = by_thread(SWITCH_WAIT);
    let val = |m: &str, l: &str| {
        if m == SWITCH_WAIT {
            &switch_waits
        } else {
            &stored[m]
        }
        .get(l)
        .copied()
        .unwrap_or(0.0)
    };
    for (t, l) in [(lt, &l_label), (wt, &w_label)] {
        let role = t["name"].as_str().unwrap();
        let cpu = t["active_cpu_s"].as_f64().unwrap();
        let got = val(metrics[0], l);
        check(
            (got - cpu).abs() <= 0.05 + 0.15 * cpu,
            format!("{role} ({l}): CPU {got:.3} s, truth {cpu:.3} s"),
        );
        let held = val(metrics[1], l);
        check(
            held >= 0.8 * cpu - 0.05 && held <= 1.1 * cpu + 0.05,
            format!("{role} ({l}): GIL held {held:.3} s, truth CPU {cpu:.3} s"),
        );
    }
    let lj = &truth["launcher"];
    let err = lj["error_s"].as_f64().unwrap();
    let want = lj["gil_wait_s"].as_f64().unwrap();
    // The bracket of tests/live_gil_gc.rs, not the calibrated estimate (that one depends on
    // how loaded the machine was during the calibration): the workload's wall - CPU also
    // counts time its vCPU was stolen by the hypervisor, which is no GIL wait, so the bracket
    // counts only the parts of each step where the launcher blocked (upper end: run-queue delay
    // after wake-ups, which a futex timing counts too) less the window's run-queue time (lower
    // end). A profiler timing the futex waits reports forced-switch handshakes apart; the
    // truth has them in its wait, so the two series are summed.
    let lo = lj["gil_wait_lower_s"].as_f64().unwrap_or(want);
    let hi = lj["gil_wait_blocked_s"].as_f64().unwrap_or(want).max(lo);
    let acquire = val(metrics[2], &l_label);
    let switch = val(SWITCH_WAIT, &l_label);
    let got = acquire + switch;
    // Where a figure is lost, if one is: the recording's own sums for the launcher.
    let (rec_acquire, rec_switch) = recs
        .iter()
        .flat_map(|r| r.gil_waits.iter())
        .filter(|g| g.tid as i64 == id(lt))
        .fold((0u64, 0u64), |(a, s), g| {
            if g.switch_wait {
                (a, s + g.dur_ns)
            } else {
                (a + g.dur_ns, s)
            }
        });
    check(
        got >= 0.9 * lo - err && got <= 1.1 * hi + err,
        format!(
            "launcher ({l_label}): GIL wait {got:.3} s (acquire {acquire:.3} + switch {switch:.3}; \
             the segments hold {:.3} + {:.3}), truth in [{lo:.3}, {hi:.3}] ± {err:.3} \
             (calibrated estimate {want:.3}, without the run queue {:?}, upper {:?}; machine \
             steal {:?} s)",
            rec_acquire as f64 / 1e9,
            rec_switch as f64 / 1e9,
            lj["gil_wait_excl_runq_s"].as_f64(),
            lj["gil_wait_upper_s"].as_f64(),
            truth["steal_s"].as_f64(),
        ),
    );
    let wj = &truth["writer"];
    let lo = wj["gil_wait_lower_s"].as_f64().unwrap();
    let hi = wj["gil_wait_upper_s"].as_f64().unwrap();
    let got = val(metrics[2], &w_label);
    check(
        got >= 0.9 * lo - 0.01 && got <= 1.1 * hi + 0.01,
        format!("writer ({w_label}): GIL wait {got:.3} s, truth in [{lo:.3}, {hi:.3}]"),
    );
    eprintln!("{names}:\n{}", report.join("\n"));
    drop(prom);
    agent.stop();
    assert!(failures.is_empty(), "{failures:?}\n{}", report.join("\n"));
}

#[test]
fn gil_fight_series_by_python_name() {
    gil_fight_series("python");
}

#[test]
fn gil_fight_series_same_python_name() {
    gil_fight_series("same");
}

/// A `/proc/PID/status` field in kB (`VmRSS`, `RssAnon`, …).
fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The agent in --vllm mode over samples/fleet_churn.py (a new worker process every ~0.5 s,
/// ~40 short-lived request threads a second, each with a new name) for ES_SOAK_SECONDS
/// (default 55) with 3 s segments and a 1 MB disk cap: its resident memory stays flat after
/// warm-up, the directory never exceeds the cap, thread series stay under their cap, new
/// processes are attached throughout, and the agent stops cleanly. The figures are printed
/// (docs/deployment.md has a 30-minute run).
/// What a process holds that it must give back when the processes it follows go: its open
/// descriptors (of them, perf events and BPF links: sampling, probes' watchpoints, uprobes), its threads,
/// and the entries of the BPF hash maps it holds (per target process and thread) that belong to
/// processes and threads gone.
#[derive(Debug, Clone, Default, PartialEq)]
struct Held {
    fds: usize,
    perf_events: usize,
    bpf_links: usize,
    threads: usize,
    map_entries: usize,
    /// `map_entries` by map name (for the failure message).
    maps: BTreeMap<String, usize>,
    /// The threads counted, by name (for the failure message).
    thread_names: BTreeMap<String, usize>,
}

fn held(pid: u32) -> Held {
    let mut h = Held::default();
    let dir = format!("/proc/{pid}/fd");
    let mut maps = Vec::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        h.fds += 1;
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let t = target.to_string_lossy();
        if t.contains("perf_event") {
            h.perf_events += 1;
        } else if t.contains("bpf_link") || t.contains("bpf-link") {
            h.bpf_links += 1;
        } else if t.contains("bpf-map") {
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                e.file_name().to_string_lossy()
            ))
            .unwrap_or_default();
            let field = |k: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(k))
                    .map(|v| v.trim().to_string())
            };
            // Hash maps only (type 1; 5 per-CPU hash, 9 LRU hash): arrays and ring buffers
            // have a fixed size.
            if matches!(field("map_type:").as_deref(), Some("1" | "5" | "9")) {
                if let Some(id) = field("map_id:") {
                    maps.push(id);
                }
            }
        }
    }
    // The agent's threads but the asyncio task readers of live processes (`es-task-PID`, one a
    // process recorded, started when the recorder next looks at its threads: a reading just
    // after an engine's attach has them or not). A reader of a process gone counts.
    h.thread_names = thread_names(pid)
        .into_iter()
        .filter(|(name, _)| {
            name.strip_prefix("es-task-")
                .and_then(|p| p.parse::<u32>().ok())
                .is_none_or(|p| !Path::new(&format!("/proc/{p}")).exists())
        })
        .collect();
    h.threads = h.thread_names.values().sum();
    maps.sort();
    maps.dedup();
    for id in maps {
        let out = Command::new("bpftool")
            .args(["map", "dump", "id", &id, "--json"])
            .output()
            .expect("bpftool (apt-get install bpftool)");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let entries = v.as_array().cloned().unwrap_or_default();
        let name = map_name(&id);
        let n = if name == "code_seen" {
            // The code objects walks read lately, per process: as many as the live processes'
            // stacks hold (tens each, coming and going with the workers); what must not stay
            // is an entry of a process gone (its detach drops them).
            entries
                .iter()
                .filter(|e| {
                    code_seen_tgid(e).is_some_and(|t| !Path::new(&format!("/proc/{t}")).exists())
                })
                .count()
        } else {
            // Keyed by a pid or thread id (targets, threads, last walks, GIL and GC state):
            // the entries of processes and threads gone. The live ones come and go with the
            // engine's request threads (more of them overlap on a busy machine).
            entries
                .iter()
                .filter(|e| key_u32(e).is_none_or(|id| !Path::new(&format!("/proc/{id}")).exists()))
                .count()
        };
        h.map_entries += n;
        if n > 0 {
            *h.maps.entry(name).or_insert(0) += n;
        }
    }
    h
}

/// A process's threads by name, with how many have each.
fn thread_names(pid: u32) -> BTreeMap<String, usize> {
    let mut names = BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        *names.entry(comm.trim().to_string()).or_insert(0) += 1;
    }
    names
}

/// A BPF map's name (`bpftool map show`).
fn map_name(id: &str) -> String {
    let out = Command::new("bpftool")
        .args(["map", "show", "id", id, "--json"])
        .output()
        .expect("bpftool (apt-get install bpftool)");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["name"].as_str().unwrap_or_default().to_string()
}

/// The process of a `code_seen` entry: bytes 8..12 of its key (`struct es_code_key`), as
/// bpftool dumps a key (hex strings, one a byte).
fn code_seen_tgid(entry: &serde_json::Value) -> Option<u32> {
    let key = key_bytes(entry)?;
    Some(u32::from_ne_bytes(key.get(8..12)?.try_into().ok()?))
}

/// A map entry's key when it is one u32 (a pid or thread id).
fn key_u32(entry: &serde_json::Value) -> Option<u32> {
    let key = key_bytes(entry)?;
    Some(u32::from_ne_bytes(key.as_slice().try_into().ok()?))
}

fn key_bytes(entry: &serde_json::Value) -> Option<Vec<u8>> {
    Some(
        entry["key"]
            .as_array()?
            .iter()
            .filter_map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
            .collect(),
    )
}

/// A number from the environment (a longer run than CI's, by hand), else `default`.
fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A vLLM-shaped engine (server, engine core, worker) killed and started again under the agent
/// (`ES_RESTARTS` times, 100 by default): every new engine followed (the recorder goes on
/// without an engine and attaches the next one's processes), every old one released:
/// descriptors, perf events, BPF links, threads (but the live engine's task readers), BPF hash
/// entries and the heap at the end as after the first ten.
#[test]
fn engine_restarted_again_and_again_is_followed_and_released() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let restarts: usize = env_number("ES_RESTARTS", 100).max(60);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("segs");
    // No engine yet: the agent tries every half second until one appears. Only the engines
    // on this test's port (another engine on the host, such as a `vllm serve` left running,
    // is not this test's).
    let port = free_port().to_string();
    let mut agent = Agent::start(&[
        "--vllm",
        "--engine-port",
        &port,
        "--backend",
        "bpf",
        "--listen",
        "127.0.0.1:0",
        "--dir",
        dir.to_str().unwrap(),
        "--rate",
        "49",
        "--retry-seconds",
        "0.5",
        "--segment-mb",
        "1",
        "--disk-mb",
        "4",
        // What a segment and an idle series hold is bounded by their age: short ones here, so
        // that what is left to grow is what the engines' comings and goings leave behind.
        "--segment-seconds",
        "10",
        "--series-idle-minutes",
        "0.1",
    ]);
    let pid = agent.child.id();
    let mut readings: Vec<(usize, Held, f64)> = Vec::new();
    let mut servers = Vec::new();
    let t0 = Instant::now();
    for k in 1..=restarts {
        let engine = start(
            &i,
            "fleet_churn.py",
            &[
                "serve",
                "--port",
                &port,
                "--workers",
                "1",
                "--worker-life",
                "1000",
                "--threads-per-s",
                "2",
                "--duration",
                "120",
            ],
        );
        if k == 1 {
            agent.wait_line("sampling started", Duration::from_secs(30));
            // The agent may have found the engine before its worker started (it looks every
            // half second): the worker is attached by rediscovery.
            let attached = agent
                .err
                .log
                .lines()
                .find_map(|l| {
                    l.split("recording ")
                        .nth(1)?
                        .split(" process(es)")
                        .next()?
                        .parse::<usize>()
                        .ok()
                })
                .expect("the agent says how many processes it records");
            for _ in attached..3 {
                agent.wait_line("attached to new engine process", Duration::from_secs(30));
            }
        } else {
            // The recorder goes on without an engine; rediscovery attaches the new one's
            // server, engine core and worker.
            for _ in 0..3 {
                agent.wait_line("attached to new engine process", Duration::from_secs(30));
            }
        }
        servers.push(engine.pid);
        if k % 10 == 0 {
            let rss = status_kb(pid, "RssAnon").expect("agent alive") as f64 / 1024.0;
            let h = held(pid);
            eprintln!(
                "restart {k}: the agent's threads (but live processes' task readers) {:?}; BPF hash entries by map {:?}",
                h.thread_names,
                h.maps
            );
            readings.push((k, h, rss));
        }
        // The whole engine dies at once (its children die with their parent).
        drop(engine);
        for _ in 0..3 {
            agent.wait_line("exited", Duration::from_secs(30));
        }
    }
    agent.drain_log();
    let restarted = agent.err.log.matches("recorder stopped after").count();
    let secs = t0.elapsed().as_secs_f64();
    let last_seg = segments(&dir).last().cloned().expect("a segment");
    let log = agent.stop();
    assert!(!log.contains("panicked"), "{log}");
    let figures = format!(
        "{restarts} restarts in {secs:.0} s; (restart, fds, perf events, BPF links, threads, BPF hash entries, heap MiB): {:?}",
        readings
            .iter()
            .map(|(k, h, rss)| {
                (*k, h.fds, h.perf_events, h.bpf_links, h.threads, h.map_entries, (rss * 10.0).round() / 10.0)
            })
            .collect::<Vec<_>>()
    );
    eprintln!("{figures}");
    // Followed: the last engine's server is in the last segment the agent wrote.
    let r = read_recording(&last_seg).unwrap();
    let last_server = *servers.last().unwrap();
    assert!(
        r.processes.iter().any(|p| p.pid == last_server),
        "the last engine ({last_server}) in {}: {figures}",
        last_seg.display()
    );
    // The recorder went on through every restart (its BPF programs loaded once).
    assert_eq!(restarted, 0, "{figures}\n{log}");
    // Released: what the agent holds with the last engines as with the first (restarts
    // 10-30 against the last three readings). A reading may catch the old engine's readers
    // still ending (a process's worth of threads and descriptors for a moment): the least of
    // each three is what stays.
    let least = |v: &[(usize, Held, f64)], f: fn(&Held) -> usize| {
        v.iter().map(|r| f(&r.1)).min().unwrap_or(0)
    };
    let (head, tail) = (&readings[..3], &readings[readings.len() - 3..]);
    for (what, f, slack) in [
        ("descriptors", (|h: &Held| h.fds) as fn(&Held) -> usize, 0),
        ("perf events", |h: &Held| h.perf_events, 0),
        ("BPF links", |h: &Held| h.bpf_links, 0),
        ("threads", |h: &Held| h.threads, 0),
        ("BPF hash entries", |h: &Held| h.map_entries, 4),
    ] {
        assert!(
            least(tail, f) <= least(head, f) + slack,
            "{what} grow as engines restart: {figures}"
        );
    }
    // The heap after warm-up (a segment's tables and an idle series live 10 s here).
    let (first, last) = (&readings[2], readings.last().unwrap());
    assert!(
        last.2 - first.2 <= 2.0,
        "the heap grows as engines restart: {figures}"
    );
}

#[test]
fn soak_memory_and_disk_stay_flat_while_processes_and_threads_churn() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let secs: u64 = env_number("ES_SOAK_SECONDS", 55).max(30);
    let port = free_port().to_string();
    let duration = (secs + 120).to_string();
    let fleet = start(
        &i,
        "fleet_churn.py",
        &[
            "serve",
            "--port",
            &port,
            "--workers",
            "4",
            "--worker-life",
            "2",
            "--threads-per-s",
            "10",
            "--duration",
            &duration,
        ],
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("segs");
    let disk_cap: u64 = 1_000_000;
    let max_threads = 8usize;
    // Only this engine: other vLLM-like processes on the machine are not ours to count.
    let engine_pid = fleet.pid.to_string();
    // The push backend: slow for the first half (it takes each connection and never answers,
    // so every push runs to its timeout), dead for the second (connections refused).
    let backend = BlackHole::start();
    let push_url = format!("http://{}", backend.addr);
    let mut agent = Agent::start(&[
        "--push",
        &push_url,
        "--push-every",
        "1",
        "--vllm",
        "--exact-probes",
        "--engine-pid",
        &engine_pid,
        "--backend",
        "bpf",
        "--listen",
        "127.0.0.1:0",
        "--dir",
        dir.to_str().unwrap(),
        "--rate",
        "49",
        "--segment-seconds",
        "3",
        "--segment-mb",
        "0.25",
        "--disk-mb",
        "1",
        "--max-threads",
        &max_threads.to_string(),
        "--max-functions",
        "16",
        "--series-idle-minutes",
        "0.1",
        "--poll",
        "0.5",
        "--scrape-interval",
        "1",
    ]);
    agent.wait_line("sampling started", Duration::from_secs(60));
    let pid = agent.child.id();
    let t0 = Instant::now();
    // The heap (RssAnon) is what a leak grows; VmRSS also counts file pages: the binary's and
    // the BPF ring buffer's 8 MiB, whose pages count as the reader first touches them (so
    // VmRSS creeps up until the ring has wrapped once).
    let mut rss = Vec::new();
    let mut vmrss = Vec::new();
    let mut max_disk = 0u64;
    let mut max_thread_series = 0usize;
    let mut max_segments = 0usize;
    let mut last_exp = Vec::new();
    let mut holds: Vec<Held> = Vec::new();
    let mut k = 0u64;
    let mut backend = Some(backend);
    while t0.elapsed() < Duration::from_secs(secs) {
        k += 1;
        if t0.elapsed() >= Duration::from_secs(secs / 2) {
            // The backend dies: its held connections close, new ones are refused.
            backend = None;
        }
        // One sample a second (the pace of the measurement, not a wait for readiness).
        std::thread::sleep(Duration::from_secs(1));
        rss.push(status_kb(pid, "RssAnon").expect("agent alive") as f64 / 1024.0);
        vmrss.push(status_kb(pid, "VmRSS").unwrap_or(0) as f64 / 1024.0);
        let segs = enginescope::record::rotate::list_segments(&dir).unwrap();
        max_disk = max_disk.max(segs.iter().map(|s| s.bytes).sum());
        max_segments = max_segments.max(segs.len());
        if k.is_multiple_of(5) {
            holds.push(held(pid));
            let exp = parse_exposition(&agent.metrics());
            let n = exp
                .iter()
                .filter(|e| e.name == "enginescope_thread_cpu_seconds_total")
                .filter(|e| e.labels.get("thread").map(String::as_str) != Some("_other"))
                .count();
            max_thread_series = max_thread_series.max(n);
            last_exp = exp;
        }
    }
    agent.drain_log();
    let attached = agent
        .err
        .log
        .matches("attached to new engine process")
        .count();
    let rotations = sum_of(&last_exp, "enginescope_recording_rotations_total", &[]);
    let restarts = sum_of(&last_exp, "enginescope_recorder_restarts_total", &[]);
    let aggregated = sum_of(
        &last_exp,
        "enginescope_label_sets_aggregated_total",
        &[("kind", "thread")],
    );
    let pushes = |kind: &str| {
        sum_of(
            &last_exp,
            "enginescope_profile_pushes_total",
            &[("kind", kind)],
        )
    };
    let (sent, failed, dropped) = (pushes("sent"), pushes("failed"), pushes("dropped"));
    drop(backend);
    // Warm-up: the allocator reaches its working set in the first ~20 s of churn.
    let warm = (rss.len() * 4 / 10).max(5);
    let after = &rss[warm..];
    let first = mean(&after[..5]);
    let last = mean(&after[after.len() - 5..]);
    let hi = after.iter().cloned().fold(f64::MIN, f64::max);
    let lo = after.iter().cloned().fold(f64::MAX, f64::min);
    let figures = format!(
        "soak {secs} s: agent heap (RssAnon) {:.1} MiB at start, {first:.1} MiB after warm-up ({warm} s), {last:.1} MiB at the end (min {lo:.1}, max {hi:.1}); VmRSS {:.1} → {:.1} MiB; disk max {max_disk} bytes (cap {disk_cap}), max {max_segments} segments; {rotations} rotations; {restarts} recorder restarts; {attached} processes attached; max {max_thread_series} thread series (cap {max_threads}); {aggregated} events into thread=\"_other\"; profile pushes to a slow then dead backend: {sent} sent, {failed} failed, {dropped} dropped",
        rss[0],
        vmrss[0],
        vmrss[vmrss.len() - 1]
    );
    // What the agent holds while workers come and go (4 alive at any time, one replaced every
    // half second): no more in the second half of the soak than in its first after warm-up.
    let warm_holds = (holds.len() * 4 / 10).max(1);
    let half = warm_holds + (holds.len() - warm_holds) / 2;
    let most = |v: &[Held], f: fn(&Held) -> usize| v.iter().map(f).max().unwrap_or(0);
    let first_half = &holds[warm_holds..half];
    let second_half = &holds[half..];
    let figures = format!(
        "{figures}; held every 5 s after warm-up (fds, perf events, BPF links, threads, BPF hash entries): {:?}",
        holds[warm_holds..]
            .iter()
            .map(|h| (h.fds, h.perf_events, h.bpf_links, h.threads, h.map_entries))
            .collect::<Vec<_>>()
    );
    eprintln!("{figures}");
    for (what, f) in [
        ("descriptors", (|h: &Held| h.fds) as fn(&Held) -> usize),
        ("perf events", |h: &Held| h.perf_events),
        ("BPF links", |h: &Held| h.bpf_links),
        ("threads", |h: &Held| h.threads),
        ("BPF map entries", |h: &Held| h.map_entries),
    ] {
        // A process's worth of slack: the count at a reading depends on how many workers
        // are between exit and their replacement's attach.
        let slack = if what == "BPF map entries" { 16 } else { 4 };
        assert!(
            !first_half.is_empty()
                && !second_half.is_empty()
                && most(second_half, f) <= most(first_half, f) + slack,
            "{what} grow as processes come and go: {figures}"
        );
    }
    // Recent segments read on their own (the oldest may be pruned while we read).
    let segs = segments(&dir);
    let p = &segs[segs.len().saturating_sub(2)];
    let r = read_recording(p).unwrap();
    assert!(!r.samples.is_empty(), "{}: no samples", p.display());
    let log = agent.stop();
    drop(fleet);
    assert!(!log.contains("panicked"), "{log}");
    // Rotations as the recorder counted them when it stopped (its last segment's counters):
    // the exported figure trails the segments, by up to an aggregation interval (10 s) at the
    // agent's defaults.
    let rotations = segments(&dir)
        .last()
        .and_then(|p| read_recording(p).ok())
        .and_then(|r| r.counters.get("segments_rotated").copied())
        .map_or(rotations, |n| (n as f64).max(rotations));
    let figures = format!("{figures}; {rotations} rotations when the agent stopped");
    // Catches a leak of a few MiB a minute (a segment's tables or exited processes kept);
    // slower growth is what the long run in docs/deployment.md measures.
    assert!(
        last - first <= 2.0 && hi - lo <= 4.0,
        "memory not flat: {figures}"
    );
    assert!(
        max_disk <= disk_cap + 64 * 1024,
        "disk over the cap: {figures}"
    );
    assert!(max_thread_series <= max_threads, "{figures}");
    assert!(
        aggregated > 0.0,
        "thread names never overflowed the cap: {figures}"
    );
    assert!(
        attached as u64 >= secs / 3,
        "processes did not come and go: {figures}"
    );
    assert!(rotations as u64 >= secs / 4, "{figures}");
    // Processes exiting while they are attached never stop the recorder.
    assert_eq!(restarts, 0.0, "{figures}\n{log}");
    // The backend never took a profile: pushes failed, and the oldest kept were dropped
    // (a push a second, at most 4 kept) while the memory stayed as above.
    assert!(sent == 0.0 && failed >= 2.0 && dropped >= 1.0, "{figures}");
}

/// A push backend that takes connections and never answers (holding them until dropped):
/// a slow Pyroscope. Dropped, it closes them and its port refuses new ones.
struct BlackHole {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BlackHole {
    fn start() -> BlackHole {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !s.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((c, _)) => held.push(c),
                    // Polled: the listener must notice `stop` without a connection coming.
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        BlackHole {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The agent's directory fills (a 600 KiB tmpfs, 300 KiB of it a ballast file, 999 Hz raw
/// events): the recorder stops with the filesystem full (said once, with the directory), the
/// agent goes on serving /metrics, and once the ballast is deleted it records again (every 5
/// s it tries) into a new segment that reads whole.
#[test]
fn agent_keeps_serving_through_a_full_disk_and_records_again() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let Some(fs) = TinyFs::mount("600k") else {
        eprintln!("skipped: cannot mount a tmpfs (not root?)");
        return;
    };
    let ballast = fs.path().join("ballast");
    std::fs::write(&ballast, vec![1u8; 300 << 10]).unwrap();
    let dir = fs.path().join("segs");
    let w = start(&i, "cpu_bound.py", &["--threads", "1", "--duration", "120"]);
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
        "999",
        "--raw-events",
    ]);
    agent.wait_line("sampling started", Duration::from_secs(30));
    let full = agent.wait_line("the filesystem is full", Duration::from_secs(60));
    assert!(
        full.contains(&format!("writing {}", dir.display())),
        "{full}"
    );
    // Still serving, and saying the recorder stopped.
    let m = agent.metrics();
    assert!(m.contains("enginescope_"), "{m}");
    let before: Vec<PathBuf> = segments(&dir);
    assert!(!before.is_empty());
    for s in &before {
        let r = read_recording(s).unwrap();
        assert!(!r.truncated, "{} cut inside a record", s.display());
    }
    std::fs::remove_file(&ballast).unwrap();
    agent.wait_line("sampling started", Duration::from_secs(30));
    let fresh = poll_until(Duration::from_secs(20), Duration::from_millis(200), || {
        let n = segments(&dir)
            .into_iter()
            .filter(|s| !before.contains(s))
            .filter_map(|s| read_recording(&s).ok())
            .map(|r| r.samples.len())
            .max()
            .unwrap_or(0);
        (n >= 100, n)
    });
    assert!(
        fresh >= 100,
        "{fresh} samples in the segments after the space came back"
    );
    assert!(agent.metrics().contains("enginescope_"));
    agent.stop();
    drop(w);
}

/// A CPU profile's function with the most flat (innermost) time, and the flat time of each.
fn flat_top(p: &enginescope::views::pprof::proto::Profile) -> (String, BTreeMap<String, i64>) {
    let s = |i: i64| p.string_table[i as usize].as_str();
    let mut flat: BTreeMap<String, i64> = BTreeMap::new();
    for smp in &p.sample {
        let leaf = smp.location_id[0];
        let loc = p.location.iter().find(|l| l.id == leaf).unwrap();
        let f = p
            .function
            .iter()
            .find(|f| f.id == loc.line[0].function_id)
            .unwrap();
        *flat.entry(s(f.name).to_string()).or_default() += smp.value[1];
    }
    let top = flat.iter().max_by_key(|(_, v)| **v).unwrap().0.clone();
    (top, flat)
}

/// `go tool pprof -top` of `source` (a URL or a file): (total CPU s, the function with the
/// most flat time), from its "Showing nodes accounting for …% of X total" line and first row.
fn go_pprof_top(go: &Path, source: &str, index: &str, tmp: &Path) -> (f64, String) {
    let out = Command::new(go)
        .args(["tool", "pprof", "-top"])
        .arg(format!("-sample_index={index}"))
        .arg(source)
        .env("PPROF_TMPDIR", tmp)
        .env("HOME", tmp)
        .output()
        .expect("run go tool pprof");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "go tool pprof {source}: {err}\n{text}"
    );
    // pprof scales each figure to its own unit (measurement.ScaledLabel): a small total
    // reads in microseconds, a long one in minutes.
    let secs = |v: &str| -> f64 {
        let v = v.trim();
        let units = [
            ("ns", 1e-9),
            ("us", 1e-6),
            ("µs", 1e-6),
            ("ms", 1e-3),
            ("mins", 60.0),
            ("hrs", 3600.0),
            ("s", 1.0),
        ];
        units
            .iter()
            .find_map(|(u, scale)| Some(v.strip_suffix(u)?.parse::<f64>().ok()? * scale))
            .unwrap_or_else(|| panic!("a duration in go tool pprof's output: {v:?}\n{text}"))
    };
    let total = text
        .lines()
        .find_map(|l| l.split(" of ").nth(1)?.strip_suffix(" total").map(secs))
        .unwrap_or_else(|| panic!("no total in go tool pprof's output:\n{text}\n{err}"));
    let header = text
        .lines()
        .position(|l| l.trim_start().starts_with("flat"));
    let first = header
        .and_then(|h| text.lines().nth(h + 1))
        .unwrap_or_else(|| panic!("no rows in go tool pprof's output:\n{text}"));
    let function = first
        .split_whitespace()
        .skip(5)
        .collect::<Vec<_>>()
        .join(" ");
    (total, function)
}

/// `cpu_bound.py` with two workers sharing the GIL, and an agent at 99 Hz (BPF) recording it
/// into `dir`/segs with `extra` arguments, once the agent samples.
fn two_workers_under_agent(i: &Interp, dir: &Path, extra: &[&str]) -> (Workload, Agent) {
    let w = start(i, "cpu_bound.py", &["--threads", "2", "--duration", "120"]);
    let pid = w.pid.to_string();
    let segs = dir.join("segs");
    let mut args = vec![
        "--pid",
        &pid,
        "--backend",
        "bpf",
        "--listen",
        "127.0.0.1:0",
        "--dir",
        segs.to_str().unwrap(),
        "--rate",
        "99",
    ];
    args.extend_from_slice(extra);
    let mut agent = Agent::start(&args);
    agent.wait_line("sampling started", Duration::from_secs(30));
    (w, agent)
}

/// The agent's pull endpoint, as Alloy's `pyroscope.scrape`, Parca and `go tool pprof` read it
/// (issue 24): a CPU profile of the N seconds after the request, whose total is the target's
/// CPU time over those seconds (from /proc, 99 Hz sampling: within 10%), whose samples are the
/// workload's threads, and which `go tool pprof` reads to the same total and top function,
/// fetched over HTTP as a user would; the off-CPU profile of two GIL-sharing workers against
/// what the process did not run of their time (within 10%), their GIL-wait profile a part of it
/// naming a worker as the holder.
#[test]
fn pprof_endpoint_serves_the_window_that_go_tool_pprof_reads() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let Some(go) = tool_binary("go", "golang-go") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (w, agent) = two_workers_under_agent(&i, dir.path(), &[]);
    let tmp = tempfile::tempdir().unwrap();
    // `go tool pprof` fetches its own window over HTTP beside ours (two at once are allowed).
    let url = format!("http://{}/debug/pprof/profile?seconds=4", agent.addr);
    let by_go = std::thread::spawn({
        let (go, url, t) = (go.clone(), url.clone(), tmp.path().to_path_buf());
        move || go_pprof_top(&go, &url, "cpu", &t)
    });
    let cpu = common::cpu::CpuReadings::start(w.pid);
    let client: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let bytes = client
        .get(&url)
        .call()
        .expect("GET /debug/pprof/profile")
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()
        .unwrap();
    let p = enginescope::views::pprof::decode(&bytes).unwrap();
    assert_eq!(p.duration_nanos, 4_000_000_000);
    let start_ns = p.time_nanos as u64;
    let truth = cpu.between(start_ns, start_ns + 4_000_000_000)[0];
    let total: i64 = p.sample.iter().map(|s| s.value[1]).sum();
    let total_s = total as f64 / 1e9;
    assert!(
        (total_s - truth).abs() <= 0.10 * truth,
        "profile's CPU {total_s:.3} s against the process's {truth:.3} s over the same 4 s"
    );
    let s = |i: i64| p.string_table[i as usize].as_str();
    // The workers run the work; the main thread wakes every 0.1 s to note progress.
    let mut workers = 0;
    for smp in &p.sample {
        let label = |k: &str| smp.label.iter().find(|l| s(l.key) == k).unwrap();
        assert_eq!(label("pid").num, w.pid as i64);
        if s(label("thread_name").str).starts_with("cpu-worker") {
            workers += smp.value[1];
        }
    }
    assert!(
        workers as f64 >= 0.95 * total as f64,
        "{workers} of {total} ns"
    );
    let (top, flat) = flat_top(&p);
    assert!(
        ["mix", "score", "tokenize", "parse", "handle_request"].contains(&top.as_str()),
        "top function {top} is not the workload's: {flat:?}"
    );
    // Ours, read by go tool pprof from the bytes served: the same total and top function.
    let file = tmp.path().join("ours.pb.gz");
    std::fs::write(&file, &bytes).unwrap();
    let (go_total, go_top) = go_pprof_top(&go, file.to_str().unwrap(), "cpu", tmp.path());
    assert!(
        (go_total - total_s).abs() <= 0.01,
        "{go_total} vs {total_s}"
    );
    assert_eq!(go_top, top, "{flat:?}");
    // Its own fetch, over HTTP: a window of the same length on the same steady workload.
    let (fetched_total, fetched_top) = by_go.join().unwrap();
    eprintln!(
        "profile {total_s:.3} s (top {top}), process {truth:.3} s; go tool pprof: ours {go_total:.3} s, its fetch {fetched_total:.3} s (top {fetched_top})"
    );
    assert!(
        (fetched_total - truth).abs() <= 0.10 * truth,
        "go tool pprof's fetch: {fetched_total:.3} s against ~{truth:.3} s"
    );
    assert!(
        flat.contains_key(&fetched_top),
        "{fetched_top} not in {flat:?}"
    );
    // Off CPU and GIL waits over one window (two at once): the two workers share the GIL, so
    // each is off CPU, waiting for it, for what the process does not run of their 2 x 2 s.
    let cpu = common::cpu::CpuReadings::start(w.pid);
    let fetch = |path: &str| {
        let url = format!("http://{}/debug/pprof/{path}?seconds=2", agent.addr);
        std::thread::spawn(move || {
            let bytes = ureq::get(&url)
                .call()
                .expect("GET a profile")
                .body_mut()
                .read_to_vec()
                .unwrap();
            enginescope::views::pprof::decode(&bytes).unwrap()
        })
    };
    let steal0 = common::cpu::steal_s();
    let (off, gil) = (fetch("offcpu"), fetch("gil"));
    let (off, gil) = (off.join().unwrap(), gil.join().unwrap());
    let steal = common::cpu::steal_s() - steal0;
    let start_ns = off.time_nanos as u64;
    let truth_off = 2.0 * 2.0 - cpu.between(start_ns, start_ns + 2_000_000_000)[0];
    // The workers' total of a profile; with `state`, only its samples labelled so.
    let workers_s =
        |p: &enginescope::views::pprof::proto::Profile, want: &str, state: Option<&str>| -> f64 {
            let s = |i: i64| p.string_table[i as usize].as_str();
            assert_eq!(s(p.sample_type[1].r#type), want);
            let label = |smp: &enginescope::views::pprof::proto::Sample, key: &str| {
                smp.label
                    .iter()
                    .find(|l| s(l.key) == key)
                    .map(|l| s(l.str).to_string())
            };
            let mut ns = 0;
            for smp in &p.sample {
                let worker = label(smp, "thread_name").is_some_and(|n| n.starts_with("cpu-worker"));
                if worker && state.is_none_or(|st| label(smp, "state").as_deref() == Some(st)) {
                    ns += smp.value[1];
                }
            }
            ns as f64 / 1e9
        };
    let (off_s, gil_s) = (
        workers_s(&off, "off_cpu", None),
        workers_s(&gil, "gil_wait", None),
    );
    // Off CPU having blocked (not preempted while running): the GIL waits and the run queue
    // after each wake-up; a CPU hog beside the workers adds preempted time, which is not.
    let blocked_s = workers_s(&off, "off_cpu", Some("blocked"));
    // Each profile covers the 2 s after its own request arrived: the two windows are apart by
    // as much as the requests were; over the part one has and the other not, each of the two
    // workers can wait at most that long. Steal (the hypervisor running something else on our
    // vCPUs) is off CPU for /proc's CPU time but not for the guest's switches, and inside a
    // GIL wait where the waiter was on CPU (woken, not yet holding it) it lengthens the wait
    // but no off-CPU interval: a loaded CI run read GIL 2.149 s against 2.016 s off CPU, and a
    // run after it off CPU 2.037 s against /proc's 2.280. Both bounds allow the window's steal.
    let apart_s = (off.time_nanos - gil.time_nanos).unsigned_abs() as f64 / 1e9;
    eprintln!(
        "workers off CPU {off_s:.3} s, GIL wait {gil_s:.3} s (windows {apart_s:.3} s apart, \
         machine steal {steal:.3} s; blocked {blocked_s:.3} s of the off CPU); truth ~{truth_off:.3} s"
    );
    assert!(
        (off_s - truth_off).abs() <= 0.1 * truth_off + steal,
        "workers off CPU {off_s:.3} s against {truth_off:.3} (steal {steal:.3} s)"
    );
    // A GIL wait is off CPU, blocked; the rest of the blocked time is the wait for a CPU once
    // woken.
    let shift = 2.0 * apart_s + steal;
    // A GIL wait and its off-CPU interval begin and end at the same two switches, so one
    // above the other is an event lost between them (a full ring buffer) or a window edge:
    // the agent's own count of lost events says which (a CI run once read GIL 2.152 s
    // against 2.047 s off CPU with no steal).
    let lost_line = || {
        agent
            .metrics()
            .lines()
            .filter(|l| l.starts_with("enginescope_samples_lost"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    assert!(
        gil_s <= 1.02 * off_s + shift && gil_s >= 0.7 * blocked_s - shift,
        "workers' GIL wait {gil_s:.3} s against their {off_s:.3} s off CPU (windows {apart_s:.3} s apart, steal {steal:.3} s; {})",
        lost_line()
    );
    let gs = |i: i64| gil.string_table[i as usize].as_str();
    assert!(
        gil.sample.iter().any(|smp| smp
            .label
            .iter()
            .any(|l| gs(l.key) == "gil_holder" && gs(l.str).starts_with("cpu-worker"))),
        "no GIL wait names a worker as the holder"
    );
    let file = tmp.path().join("gil.pb.gz");
    std::fs::write(&file, enginescope::views::pprof::encode(&gil).unwrap()).unwrap();
    let (go_gil, _) = go_pprof_top(&go, file.to_str().unwrap(), "gil_wait", tmp.path());
    let all_gil: i64 = gil.sample.iter().map(|s| s.value[1]).sum();
    assert!((go_gil - all_gil as f64 / 1e9).abs() <= 0.01, "{go_gil}");
    // The endpoint refuses what it cannot serve, at once.
    let bad = http_get(&format!(
        "http://{}/debug/pprof/profile?seconds=100000",
        agent.addr
    ));
    assert!(bad.unwrap_err().contains("HTTP 400"));
    let log = agent.stop();
    assert!(!log.contains("panicked"), "{log}");
}

/// One request as the test's ingest receiver read it.
struct Ingest {
    path: String,
    query: BTreeMap<String, String>,
    content_type: String,
    body: Vec<u8>,
}

/// Read one HTTP/1.1 request with a Content-Length body, answer 200.
fn read_ingest(mut c: std::net::TcpStream) -> Option<Ingest> {
    use std::io::{Read, Write};
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    let head_end = loop {
        let n = c.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
    };
    let len: usize = header("content-length")?.parse().ok()?;
    while buf.len() < head_end + len {
        let n = c.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let first = head.lines().next()?.to_string();
    let target = first.split(' ').nth(1)?.to_string();
    assert!(first.starts_with("POST "), "{first}");
    let (path, q) = target.split_once('?').unwrap_or((&target, ""));
    let query = q
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), urldecode(v)))
        .collect();
    let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    Some(Ingest {
        path: path.to_string(),
        query,
        content_type: header("content-type").unwrap_or_default(),
        body: buf[head_end..head_end + len].to_vec(),
    })
}

fn urldecode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(h, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

/// The `profile` part of a multipart/form-data body, by the boundary its Content-Type names.
fn profile_part(content_type: &str, body: &[u8]) -> Vec<u8> {
    let boundary = content_type
        .split(';')
        .find_map(|p| p.trim().strip_prefix("boundary="))
        .unwrap_or_else(|| panic!("no boundary in {content_type:?}"));
    let delim = format!("--{boundary}");
    let find = |hay: &[u8], from: usize, needle: &[u8]| {
        hay[from..]
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + from)
    };
    let start = find(body, 0, delim.as_bytes()).expect("first boundary");
    let head_end = find(body, start, b"\r\n\r\n").expect("part head") + 4;
    let head = String::from_utf8_lossy(&body[start..head_end]);
    assert!(head.contains("name=\"profile\""), "{head}");
    let end = find(body, head_end, format!("\r\n{delim}").as_bytes()).expect("closing boundary");
    assert!(body[end..].starts_with(format!("\r\n{delim}--").as_bytes()));
    body[head_end..end].to_vec()
}

/// `agent --push` against a receiver that checks each request against Pyroscope's ingest API
/// (issue 24): POST /ingest with name, from, until, format=pprof, sampleRate, and the gzipped
/// pprof in the multipart field `profile`; the profiles follow each other end to end, and
/// their CPU is the target's over the same seconds (from /proc, within 10%). Then the backend
/// dies: the agent counts failed pushes, keeps at most four and drops the oldest, and goes on
/// serving /metrics.
#[test]
fn push_to_pyroscope_ingest_follows_the_protocol_and_survives_a_dead_backend() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = std::sync::mpsc::channel::<Ingest>();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let receiver = std::thread::spawn({
        let stop = stop.clone();
        move || {
            for c in listener.incoming() {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                if let Some(r) = c.ok().and_then(read_ingest) {
                    let _ = tx.send(r);
                }
            }
        }
    });
    let url = format!("http://127.0.0.1:{port}");
    let (w, agent) = two_workers_under_agent(
        &i,
        dir.path(),
        &[
            "--push",
            &url,
            "--push-every",
            "1",
            "--push-app",
            "vllm",
            "--push-label",
            "engine=e0",
        ],
    );
    let cpu = common::cpu::CpuReadings::start(w.pid);
    let mut got = Vec::new();
    while got.len() < 6 {
        let r = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("a push within 20 s");
        assert_eq!(r.path, "/ingest");
        let q = |k: &str| r.query.get(k).cloned().unwrap_or_default();
        assert_eq!(q("format"), "pprof");
        assert_eq!(q("sampleRate"), "99");
        assert_eq!(q("spyName"), "enginescope");
        assert!(
            q("name").starts_with("vllm.cpu{engine=e0,host="),
            "{}",
            q("name")
        );
        let (from, until): (u64, u64) = (q("from").parse().unwrap(), q("until").parse().unwrap());
        assert!(from < until && until - from <= 3, "{from}..{until}");
        assert!(
            r.content_type.starts_with("multipart/form-data"),
            "{}",
            r.content_type
        );
        let part = profile_part(&r.content_type, &r.body);
        let p = enginescope::views::pprof::decode(&part).unwrap();
        got.push((from, until, p, part));
    }
    // End to end: each profile begins where the one before ended.
    for w2 in got.windows(2) {
        let (a, b) = (&w2[0].2, &w2[1].2);
        let gap = b.time_nanos - (a.time_nanos + a.duration_nanos);
        assert!(gap.abs() < 20_000_000, "profiles {gap} ns apart");
        assert!(
            w2[1].0 + 1 >= w2[0].1 && w2[1].0 <= w2[0].1,
            "{:?} {:?}",
            (w2[0].0, w2[0].1),
            (w2[1].0, w2[1].1)
        );
    }
    // The CPU of the last four against the process's over their seconds (the first may begin
    // before sampling did).
    let (first, last) = (&got[2].2, &got[5].2);
    let (a, b) = (
        first.time_nanos as u64,
        (last.time_nanos + last.duration_nanos) as u64,
    );
    let truth = cpu.between(a, b)[0];
    let pushed: f64 = got[2..]
        .iter()
        .flat_map(|g| g.2.sample.iter())
        .map(|s| s.value[1] as f64 / 1e9)
        .sum();
    eprintln!(
        "pushed {pushed:.3} s of CPU over {:.3} s; the process used {truth:.3} s",
        (b - a) as f64 / 1e9
    );
    assert!(
        (pushed - truth).abs() <= 0.1 * truth,
        "pushed {pushed:.3} s against {truth:.3} s"
    );
    // What Pyroscope stores is what `go tool pprof` reads from the pushed bytes: the same
    // total and top function as the profile decoded here.
    if let Some(go) = tool_binary("go", "golang-go") {
        let tmp = tempfile::tempdir().unwrap();
        let (p, part) = (&got[5].2, &got[5].3);
        let file = tmp.path().join("pushed.pb.gz");
        std::fs::write(&file, part).unwrap();
        let (go_total, go_top) = go_pprof_top(&go, file.to_str().unwrap(), "cpu", tmp.path());
        let total_s = p.sample.iter().map(|s| s.value[1]).sum::<i64>() as f64 / 1e9;
        let (top, flat) = flat_top(p);
        eprintln!("pushed profile: {total_s:.3} s, top {top}; go tool pprof: {go_total:.3} s, top {go_top}");
        assert!(
            (go_total - total_s).abs() <= 0.01,
            "{go_total} vs {total_s}"
        );
        assert_eq!(go_top, top, "{flat:?}");
    }
    // The backend dies: failed, then dropped past four kept; the agent serves on.
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = std::net::TcpStream::connect(("127.0.0.1", port));
    receiver.join().unwrap();
    let counted = |m: &str, kind: &str| {
        let exp = parse_exposition(m);
        sum_of(&exp, "enginescope_profile_pushes_total", &[("kind", kind)])
    };
    let (failed, dropped) = poll_until(Duration::from_secs(30), Duration::from_millis(500), || {
        let m = agent.metrics();
        let (f, d) = (counted(&m, "failed"), counted(&m, "dropped"));
        (d >= 2.0, (f, d))
    });
    assert!(
        dropped >= 2.0 && failed >= 6.0,
        "failed {failed}, dropped {dropped}"
    );
    let sent = counted(&agent.metrics(), "sent");
    assert!(sent >= 6.0, "sent {sent}");
    let log = agent.stop();
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains("pushing a profile to"), "{log}");
}

/// Under a probe budget the agent times each probed thread's calls for part of the time, and
/// exports the calls it timed (`enginescope_probe_call_duration_seconds_count`, `_sum`) beside
/// the seconds it watched (`enginescope_probe_watched_seconds_total`) and the watches it began
/// (`enginescope_probe_watch_phases_total`): a call is timed only when it lies wholly inside
/// a phase, so the calls per second are count / (watched - phases * mean duration), as the
/// overview dashboard computes them. Checked against samples/mq_pipeline.py's own timers over
/// the same span (6 s between two scrapes, the probes forced to watch 30% of the time), for the
/// producer's `MessageQueue.enqueue` and the consumer's `dequeue` (a blocking read: its calls
/// last most of a step, and count / watched alone read it 6-10% low in nine quiet runs): within 10%.
/// The pipeline's calls are paced, one a step, so a phase times its span's calls to within one
/// (about 1% over the span's 30 phases; the dashboard's band, the timed calls' Poisson error,
/// is the wider one a load of random arrivals needs): in 5 runs on a quiet machine within 3%;
/// beside two busy loops 0.6% high to 3.5% low in 19 of 20 figures and once 9% low (the
/// agent's figures trail each scrape by up to an interval, the truth's span does not, and a
/// starved pipeline's rate swings). The counter alone would read the watched share of the
/// rate (about 30% of it).
#[test]
fn budgeted_probe_rates_are_calls_over_watched_seconds() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let mut w = start(
        &i,
        "mq_pipeline.py",
        &[
            "--truth",
            "{dir}/truth.json",
            "--duration",
            "10",
            "--go-fifo",
            "{dir}/go",
        ],
    );
    let consumer = consumer_of(&w);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("segs");
    let pids = format!("{},{consumer}", w.pid);
    let mut agent = Agent::start_env(
        &[
            "--pid",
            &pids,
            "--backend",
            "bpf",
            "--listen",
            "127.0.0.1:0",
            "--dir",
            dir.to_str().unwrap(),
            "--poll",
            "0.2",
            // Aggregated intervals short against the span (the calls come as each ends).
            "--profile-seconds",
            "1",
            "--probe",
            "mq_pipeline.py:MessageQueue.enqueue",
            "--probe",
            "MessageQueue.dequeue",
        ],
        // The default budget, each probed thread watched 30% of the time whatever its traps
        // cost on this machine (where they are cheap the budget would watch every call).
        &[("ENGINESCOPE_PROBE_SHARE", "0.3")],
    );
    // The probes attach when the sampler first meets their functions (the pipeline runs from
    // READY on), in either order.
    let placed: Vec<String> = (0..2)
        .map(|_| agent.wait_line(" -> MessageQueue.", Duration::from_secs(30)))
        .collect();
    for f in ["enqueue", "dequeue"] {
        assert!(
            placed
                .iter()
                .any(|l| l.contains(&format!("-> MessageQueue.{f} "))),
            "{placed:?}"
        );
    }
    w.go();
    // The span measured: from a second after the window's start to a second and a half before
    // its end, the pipeline at its steady rate throughout.
    let scrape = || {
        let t = enginescope::sys::monotonic_ns();
        (t, parse_exposition(&agent.metrics()))
    };
    std::thread::sleep(Duration::from_secs(1));
    let (t0, a) = scrape();
    std::thread::sleep(Duration::from_secs(6));
    let (t1, b) = scrape();
    // The producer waits for its consumer, which writes its truth first.
    let st = w.child.wait().unwrap();
    assert!(st.success(), "workload failed: {st:?}");
    let producer = read_json(&w.dir.join("truth.json"));
    let cons = read_json(&w.dir.join("truth.json.consumer.json"));
    let log = agent.stop();
    assert!(!log.contains("panicked"), "{log}");
    for (truth, pid, function) in [
        (&producer, w.pid, "MessageQueue.enqueue"),
        (&cons, consumer, "MessageQueue.dequeue"),
    ] {
        let role = format!("pid{pid}");
        let labels = [("role", role.as_str()), ("function", function)];
        let delta = |name: &str| sum_of(&b, name, &labels) - sum_of(&a, name, &labels);
        let timed = delta("enginescope_probe_call_duration_seconds_count");
        let timed_s = delta("enginescope_probe_call_duration_seconds_sum");
        let watched = delta("enginescope_probe_watched_seconds_total");
        let phases = delta("enginescope_probe_watch_phases_total");
        let span_s = (t1 - t0) as f64 / 1e9;
        // The truth's calls that began in the span (the agent's figures trail each scrape by
        // up to an interval and its poll: at a steady rate the rate over the span holds).
        let calls = truth_calls(truth, function)
            .iter()
            .filter(|c| c.0 >= t0 && c.0 < t1)
            .count() as f64;
        let truth_rate = calls / span_s;
        // Each phase times the calls that began in its first L - d seconds.
        let effective = watched - phases * timed_s / timed.max(1.0);
        let rate = timed / effective.max(1e-9);
        let share = watched / span_s;
        let tol = 0.10;
        eprintln!(
            "{function}: {timed} calls timed in {watched:.2} s watched ({:.0}% of {span_s:.2} s): \
             {phases} phases, {:.2} ms a call: {rate:.1}/s against the pipeline's {truth_rate:.1}/s \
             ({calls} calls); allowed {:.1}%; count / watched {:.1}/s, the counter's own rate {:.1}/s",
            share * 100.0,
            timed_s / timed.max(1.0) * 1e3,
            tol * 100.0,
            timed / watched.max(1e-9),
            timed / span_s
        );
        // A few hundred calls at 200/s watched 30% of 6 s: never none.
        assert!(timed >= 100.0, "{function}: {timed} calls timed");
        assert!(
            (0.15..=0.6).contains(&share),
            "{function}: watched {:.0}% of the span, forced to 30%",
            share * 100.0
        );
        assert!(
            (rate / truth_rate - 1.0).abs() <= tol,
            "{function}: {rate:.1} calls/s from {timed} timed in {watched:.2} s watched, the \
             pipeline made {truth_rate:.1}/s (allowed {:.1}%)",
            tol * 100.0
        );
    }
}
