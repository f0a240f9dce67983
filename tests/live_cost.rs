//! `record --measure-cost` on the bundled engine (samples/engine): the instrument switches the
//! recording's parts off and on in slices and reads the engine's own token counter at each
//! edge. Checked from the recording itself, against the times the instrument says each mask
//! held: no sample while sampling was off, no off-CPU interval begun while switch tracing was
//! off, no probed call begun while the probes were off, and each of them present while on;
//! every comparison measured with both arms of each pair, the recording loop at normal priority
//! exactly in the arms with its real-time part off, and everything on again at the end.
//! Cost: ~27 s (an 18 s measurement plus the engine's start).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use common::*;
use enginescope::bpf::abi::{OFF_PROBE, OFF_SAMPLE, OFF_STACKS, OFF_SWITCH};
use enginescope::record::read_recording;
use enginescope::sampler::cost::OFF_REALTIME;

/// The edges are stamped just before the parts change: events of the edge's first
/// milliseconds may still come from the arm before.
const SETTLE_NS: u64 = 20_000_000;

#[test]
fn measure_cost_switches_each_part_off_in_its_slices() {
    let py = interp("pyenv-3.12");
    if !available(&py) {
        return;
    }
    let Launch::Host(python) = &py.launch else {
        unreachable!()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    make_go_fifo(dir);
    let mut engine = Command::new(python)
        .arg(repo_root().join("samples/engine/serve.py"))
        .args(["serve", "--port", "0", "--seconds", "60"])
        .arg("--truth")
        .arg(dir.join("truth"))
        .arg("--go-fifo")
        .arg(dir.join("go"))
        .args(["--steps-per-s", "40", "--exec-ms", "2", "--puts-per-s", "5"])
        .args([
            "--max-num-seqs",
            "8",
            "--max-tokens",
            "64",
            "--requests",
            "8",
        ])
        .arg("-q")
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("start samples/engine/serve.py");
    let mut out = BufReader::new(engine.stdout.take().unwrap());
    let mut line = String::new();
    let api: i32 = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "engine exited before READY"
        );
        if let Some(rest) = line.strip_prefix("READY ") {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || {
        let mut sink = String::new();
        while out.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("go"))
        .unwrap()
        .write_all(b"GO\n")
        .unwrap();

    let esrec = dir.join("cost.esrec");
    let o = enginescope(&[
        "record",
        "--vllm",
        "--engine-pid",
        &api.to_string(),
        "--rate",
        "199",
        "--measure-cost",
        "--cost-each-part",
        "--cost-pairs",
        "2",
        "--cost-slice",
        "0.5",
        "--cost-seed",
        "3",
        "--json",
        "-o",
        esrec.to_str().unwrap(),
    ]);
    // SAFETY: kill(2) on the engine we started.
    unsafe { libc::kill(engine.id() as i32, libc::SIGTERM) };
    let _ = engine.wait();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "record --measure-cost failed:\n{stderr}"
    );
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cost = &summary["cost"];
    let rows = cost["engines"][0][1].as_array().expect("one engine's rows");
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "everything",
            "sampling",
            "off-CPU and GIL",
            "off-CPU stacks",
            "GC",
            "probes",
            "task readers",
            "real-time loop",
            "null (nothing differs)"
        ]
    );
    for r in rows {
        // The engine generates tokens all the time: every pair has both arms with progress.
        assert_eq!(r["pairs"], 2, "{r}");
        let ratio = r["ratio"].as_f64().unwrap();
        assert!(ratio > 0.0 && ratio.is_finite(), "{r}");
    }

    let rec = read_recording(&esrec).unwrap();
    let changes: Vec<(u64, u32)> = cost["mask_changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c[0].as_u64().unwrap(), c[1].as_u64().unwrap() as u32))
        .collect();
    // 9 comparisons x 2 pairs x 2 arms, then everything on.
    assert_eq!(changes.len(), 37, "{changes:?}");
    assert_eq!(changes.last().unwrap().1, 0);
    // The loop ran at normal priority exactly in the arms with its real-time part off (the
    // kernel's answer after each change), and real-time in the others (the tests run as root).
    let realtime: Vec<bool> = cost["loop_realtime"]
        .as_array()
        .expect("loop_realtime")
        .iter()
        .map(|v| v.as_bool().unwrap())
        .collect();
    assert_eq!(realtime.len(), changes.len());
    for (&(t, mask), rt) in changes.iter().zip(&realtime) {
        assert_eq!(
            *rt,
            mask & OFF_REALTIME == 0,
            "at {t} ns, mask {mask:#x}: loop real-time {rt}"
        );
    }
    let spans: Vec<(u64, u64, u32)> = changes
        .windows(2)
        .map(|w| (w[0].0 + SETTLE_NS, w[1].0, w[0].1))
        .filter(|&(a, b, _)| a < b)
        .collect();
    let count = |bit: u32, off: bool, times: &mut dyn Iterator<Item = u64>| -> usize {
        let times: Vec<u64> = times.collect();
        spans
            .iter()
            .filter(|&&(_, _, m)| (m & bit != 0) == off)
            .map(|&(a, b, _)| times.iter().filter(|&&t| t >= a && t < b).count())
            .sum()
    };
    let samples = || rec.samples.iter().map(|s| s.t_ns);
    assert_eq!(
        count(OFF_SAMPLE, true, &mut samples()),
        0,
        "samples while sampling was off"
    );
    assert!(
        count(OFF_SAMPLE, false, &mut samples()) > 0,
        "no sample while sampling was on"
    );
    let offcpu = || rec.offcpu.iter().map(|o| o.start_ns);
    let in_hole: Vec<_> = rec
        .offcpu
        .iter()
        .filter(|o| {
            spans
                .iter()
                .any(|&(a, b, m)| m & OFF_SWITCH != 0 && o.start_ns >= a && o.start_ns < b)
        })
        .collect();
    assert!(
        in_hole.is_empty(),
        "off-CPU intervals begun while switches were off: {in_hole:?}"
    );
    assert!(
        count(OFF_SWITCH, false, &mut offcpu()) > 0,
        "no off-CPU interval while on"
    );
    // The stacks part leaves switch tracing on: its off arms have intervals, at the stacks
    // last walked.
    assert!(
        count(OFF_STACKS, true, &mut offcpu()) > 0,
        "no off-CPU interval while only the stack walks were off"
    );
    let calls = || rec.calls.iter().map(|c| c.start_ns);
    assert_eq!(
        count(OFF_PROBE, true, &mut calls()),
        0,
        "probed calls begun while the probes were off"
    );
    assert!(
        count(OFF_PROBE, false, &mut calls()) > 0,
        "no probed call while the probes were on"
    );
    assert!(
        stderr.contains("measuring what this recording costs"),
        "{stderr}"
    );
}
