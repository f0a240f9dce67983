//! The aggregated form (`record::profile`, the agent's default) against the raw events of the
//! same run: each golden recording (tests/fixtures/golden) rewritten by `enginescope aggregate`
//! must give the same `report` per-thread figures (CPU, samples, off-CPU, preempted, GIL held,
//! GIL wait and its count, GC), the same per-function self time, the same probed-call counts
//! with every latency quantile within the bucket bound (1/64), and the same on-CPU and
//! off-CPU flamegraphs; and it must be smaller.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const FIXTURES: &[&str] = &["gil_bpf", "probes_bpf", "vllm_demo_bpf"];
const MAX_REL_ERROR: f64 = enginescope::record::profile::MAX_REL_ERROR;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_enginescope")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/golden/{name}.esrec"))
}

fn run(args: &[&std::ffi::OsStr]) -> Vec<u8> {
    let o = Command::new(bin())
        .args(args)
        .output()
        .expect("run enginescope");
    assert!(
        o.status.success(),
        "enginescope {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o.stdout
}

fn report(p: &Path) -> Value {
    serde_json::from_slice(&run(&[
        "report".as_ref(),
        p.as_os_str(),
        "--format".as_ref(),
        "json".as_ref(),
    ]))
    .expect("report JSON")
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()) + 1e-6
}

#[test]
fn aggregated_recordings_report_what_the_raw_ones_do() {
    let tmp = tempfile::tempdir().unwrap();
    let mut compared_calls = 0;
    for name in FIXTURES {
        let raw = fixture(name);
        let agg = tmp.path().join(format!("{name}.agg.esrec"));
        run(&[
            "aggregate".as_ref(),
            raw.as_os_str(),
            "-o".as_ref(),
            agg.as_os_str(),
            "--profile-seconds".as_ref(),
            "1".as_ref(),
        ]);
        let rr = enginescope::record::read_recording(&raw).unwrap();
        let ra = enginescope::record::read_recording(&agg).unwrap();
        assert!(rr.profile_intervals.is_empty());
        assert!(!ra.profile_intervals.is_empty(), "{name}: no intervals");
        let (br, ba) = (
            std::fs::metadata(&raw).unwrap().len(),
            std::fs::metadata(&agg).unwrap().len(),
        );
        assert!(ba < br, "{name}: aggregated {ba} bytes, raw {br}");
        eprintln!("{name}: raw {br} bytes, aggregated {ba}");

        let (jr, ja) = (report(&raw), report(&agg));
        let threads = jr["threads"].as_array().unwrap();
        assert!(!threads.is_empty());
        assert_eq!(threads.len(), ja["threads"].as_array().unwrap().len());
        for t in threads {
            let other = ja["threads"]
                .as_array()
                .unwrap()
                .iter()
                .find(|u| u["pid"] == t["pid"] && u["tid"] == t["tid"])
                .unwrap_or_else(|| panic!("{name}: thread {} missing", t["tid"]));
            for f in [
                "cpu_s",
                "samples",
                "python_s",
                "native_s",
                "offcpu_s",
                "offcpu_preempted_s",
                "offcpu_stolen_s",
                "gil_held_s",
                "gil_wait_s",
                "gil_waits",
                "gil_switch_wait_s",
                "gc_s",
                "gc_pauses",
            ] {
                let (a, b) = (t[f].as_f64(), other[f].as_f64());
                assert!(
                    a.is_some() && b.is_some() && close(a.unwrap(), b.unwrap(), 1e-9),
                    "{name}: thread {} {f}: raw {a:?}, aggregated {b:?}",
                    t["tid"]
                );
            }
        }
        // Per-function time equal; a probed function's latency (checked below) within the bound.
        let strip = |j: &Value| -> Vec<Value> {
            let mut v = j["functions"].as_array().cloned().unwrap_or_default();
            for f in &mut v {
                if let Some(o) = f.as_object_mut() {
                    o.remove("latency_ms");
                }
            }
            v
        };
        assert!(!strip(&jr).is_empty());
        assert_eq!(strip(&jr), strip(&ja), "{name}: per-function time");
        assert_eq!(jr["totals"], ja["totals"], "{name}: totals");
        // Collections (record 27): by generation the same count, objects freed and total
        // time, the longest pause within the bucket bound.
        for g in ["0", "1", "2"] {
            let (a, b) = (&jr["gc"]["by_generation"][g], &ja["gc"]["by_generation"][g]);
            assert_eq!(a["pauses"], b["pauses"], "{name}: gen {g} pauses");
            assert_eq!(a["collected"], b["collected"], "{name}: gen {g} collected");
            let (ta, tb) = (a["total_s"].as_f64(), b["total_s"].as_f64());
            assert!(
                ta.zip(tb).is_none_or(|(x, y)| close(x, y, 1e-9)),
                "{name}: gen {g} GC time: raw {ta:?}, aggregated {tb:?}"
            );
            let (ma, mb) = (a["max_ms"].as_f64(), b["max_ms"].as_f64());
            assert!(
                ma.zip(mb)
                    .is_none_or(|(x, y)| (x - y).abs() <= 2.0 * MAX_REL_ERROR * x + 1e-6),
                "{name}: gen {g} longest pause: raw {ma:?}, aggregated {mb:?}"
            );
        }
        let lat = jr["function_latency"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for l in &lat {
            let other = ja["function_latency"]
                .as_array()
                .unwrap()
                .iter()
                .find(|u| u["probe"] == l["probe"] && u["tid"] == l["tid"])
                .unwrap_or_else(|| panic!("{name}: latency of {} missing", l["probe"]));
            assert_eq!(l["calls"], other["calls"], "{name}: {} calls", l["probe"]);
            for q in ["p50", "p90", "p99", "max"] {
                let (a, b) = (
                    l["latency_ms"][q].as_f64().unwrap(),
                    other["latency_ms"][q].as_f64().unwrap(),
                );
                assert!(
                    close(a, b, MAX_REL_ERROR),
                    "{name}: {} {q}: raw {a} ms, aggregated {b} ms",
                    l["probe"]
                );
            }
            compared_calls += l["calls"].as_u64().unwrap();
        }
        assert_eq!(
            jr["api_server_stalls"]["stalls"], ja["api_server_stalls"]["stalls"],
            "{name}: stalls (the API server's main thread keeps its events)"
        );
        for kind in [&[][..], &["--offcpu"][..]] {
            let flame = |p: &Path| {
                let svg = tmp.path().join("f.svg");
                let mut args: Vec<&std::ffi::OsStr> = vec![
                    "flame".as_ref(),
                    p.as_os_str(),
                    "-o".as_ref(),
                    svg.as_os_str(),
                ];
                args.extend(kind.iter().map(|a| std::ffi::OsStr::new(*a)));
                run(&args);
                std::fs::read(&svg).unwrap()
            };
            assert!(
                flame(&raw) == flame(&agg),
                "{name}: flamegraph {kind:?} differs"
            );
        }
    }
    assert!(
        compared_calls > 100,
        "only {compared_calls} probed calls compared"
    );
}
