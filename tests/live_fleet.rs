//! A fleet under skewed load: N copies of the bundled sample engine (default 8,
//! `ES_FLEET_ENGINES` to change), each its own `serve` (API server, EngineCore, Worker), all
//! recorded at once with `record --vllm`. Engine N-1 gets 24 requests in flight against 8
//! batch slots (16 always waiting, TTFT in seconds); the others 4 each. Every engine paces its
//! steps (20/s) and is made cheap (`--fixed`, small heap, 0.5 ms steps), so that 8 of them fit
//! on 2 shared CPUs: 20 steps/s × running requests is its token rate whatever the host's load.
//!
//! Checked against each engine's own truth (its `api_server-*.json`: tokens counted between
//! two snapshots at its window's edges), over the same window on the recording's clock:
//! - every engine's gen tok/s (from its scraped counter) within 5% of its truth;
//! - the fleet's gen tok/s imbalance (max/min) within 5% of the truth's, the same engines at
//!   the top and bottom;
//! - every engine scraped at ≥ 95% coverage;
//! - the skewed engine named by the detectors: `queue_while_others_idle` and `ttft_outlier`,
//!   and at the top of the TTFT p90 imbalance.
//!
//! Engines of other processes on the host (other tests) are left out by API-server pid.
//! Cost: ~1 min.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::*;
use enginescope::metrics::{names, MetricIndex};
use enginescope::record::read_recording;
use enginescope::views::windows::{extent_ns, Windows};
use enginescope::views::{engines, fleet, timeline, Selection};

const WINDOW_S: u64 = 15;

struct Engine {
    child: Child,
    api_pid: i32,
    /// Its metrics port (the READY line's).
    port: u16,
    dir: PathBuf,
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SIGTERM to the API server, which stops its children and writes its truth; a no-op
        // when it has already exited after its window.
        // SAFETY: kill(2) on a pid we started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn start_engine(python: &Path, dir: &Path, requests: u32) -> Engine {
    std::fs::create_dir_all(dir).unwrap();
    make_go_fifo(dir);
    let mut child = Command::new(python)
        .arg(repo_root().join("samples/engine/serve.py"))
        .args(["serve", "--port", "0", "--seconds", &WINDOW_S.to_string()])
        .arg("--truth")
        .arg(dir.join("truth"))
        .arg("--go-fifo")
        .arg(dir.join("go"))
        .args([
            "--fixed",
            "--steps-per-s",
            "20",
            "--exec-ms",
            "0.5",
            "--puts-per-s",
            "1",
        ])
        .args([
            "--gc-heap",
            "1000",
            "--gc-churn",
            "100",
            "--gc-retained",
            "10",
        ])
        .args([
            "--max-num-seqs",
            "8",
            "--max-tokens",
            "64",
            "--warmup-requests",
            "4",
        ])
        .args(["--requests", &requests.to_string(), "-q"])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("start samples/engine/serve.py");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            panic!("engine in {} exited before READY", dir.display());
        }
        if line.starts_with("READY ") {
            break;
        }
    }
    let api_pid: i32 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let port: u16 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    std::thread::spawn(move || {
        let mut sink = String::new();
        while out.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    Engine {
        child,
        api_pid,
        port,
        dir: dir.to_path_buf(),
    }
}

fn truth(dir: &Path) -> serde_json::Value {
    let d = dir.join("truth");
    for e in std::fs::read_dir(&d).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("api_server-") && n.ends_with(".json") {
            return read_json(&e.path());
        }
    }
    panic!("no api_server truth in {}", d.display());
}

