//! Golden reports: `report --format json` and `--format md` over committed recordings must give
//! byte-for-byte the output committed beside them. The recordings (tests/fixtures/golden) were
//! made by the recorder before the recording-loop redesign (issue 10): the BPF backend over
//! samples/gil_contention.py (GIL waits), the memory backend over the same, the BPF
//! backend with `--probe` over samples/cpu_mix.py, and `enginescope demo` (the bundled vLLM-like
//! engine: engines, metrics, probed latency, GC pauses, API-server stalls). So this test shows that the
//! file format reads the same and the report schema and figures do not change.
//!
//! Every value in a report comes from the recording (host name, kernel, command line, paths),
//! none from the machine reading it, so the expected files hold on any host.
//!
//! The expected files are never written by this test unless asked: `ES_UPDATE_GOLDEN=1 cargo
//! test --test report_golden` rewrites them (then review the diff).

use std::path::{Path, PathBuf};
use std::process::Command;

const FIXTURES: &[&str] = &["gil_bpf", "gil_memory", "probes_bpf", "vllm_demo_bpf"];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden")
}

fn report(esrec: &Path, format: &str) -> Vec<u8> {
    let o = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .arg("report")
        .arg(esrec)
        .args(["--format", format])
        .output()
        .expect("run enginescope report");
    assert!(
        o.status.success(),
        "report {} --format {format} failed: {}",
        esrec.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    o.stdout
}

/// The first line where two outputs differ, for a readable failure.
fn first_difference(want: &[u8], got: &[u8]) -> String {
    let (w, g) = (String::from_utf8_lossy(want), String::from_utf8_lossy(got));
    for (i, (a, b)) in w.lines().zip(g.lines()).enumerate() {
        if a != b {
            return format!("line {}:\n  want: {a}\n  got:  {b}", i + 1);
        }
    }
    format!(
        "one output is a prefix of the other ({} vs {} lines)",
        w.lines().count(),
        g.lines().count()
    )
}

fn check(name: &str, format: &str, ext: &str) {
    let esrec = dir().join(format!("{name}.esrec"));
    let expected = dir().join(format!("{name}.report.{ext}"));
    let got = report(&esrec, format);
    if std::env::var_os("ES_UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(&expected, &got).unwrap();
        eprintln!("rewrote {}", expected.display());
        return;
    }
    let want = std::fs::read(&expected).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (golden files are only written with ES_UPDATE_GOLDEN=1)",
            expected.display()
        )
    });
    assert!(
        want == got,
        "report --format {format} of {} differs from {}: {}",
        esrec.display(),
        expected.display(),
        first_difference(&want, &got)
    );
}

#[test]
fn json_reports_are_unchanged() {
    for name in FIXTURES {
        check(name, "json", "json");
    }
}

#[test]
fn markdown_reports_are_unchanged() {
    for name in FIXTURES {
        check(name, "md", "md");
    }
}

#[test]
fn fixtures_cover_every_section() {
    // The golden files only prove something if the sections the redesign touches are there.
    let v: serde_json::Value =
        serde_json::from_slice(&report(&dir().join("vllm_demo_bpf.esrec"), "json")).unwrap();
    for key in ["engines", "function_latency", "windows"] {
        let a = v[key].as_array().unwrap();
        assert!(!a.is_empty(), "vllm_demo_bpf: {key} is empty");
    }
    assert!(
        !v["api_server_stalls"]["servers"]
            .as_array()
            .unwrap()
            .is_empty(),
        "vllm_demo_bpf: no API server"
    );
    assert!(
        v["gc"]["pauses"].as_u64().unwrap() > 0,
        "vllm_demo_bpf: no GC pause"
    );
    let g: serde_json::Value =
        serde_json::from_slice(&report(&dir().join("gil_bpf.esrec"), "json")).unwrap();
    assert!(
        !g["gil_blocking"].as_array().unwrap().is_empty(),
        "gil_bpf: no GIL wait"
    );
    let p: serde_json::Value =
        serde_json::from_slice(&report(&dir().join("probes_bpf.esrec"), "json")).unwrap();
    assert!(!p["function_latency"].as_array().unwrap().is_empty());
    let m: serde_json::Value =
        serde_json::from_slice(&report(&dir().join("gil_memory.esrec"), "json")).unwrap();
    assert_eq!(m["recording"]["backend"], "memory");
}
