//! `report`, `top` and the agent over the same recordings (tests/fixtures/golden, see
//! tests/report_golden.rs): `top --replay`'s plain output and the agent's `/metrics` page are
//! golden files, taken before the three views were put on one accounting
//! (`enginescope::accounting`), and the three give the same per-thread CPU, GIL held, GIL
//! wait and GC figures, each from its own path through the code.
//!
//! The expected files are never written unless asked: `ES_UPDATE_GOLDEN=1 cargo test --test
//! views_agree` rewrites them (then review the diff).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use enginescope::agent::budget::BudgetConfig;
use enginescope::agent::metrics::{Aggregator, Limits, Metrics};
use enginescope::record::{read_recording, Recording};
use enginescope::tui::model::{snapshot, Topology};
use enginescope::tui::window::Window;
use enginescope::views::filter::Selection;
use enginescope::views::report::Report;

const FIXTURES: &[&str] = &["gil_bpf", "gil_memory", "probes_bpf", "vllm_demo_bpf"];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden")
}

fn esrec(name: &str) -> PathBuf {
    dir().join(format!("{name}.esrec"))
}

fn check_golden(name: &str, ext: &str, got: &str) {
    let expected = dir().join(format!("{name}.{ext}"));
    if std::env::var_os("ES_UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(&expected, got).unwrap();
        eprintln!("rewrote {}", expected.display());
        return;
    }
    let want = std::fs::read_to_string(&expected).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (golden files are only written with ES_UPDATE_GOLDEN=1)",
            expected.display()
        )
    });
    if want != got {
        let line = want
            .lines()
            .zip(got.lines())
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| format!("line {}:\n  want: {a}\n  got:  {b}", i + 1))
            .unwrap_or_else(|| "one output is a prefix of the other".to_string());
        panic!("{name}.{ext} differs: {line}");
    }
}

/// Caps high enough that no thread, function or probe of a fixture is folded into `other`.
fn wide_limits() -> Limits {
    Limits {
        threads: BudgetConfig::new(10_000),
        functions: BudgetConfig::new(10_000),
        probes: BudgetConfig::new(10_000),
        ..Limits::default()
    }
}

/// The agent's page after it applied the whole recording, sample lines sorted within each
/// family (a family's label sets are kept in a hash map).
fn agent_page(rec: &Recording) -> (String, Aggregator) {
    let (m, registry) = Metrics::new();
    let mut agg = Aggregator::new(m, wide_limits());
    let mut r = rec.clone();
    agg.apply(&mut r);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let mut out: Vec<String> = Vec::new();
    let mut run: Vec<&str> = Vec::new();
    for l in text.lines() {
        if l.starts_with('#') {
            run.sort_unstable();
            out.extend(run.drain(..).map(str::to_string));
            out.push(l.to_string());
        } else {
            run.push(l);
        }
    }
    run.sort_unstable();
    out.extend(run.drain(..).map(str::to_string));
    (out.join("\n") + "\n", agg)
}

#[test]
fn top_replay_plain_output_is_unchanged() {
    for name in FIXTURES {
        let o = Command::new(env!("CARGO_BIN_EXE_enginescope"))
            .args(["top", "--replay"])
            .arg(esrec(name))
            .output()
            .expect("run enginescope top --replay");
        assert!(
            o.status.success(),
            "top --replay {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        check_golden(name, "top.txt", &String::from_utf8_lossy(&o.stdout));
    }
}

#[test]
fn agent_metrics_page_is_unchanged() {
    for name in FIXTURES {
        let rec = read_recording(&esrec(name)).unwrap();
        let (page, _) = agent_page(&rec);
        check_golden(name, "metrics.txt", &page);
    }
}

/// The end of the last event of a recording, ns.
fn extent_ns(rec: &Recording) -> u64 {
    let mut end = rec.duration_ns();
    end = end.max(rec.samples.iter().map(|s| s.t_ns).max().unwrap_or(0));
    end = end.max(
        rec.offcpu
            .iter()
            .map(|o| o.start_ns + o.dur_ns)
            .max()
            .unwrap_or(0),
    );
    end = end.max(
        rec.gil_waits
            .iter()
            .map(|g| g.start_ns + g.dur_ns)
            .max()
            .unwrap_or(0),
    );
    end = end.max(
        rec.gc_pauses
            .iter()
            .map(|g| g.start_ns + g.dur_ns)
            .max()
            .unwrap_or(0),
    );
    end = end.max(
        rec.calls
            .iter()
            .map(|c| c.start_ns + c.dur_ns)
            .max()
            .unwrap_or(0),
    );
    end
}

/// Value of a sample line `name{labels} value` in the page.
fn page_values(page: &str, name: &str) -> HashMap<String, f64> {
    page.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, v) = rest.rsplit_once(' ')?;
            labels
                .starts_with('{')
                .then(|| (labels.to_string(), v.parse().ok()))
                .and_then(|(k, v)| Some((k, v?)))
        })
        .collect()
}