#[test]
fn skewed_fleet_rates_imbalance_and_detectors() {
    let py = interp("pyenv-3.12");
    if !available(&py) {
        return;
    }
    let Launch::Host(python) = &py.launch else {
        unreachable!()
    };
    let n: usize = std::env::var("ES_FLEET_ENGINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
        .max(2);
    let tmp = tempfile::tempdir().unwrap();
    let skewed = n - 1;
    // Started one after another: each start is a burst of imports.
    let fleet: Vec<Engine> = (0..n)
        .map(|i| {
            start_engine(
                python,
                &tmp.path().join(format!("e{i}")),
                if i == skewed { 24 } else { 4 },
            )
        })
        .collect();

    let out = tmp.path().join("fleet.esrec");
    let rec_s = (WINDOW_S + 8).to_string();
    // Only this fleet: other engines on the machine are not ours to count.
    let ports: Vec<String> = fleet.iter().map(|e| e.port.to_string()).collect();
    let mut args = vec![
        "--vllm",
        "--no-default-probes",
        "--rate",
        "19",
        "--duration",
        &rec_s,
        "-o",
        out.to_str().unwrap(),
    ];
    for p in &ports {
        args.extend(["--engine-port", p.as_str()]);
    }
    let recorder = Recorder::start(&args);
    for e in &fleet {
        std::fs::OpenOptions::new()
            .write(true)
            .open(e.dir.join("go"))
            .unwrap()
            .write_all(b"GO\n")
            .unwrap();
    }
    let (ok, _, err) = recorder.wait();
    assert!(ok, "record failed:\n{err}");
    let pids: Vec<i32> = fleet.iter().map(|e| e.api_pid).collect();
    let dirs: Vec<PathBuf> = fleet.iter().map(|e| e.dir.clone()).collect();
    drop(fleet); // every engine has ended its window by now; this waits for the truth files

    let rec = read_recording(&out).unwrap();
    let ix = MetricIndex::new(&rec);
    let ids: Vec<String> = pids
        .iter()
        .map(|p| {
            rec.engines
                .iter()
                .find(|e| e.api_server_pid == *p)
                .unwrap_or_else(|| {
                    panic!(
                        "engine with API server {p} not recorded: {:#?}",
                        rec.engines
                    )
                })
                .id
                .clone()
        })
        .collect();

    // Per engine, over its own window: ours against its truth.
    let mut ours = Vec::new();
    let mut truths = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let t = truth(dir);
        let rel = |k: &str| {
            t["window"][k]
                .as_u64()
                .unwrap()
                .saturating_sub(rec.meta.start_mono_ns)
        };
        let (t0, t1) = (rel("start_mono_ns"), rel("end_mono_ns"));
        let truth_rate = t["generation_tokens"]["per_s_window"].as_f64().unwrap();
        let rate = ix
            .rate(&ids[i], &names::GENERATION_TOKENS, t0, t1)
            .expect("a rate over the window");
        eprintln!(
            "{} (pid {}): {rate:.1} gen tok/s, truth {truth_rate:.1} ({:+.1}%)",
            ids[i],
            pids[i],
            100.0 * (rate / truth_rate - 1.0)
        );
        assert!(
            (rate / truth_rate - 1.0).abs() <= 0.05,
            "{}: {rate:.1} vs truth {truth_rate:.1}",
            ids[i]
        );
        ours.push(rate);
        truths.push(truth_rate);
        // Per-request latency over the same window, against the API server's own clock: the
        // mean (the histogram's _sum over _count increase) within 5%, and each quantile's
        // bucket holding the truth's quantile (a quantile is only as fine as its bucket),
        // within 1% of its bounds: the sample engine's TPOT sits at 50.00 ms, a bound, and
        // the histogram's window edges (scrapes) are not the truth's.
        for (family, key) in [(&names::TTFT, "ttft_ns"), (&names::TPOT, "tpot_ns")] {
            let l = ix
                .histogram(&ids[i], family, t0, t1)
                .unwrap_or_else(|| panic!("{}: {} scraped", ids[i], family.name))
                .quantiles_ms();
            let tr = &t["requests"][key];
            let ms = |k: &str| tr[k].as_f64().map(|v| v / 1e6);
            let mean = l.mean.expect("observations in the window");
            let truth_mean = ms("mean").expect("truth");
            eprintln!(
                "{} {}: mean {mean:.3} ms (truth {truth_mean:.3}), p50 {:?} in {:?} (truth {:?}), p90 {:?} in {:?} (truth {:?}), {} observed ({} in the truth)",
                ids[i], family.name, l.p50, l.p50_bucket, ms("p50"), l.p90, l.p90_bucket, ms("p90"), l.count, tr["count"]
            );
            // The histogram's window is interpolated between scrapes: an observation in the
            // scrape interval at either edge can count in one window and not the other. With
            // ~25 requests one such observation moves the mean by up to its spread over the
            // count (a CI run read 23 observed against 24 in the truth, the missing one its
            // 450 ms outlier: 99.1 ms against 114.0), so each observation the counts differ
            // by (a part of one counts whole) may shift the mean that much beyond the 5%.
            let n_truth = tr["count"].as_f64().expect("truth count");
            let spread = ms("max").expect("truth max") - ms("min").expect("truth min");
            let edge = (l.count - n_truth).abs().ceil();
            let allowed = 0.05 * truth_mean + edge * spread / n_truth.max(1.0);
            assert!(
                (mean - truth_mean).abs() <= allowed,
                "{} {}: mean {mean:.3} vs truth {truth_mean:.3} (allowed {allowed:.3} ms: 5% and {edge} edge observations of spread {spread:.3} ms over {n_truth})",
                ids[i],
                family.name
            );
            for (q, bucket) in [("p50", l.p50_bucket), ("p90", l.p90_bucket)] {
                let v = ms(q).expect("truth quantile");
                let b = bucket.expect("a bucket");
                assert!(
                    v >= 0.99 * b.0 && b.1.is_none_or(|hi| v <= 1.01 * hi),
                    "{} {}: truth {q} {v} ms outside the bucket {b:?}",
                    ids[i],
                    family.name
                );
            }
        }
    }
    let ratio = |v: &[f64]| {
        let max = v.iter().copied().fold(f64::MIN, f64::max);
        let min = v.iter().copied().fold(f64::MAX, f64::min);
        max / min
    };
    let (r_ours, r_truth) = (ratio(&ours), ratio(&truths));
    eprintln!("gen tok/s max/min: ours {r_ours:.3}, truth {r_truth:.3}");
    assert!((r_ours / r_truth - 1.0).abs() <= 0.05);

    // The report's figures over the recording, for our engines only.
    let end = extent_ns(&rec);
    let w = Windows::new(5_000_000_000, end);
    let rows = engines::engine_rows(&rec, &ix, &ids, &w, end);
    for r in &rows {
        let c = r.scrape_coverage.expect("scrape attempts");
        eprintln!(
            "{}: {} scrapes, coverage {:.3}, longest gap {:?} s, TTFT p90 {:?} ms; errors: {:?}",
            r.id,
            r.scrapes,
            c,
            r.max_scrape_gap_s,
            r.ttft_ms.p90,
            rec.scrape_errors
                .iter()
                .filter(|e| e.engine == r.id)
                .map(|e| (e.t_ns / 1_000_000, e.error.as_str()))
                .collect::<Vec<_>>()
        );
        assert!(c >= 0.95, "{}: scrape coverage {c}", r.id);
    }
    let im = engines::imbalance(&rows).unwrap();
    let g = im.gen_tok_s.as_ref().unwrap();
    assert_eq!(g.max_engine, ids[skewed], "{g:?}");
    let t = im.ttft_p90_ms.as_ref().unwrap();
    assert_eq!(t.max_engine, ids[skewed], "{t:?}");
    let sel = Selection::all(&rec);
    let tl = timeline::build(&rec, &sel, &ix, &ids, &w, 50.0);
    let found = fleet::findings(&rec, &ix, &rows, &tl.windows, &w);
    for f in &found {
        eprintln!("finding: {f:?}");
    }
    for kind in ["queue_while_others_idle", "ttft_outlier"] {
        assert!(
            found
                .iter()
                .any(|f| f.kind == kind && f.engine == ids[skewed]),
            "{kind} of {} not found: {found:?}",
            ids[skewed]
        );
        assert!(
            found
                .iter()
                .all(|f| f.kind != kind || f.engine == ids[skewed]),
            "{kind} names another engine: {found:?}"
        );
    }
}
