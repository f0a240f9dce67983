//! `record --vllm --backend memory` (what `auto` picks without BPF) over the bundled vLLM-like
//! engine (samples/engine) started while the recording runs:
//!
//! * the engine's processes (API server, EngineCore, Worker), all started after "sampling
//!   started", are attached by rediscovery and sampled;
//! * its metrics are in the file while the recorder still runs (written as scraped, not kept
//!   until the end), and the recording does not stop when the engine exits (engines are
//!   followed: "all targets exited" is not a reason with --vllm);
//! * `report --format json` over the engine's own measurement window gives `engines[]`
//!   generated tokens/s within ±10% of the engine's count (its truth file);
//! * `--vllm`'s default probes are timed by sampling on this backend (breakpoints need BPF):
//!   the report has sampled function latency for the engine's processes (presence only: at
//!   49 Hz a sampled call's length is known to a period; tests/live_probes.rs checks exact
//!   timing against truth).
//!
//! Cost: ~30 s (engine start, a 6 s window, shutdown).

mod common;

use common::*;
use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The engine's EngineCore and Worker processes: descendants of the API server titled VLLM::.
fn engine_processes(api: i32) -> BTreeSet<i32> {
    let mut out = BTreeSet::from([api]);
    let mut stack = children_of(api);
    while let Some(p) = stack.pop() {
        if comm(p).starts_with("VLLM::") {
            out.insert(p);
        }
        stack.extend(children_of(p));
    }
    out
}

fn truth_file(dir: &Path, role: &str) -> serde_json::Value {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(&format!("{role}-")) && n.ends_with(".json") {
            return read_json(&e.path());
        }
    }
    panic!("no {role} truth in {}", dir.display());
}

#[test]
fn memory_backend_attaches_a_late_engine_and_records_its_metrics_live() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let Launch::Host(python) = &i.launch else {
        panic!("pyenv-3.12 runs on the host");
    };
    // Something to record before any engine exists (--vllm with no engine needs a --pid).
    let placeholder = start(&i, "stacks.py", &["--truth", "{dir}/truth.json"]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.esrec");
    let out_s = out.to_string_lossy().into_owned();
    // Only the engine this test starts, on a port chosen now.
    let port = common::free_port();
    let port_s = port.to_string();
    let mut rec = Recorder::start(&[
        "--vllm",
        "--engine-port",
        &port_s,
        "--backend",
        "memory",
        "--rate",
        "49",
        "--scrape-interval",
        "0.5",
        "--pid",
        &placeholder.pid.to_string(),
        "--duration",
        "300",
        "-o",
        &out_s,
    ]);

    // The engine starts now, mid-recording.
    let truth = dir.path().join("truth");
    std::fs::create_dir_all(&truth).unwrap();
    make_go_fifo(dir.path());
    let mut engine = Command::new(python)
        .arg(repo_root().join("samples/engine/serve.py"))
        .args(["serve", "--port", &port_s, "--seconds", "6", "--truth"])
        .arg(&truth)
        .arg("--go-fifo")
        .arg(dir.path().join("go"))
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("start the sample engine");
    let mut lines = std::io::BufReader::new(engine.stdout.take().unwrap()).lines();
    let api: i32 = loop {
        let line = lines.next().expect("engine exited before READY").unwrap();
        let mut w = line.split_whitespace();
        if w.next() == Some("READY") {
            break w.next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    let wanted = engine_processes(api);
    assert!(
        wanted.len() >= 3,
        "API server, EngineCore, Worker: {wanted:?}"
    );

    // Rediscovery attaches them (the recorder says so per process).
    let mut attached = BTreeSet::new();
    while !wanted.is_subset(&attached) {
        for l in rec.wait_for_lines("attached to new engine process", 1) {
            if let Some(pid) = l.trim().rsplit(' ').next().and_then(|p| p.parse().ok()) {
                attached.insert(pid);
            }
        }
    }
    go(dir.path());
    let status = engine.wait().unwrap();
    assert!(status.success(), "engine: {status}");

    // The engine has stopped; the recorder runs on (it follows engines). Its file already
    // holds the engine's metrics and samples.
    let live = enginescope::record::format::RecordingReader::default();
    let mut live = live;
    live.feed(&std::fs::read(&out).unwrap()).unwrap();
    let r = &live.recording;
    assert!(r.end.is_none(), "the recorder is still running");
    let engine_id = r
        .engines
        .iter()
        .find(|e| e.api_server_pid == api)
        .map(|e| e.id.clone())
        .expect("the engine in the recording");
    let series: BTreeSet<u32> = r
        .series
        .iter()
        .filter(|s| s.engine == engine_id)
        .map(|s| s.id)
        .collect();
    let points = r
        .metrics
        .iter()
        .filter(|m| series.contains(&m.series))
        .count();
    assert!(points > 0, "metric points written while recording");
    for pid in &wanted {
        assert!(
            r.samples.iter().any(|s| s.pid == *pid),
            "samples of attached process {pid} ({})",
            comm(*pid)
        );
    }

    // SAFETY: kill(2) on the recorder we started.
    unsafe { libc::kill(rec.child.id() as i32, libc::SIGINT) };
    let (ok, _, err) = rec.wait();
    assert!(ok, "record failed: {err}");
    assert!(!err.contains("all targets exited"), "{err}");
    let full = enginescope::record::read_recording(&out).unwrap();
    assert_eq!(full.end.as_ref().unwrap().reason, "stopped by signal");

    // Generated tokens/s over the engine's window, from the report, against its own count.
    let api_truth = truth_file(&truth, "api_server");
    let base = full.meta.start_mono_ns;
    let w0 = api_truth["window"]["start_mono_ns"].as_u64().unwrap();
    let w1 = api_truth["window"]["end_mono_ns"].as_u64().unwrap();
    let from = format!("{:.3}", (w0 - base) as f64 / 1e9);
    let to = format!("{:.3}", (w1 - base) as f64 / 1e9);
    let o = enginescope(&[
        "report", &out_s, "--format", "json", "--from", &from, "--to", &to,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let e = v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["api_server_pid"] == api)
        .expect("the engine in the report");
    let sampled: Vec<String> = v["function_latency"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| wanted.contains(&(f["pid"].as_i64().unwrap() as i32)))
        .filter(|f| f["method"] == "sampled" && f["calls"].as_u64().unwrap_or(0) > 0)
        .map(|f| format!("{} ({} calls)", f["function"], f["calls"]))
        .collect();
    eprintln!("sampled probes: {sampled:?}");
    assert!(!sampled.is_empty(), "{}", v["function_latency"]);
    let ours = e["gen_tok_s"]["mean"].as_f64().unwrap();
    let theirs = api_truth["generation_tokens"]["per_s_window"]
        .as_f64()
        .unwrap();
    eprintln!(
        "memory backend: {} processes attached mid-recording, {points} metric points while recording; gen tok/s {ours:.0} vs engine's {theirs:.0}",
        wanted.len()
    );
    assert!((ours / theirs - 1.0).abs() <= 0.10, "{ours} vs {theirs}");
}

/// Write GO into `dir/go` (the engine's --go-fifo).
fn go(dir: &Path) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("go"))
        .unwrap();
    f.write_all(b"GO\n").unwrap();
}