#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    cpu_s: f64,
    gil_held_s: f64,
    gil_wait_s: f64,
    switch_wait_s: f64,
    gc_s: f64,
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 + 1e-9 * a.abs().max(b.abs())
}

#[test]
fn report_top_and_agent_agree_per_thread() {
    for name in FIXTURES {
        let rec = read_recording(&esrec(name)).unwrap();

        // report
        let report = Report::build(&rec, &Selection::all(&rec));
        let from_report: BTreeMap<(i32, i32), Figures> = report
            .threads
            .iter()
            .map(|t| {
                (
                    (t.pid, t.tid),
                    Figures {
                        cpu_s: t.cpu_s,
                        gil_held_s: t.gil_held_s,
                        gil_wait_s: t.gil_wait_s,
                        switch_wait_s: t.gil_switch_wait_s,
                        gc_s: t.gc_s,
                    },
                )
            })
            .collect();
        assert!(
            from_report.values().any(|f| f.cpu_s > 0.0),
            "{name}: the report has no on-CPU time"
        );

        // top: one window over the whole recording.
        let end = extent_ns(&rec);
        let mut w = Window::new(end + 1_000_000_000, 4, 0);
        w.update(&rec, end);
        assert_eq!(
            w.start_ns(),
            0,
            "{name}: the window must cover the recording"
        );
        let snap = snapshot(&w, &rec, &Topology::default());
        let wall = w.wall_ns() as f64 / 1e9;

        // the agent
        let (page, agg) = agent_page(&rec);
        let cpu = page_values(&page, "enginescope_thread_cpu_seconds_total");
        let held = page_values(&page, "enginescope_thread_gil_held_seconds_total");
        let wait = page_values(&page, "enginescope_thread_gil_wait_seconds_total");
        let switch = page_values(&page, "enginescope_thread_gil_switch_wait_seconds_total");
        let gc_sum = page_values(&page, "enginescope_gc_pause_seconds_sum");

        let mut gc_per_process: BTreeMap<i32, f64> = BTreeMap::new();
        for (&(pid, tid), f) in &from_report {
            let t = snap.thread((pid, tid));
            let top = t.map_or(Figures::default(), |t| Figures {
                cpu_s: t.stats.cpu * wall,
                gil_held_s: t.stats.gil_held * wall,
                gil_wait_s: t.stats.gil_wait * wall,
                switch_wait_s: t.stats.switch_wait * wall,
                gc_s: t.stats.gc * wall,
            });
            for (what, r, tp) in [
                ("CPU", f.cpu_s, top.cpu_s),
                ("GIL held", f.gil_held_s, top.gil_held_s),
                ("GIL wait", f.gil_wait_s, top.gil_wait_s),
                ("GIL switch wait", f.switch_wait_s, top.switch_wait_s),
                ("GC", f.gc_s, top.gc_s),
            ] {
                assert!(
                    close(r, tp),
                    "{name}: thread {pid}/{tid} {what}: report {r} s, top {tp} s"
                );
            }
            let l = agg.thread_labels_of(pid, tid);
            let key = format!(
                "{{engine=\"{}\",role=\"{}\",thread=\"{}\"}}",
                l.engine, l.role, l.thread
            );
            for (what, r, series) in [
                ("CPU", f.cpu_s, &cpu),
                ("GIL held", f.gil_held_s, &held),
                ("GIL wait", f.gil_wait_s, &wait),
                ("GIL switch wait", f.switch_wait_s, &switch),
            ] {
                let a = series.get(&key).copied().unwrap_or(0.0);
                assert!(
                    close(r, a),
                    "{name}: thread {pid}/{tid} ({key}) {what}: report {r} s, agent {a} s"
                );
            }
            *gc_per_process.entry(pid).or_default() += f.gc_s;
        }
        for (pid, r) in gc_per_process {
            let p = agg.process_labels_of(pid);
            let prefix = format!("{{engine=\"{}\",role=\"{}\",generation=", p.engine, p.role);
            let a: f64 = gc_sum
                .iter()
                .filter(|(k, _)| k.starts_with(&prefix))
                .map(|(_, v)| v)
                .sum();
            assert!(
                close(r, a),
                "{name}: process {pid} GC: report {r} s, agent {a} s"
            );
        }
    }
}
