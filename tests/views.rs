//! Views over recordings (flame, export, report) on synthetic recordings whose right answers are
//! known by construction.
//!
//! The fixture: three threads in two processes.
//! - pid 100 "python3.12", tid 101 "MainThread": 300 samples of 1 ms in `a` (GIL held), then
//!   100 of 1 ms in `b` under NATIVE; then off CPU 50 ms blocked and 25 ms preempted in `wait`.
//! - pid 100, tid 102 "worker-1": 50 samples of 2 ms in `recurse` three deep (GIL held); the
//!   first 10 during a GC.
//! - pid 200 role "EngineCore", tid 201 "MainThread": 20 samples of 1 ms in `b` under
//!   NATIVE|KERNEL, 5 with no Python frame, 4 PARTIAL in `a`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use enginescope::record::format::parse_recording;
use enginescope::record::{
    flags, read_recording, EndInfo, Frame, Meta, OffCpu, ProcessInfo, Recording, RecordingWriter,
    Sample, ThreadInfo,
};
use enginescope::views::{self, ExportFormat, Filter, FilterArgs, ReportFormat, Selection};
use serde_json::Value;

const MS: u32 = 1_000_000;

fn frame(function: &str, file: &str, line: i32) -> Frame {
    Frame {
        function: function.into(),
        file: file.into(),
        line: Some(line),
    }
}

fn main_f() -> Frame {
    frame("main", "/srv/app.py", 1)
}
fn compute() -> Frame {
    frame("compute", "/srv/app.py", 10)
}
fn a() -> Frame {
    frame("a", "/srv/lib.py", 20)
}
fn b() -> Frame {
    frame("b", "/srv/lib.py", 30)
}
fn recurse() -> Frame {
    frame("recurse", "/srv/lib.py", 40)
}
fn wait() -> Frame {
    frame("wait", "/srv/io.py", 5)
}

fn sample(t_ns: u64, pid: i32, tid: i32, stack: u32, flags: u8, weight_ns: u32) -> Sample {
    Sample {
        t_ns,
        pid,
        tid,
        stack,
        flags,
        weight_ns,
    }
}

/// Write the fixture; `finish` false leaves it without an end record.
fn write_fixture(path: &Path, finish: bool) {
    let meta = Meta {
        tool_version: "0.1.0".into(),
        start_unix_s: 1_700_000_000.0,
        start_mono_ns: 5,
        rate_hz: 1000,
        backend: "bpf".into(),
        backend_reason: "test".into(),
        hostname: "testhost".into(),
        kernel: "6.1".into(),
        command: "enginescope record -p 100,200".into(),
        cpus: 4,
    };
    let mut w = RecordingWriter::create(path, &meta).unwrap();
    w.process(&ProcessInfo {
        pid: 100,
        cmdline: "/usr/bin/python3.12 serve.py".into(),
        python_version: "3.12.1".into(),
        role: String::new(),
    })
    .unwrap();
    w.process(&ProcessInfo {
        pid: 200,
        cmdline: "python3.11 -m engine".into(),
        python_version: "3.11.7".into(),
        role: "EngineCore".into(),
    })
    .unwrap();
    for (pid, tid, name) in [
        (100, 101, "MainThread"),
        (100, 102, "worker-1"),
        (200, 201, "MainThread"),
    ] {
        w.thread(&ThreadInfo {
            pid,
            tid,
            name: name.into(),
            t_ns: 0,
        })
        .unwrap();
    }
    let s_a = w.intern_stack(&[a(), compute(), main_f()]).unwrap();
    let s_b = w.intern_stack(&[b(), compute(), main_f()]).unwrap();
    let s_rec = w
        .intern_stack(&[recurse(), recurse(), recurse(), main_f()])
        .unwrap();
    let s_wait = w.intern_stack(&[wait(), main_f()]).unwrap();
    let s_partial_a = w.intern_stack(&[a()]).unwrap();

    // Interleave the threads the way a recorder writes them (roughly by time).
    for i in 0..400u64 {
        let t = i * u64::from(MS);
        if i < 300 {
            w.sample(&sample(t, 100, 101, s_a, flags::GIL, MS)).unwrap();
        } else {
            w.sample(&sample(t, 100, 101, s_b, flags::NATIVE, MS))
                .unwrap();
        }
        if i % 2 == 0 && i / 2 < 50 {
            let gc = if i / 2 < 10 { flags::GC } else { 0 };
            w.sample(&sample(t, 100, 102, s_rec, flags::GIL | gc, 2 * MS))
                .unwrap();
        }
        if i < 29 {
            let (stack, f) = match i {
                0..20 => (s_b, flags::NATIVE | flags::KERNEL),
                20..25 => (0, 0),
                _ => (s_partial_a, flags::PARTIAL),
            };
            w.sample(&sample(t, 200, 201, stack, f, MS)).unwrap();
        }
    }
    w.offcpu(&OffCpu {
        pid: 100,
        tid: 101,
        start_ns: 400 * u64::from(MS),
        dur_ns: 50 * u64::from(MS),
        stack: s_wait,
        preempted: false,
    })
    .unwrap();
    w.offcpu(&OffCpu {
        pid: 100,
        tid: 101,
        start_ns: 460 * u64::from(MS),
        dur_ns: 25 * u64::from(MS),
        stack: s_wait,
        preempted: true,
    })
    .unwrap();
    w.counters(&BTreeMap::from([
        ("samples_lost".to_string(), 3),
        ("stack_read_errors".to_string(), 1),
    ]))
    .unwrap();
    if finish {
        w.finish(&EndInfo {
            duration_ns: 1_000_000_000,
            reason: "duration".into(),
        })
        .unwrap();
    } else {
        w.flush().unwrap();
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    path: PathBuf,
    rec: Recording,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fixture.esrec");
    write_fixture(&path, true);
    let rec = read_recording(&path).unwrap();
    assert!(!rec.truncated);
    Fixture {
        dir: dir.path().to_path_buf(),
        _dir: dir,
        path,
        rec,
    }
}

fn select(rec: &Recording, pid: Option<i32>, tid: Option<i32>, name: Option<&str>) -> Selection {
    Filter::new(&FilterArgs {
        pid,
        tid,
        thread_name: name.map(String::from),
    })
    .select(rec)
}

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(args)
        .output()
        .expect("running enginescope")
}

// ---------------------------------------------------------------- folded

const P100: &str = "python3.12 (pid 100)";
const P200: &str = "EngineCore (pid 200)";

#[test]
fn folded_lines_are_exact() {
    let f = fixture();
    let text = views::folded::render(&f.rec, &Selection::all(&f.rec));
    let mut expected = vec![
        format!("{P100};MainThread (tid 101);main (app.py:1);compute (app.py:10);a (lib.py:20) 300"),
        format!("{P100};MainThread (tid 101);main (app.py:1);compute (app.py:10);b (lib.py:30);[native] 100"),
        format!("{P100};worker-1 (tid 102);main (app.py:1);recurse (lib.py:40);recurse (lib.py:40);recurse (lib.py:40) 40"),
        format!("{P100};worker-1 (tid 102);main (app.py:1);recurse (lib.py:40);recurse (lib.py:40);recurse (lib.py:40);[gc] 10"),
        format!("{P200};MainThread (tid 201) 5"),
        format!("{P200};MainThread (tid 201);main (app.py:1);compute (app.py:10);b (lib.py:30);[native];[kernel] 20"),
        format!("{P200};MainThread (tid 201);[partial stack];a (lib.py:20) 4"),
    ];
    expected.sort();
    assert_eq!(text.lines().collect::<Vec<_>>(), expected);
}

#[test]
fn folded_respects_filters() {
    let f = fixture();
    let by_name = views::folded::render(&f.rec, &select(&f.rec, None, None, Some("^worker")));
    assert_eq!(by_name.lines().count(), 2);
    assert!(by_name.lines().all(|l| l.contains("worker-1 (tid 102)")));
    let by_pid = views::folded::render(&f.rec, &select(&f.rec, Some(200), None, None));
    let total: u64 = by_pid
        .lines()
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(total, 29);
    let main_threads = select(&f.rec, None, None, Some("MainThread"));
    assert_eq!(
        main_threads.threads().collect::<Vec<_>>(),
        [(100, 101), (200, 201)]
    );
}

// ---------------------------------------------------------------- flame

#[test]
fn flame_svg_has_frames_markers_and_title() {
    let f = fixture();
    let svg =
        String::from_utf8(views::flame::render(&f.rec, &Selection::all(&f.rec), false).unwrap())
            .unwrap();
    assert!(svg.starts_with("<?xml"), "{}", &svg[..100]);
    for name in [
        "a (lib.py:20)",
        "b (lib.py:30)",
        "recurse (lib.py:40)",
        "[native]",
        "[kernel]",
        "[gc]",
        "[partial stack]",
        "MainThread (tid 101)",
        "worker-1 (tid 102)",
        "MainThread (tid 201)",
        P100,
        P200,
        "On-CPU time",
        "479 samples",
        "bpf backend at 1000 Hz",
        "2023-11-14 22:13:20 UTC",
        "testhost",
    ] {
        assert!(svg.contains(name), "flamegraph lacks {name:?}");
    }
    // Widths are time: `a` has 300 ms = 300,000 µs of 529 ms.
    assert!(
        svg.contains("a (lib.py:20) (300,000 µs, 56.71%)"),
        "a's tooltip"
    );
    assert!(
        !svg.contains("wait (io.py:5)"),
        "off-CPU frames in the on-CPU graph"
    );
}

#[test]
fn flame_offcpu_and_filters() {
    let f = fixture();
    let svg =
        String::from_utf8(views::flame::render(&f.rec, &Selection::all(&f.rec), true).unwrap())
            .unwrap();
    assert!(svg.contains("Off-CPU time"));
    assert!(
        svg.contains("wait (io.py:5) (75,000 µs, 100.00%)"),
        "wait's tooltip"
    );
    assert!(svg.contains("[preempted] (25,000 µs"));
    assert!(!svg.contains("a (lib.py:20)"));

    let svg = String::from_utf8(
        views::flame::render(&f.rec, &select(&f.rec, None, Some(102), None), false).unwrap(),
    )
    .unwrap();
    assert!(svg.contains("recurse (lib.py:40)"));
    assert!(!svg.contains("a (lib.py:20)"));
    assert!(
        svg.contains("tid 102"),
        "the filter is named in the subtitle"
    );

    // Nothing off CPU in tid 102: a clear error, not an empty picture.
    let e = views::flame::render(&f.rec, &select(&f.rec, None, Some(102), None), true).unwrap_err();
    assert!(e.to_string().contains("nothing to draw"), "{e}");
}

// ---------------------------------------------------------------- pprof

fn pprof_str(p: &views::pprof::proto::Profile, i: i64) -> &str {
    &p.string_table[usize::try_from(i).unwrap()]
}

#[test]
fn pprof_decodes_with_totals_and_stacks() {
    let f = fixture();
    let bytes = views::export(&f.rec, &Selection::all(&f.rec), ExportFormat::Pprof).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "gzipped");
    let p = views::pprof::decode(&bytes).unwrap();
    assert_eq!(p.string_table[0], "");
    let types: Vec<(&str, &str)> = p
        .sample_type
        .iter()
        .map(|t| (pprof_str(&p, t.r#type), pprof_str(&p, t.unit)))
        .collect();
    assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
    assert_eq!(pprof_str(&p, p.default_sample_type), "cpu");
    assert_eq!(p.period, 1_000_000);
    assert_eq!(p.duration_nanos, 1_000_000_000);
    assert_eq!(p.time_nanos, 1_700_000_000_000_000_000);

    let count: i64 = p.sample.iter().map(|s| s.value[0]).sum();
    let ns: i64 = p.sample.iter().map(|s| s.value[1]).sum();
    assert_eq!(count, 479);
    assert_eq!(ns, 529_000_000);

    let func_of = |loc: u64| {
        let l = p.location.iter().find(|l| l.id == loc).unwrap();
        assert_eq!(l.line.len(), 1);
        let fun = p
            .function
            .iter()
            .find(|f| f.id == l.line[0].function_id)
            .unwrap();
        (
            pprof_str(&p, fun.name).to_string(),
            pprof_str(&p, fun.filename).to_string(),
            l.line[0].line,
        )
    };
    let label = |s: &views::pprof::proto::Sample, key: &str| {
        s.label
            .iter()
            .find(|l| pprof_str(&p, l.key) == key)
            .map(|l| (l.num, pprof_str(&p, l.str).to_string()))
            .unwrap()
    };
    let stacks: Vec<(Vec<String>, i64, i64, i64, String)> = p
        .sample
        .iter()
        .map(|s| {
            (
                s.location_id.iter().map(|&l| func_of(l).0).collect(),
                s.value[0],
                s.value[1],
                label(s, "tid").0,
                label(s, "thread_name").1,
            )
        })
        .collect();
    // Leaf first, as pprof wants.
    assert!(stacks.contains(&(
        vec!["a".into(), "compute".into(), "main".into()],
        300,
        300_000_000,
        101,
        "MainThread".into()
    )));
    assert!(stacks.contains(&(
        vec![
            "[native]".into(),
            "b".into(),
            "compute".into(),
            "main".into()
        ],
        100,
        100_000_000,
        101,
        "MainThread".into()
    )));
    assert!(stacks.contains(&(
        vec![
            "[gc]".into(),
            "recurse".into(),
            "recurse".into(),
            "recurse".into(),
            "main".into()
        ],
        10,
        20_000_000,
        102,
        "worker-1".into()
    )));
    assert!(stacks.contains(&(
        vec![
            "[kernel]".into(),
            "[native]".into(),
            "b".into(),
            "compute".into(),
            "main".into()
        ],
        20,
        20_000_000,
        201,
        "MainThread".into()
    )));
    assert!(stacks.contains(&(
        vec!["a".into(), "[partial stack]".into()],
        4,
        4_000_000,
        201,
        "MainThread".into()
    )));
    // Functions carry the full file name; locations the line.
    let first = p.sample.iter().find(|s| s.value[0] == 300).unwrap();
    assert_eq!(
        func_of(first.location_id[0]),
        ("a".into(), "/srv/lib.py".into(), 20)
    );
    assert_eq!(label(first, "pid").0, 100);
    // Each frame is one location, shared between samples.
    let mut ids: Vec<u64> = p.location.iter().map(|l| l.id).collect();
    ids.dedup();
    assert_eq!(ids.len(), p.location.len());
}

// ---------------------------------------------------------------- speedscope

#[test]
fn speedscope_profiles_per_thread() {
    let f = fixture();
    let bytes = views::export(&f.rec, &Selection::all(&f.rec), ExportFormat::Speedscope).unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        v["$schema"],
        "https://www.speedscope.app/file-format-schema.json"
    );
    let frames = v["shared"]["frames"].as_array().unwrap();
    let profiles = v["profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 3);
    assert_eq!(v["activeProfileIndex"], 0, "the busiest thread first");
    let names: Vec<&str> = profiles
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "MainThread (tid 101) — python3.12 (pid 100)",
            "worker-1 (tid 102) — python3.12 (pid 100)",
            "MainThread (tid 201) — EngineCore (pid 200)",
        ]
    );
    let stack_names = |s: &Value| -> Vec<String> {
        s.as_array()
            .unwrap()
            .iter()
            .map(|i| {
                frames[i.as_u64().unwrap() as usize]["name"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    for (p, n, total) in [
        (&profiles[0], 400, 400_000_000u64),
        (&profiles[1], 50, 100_000_000),
        (&profiles[2], 29, 29_000_000),
    ] {
        assert_eq!(p["type"], "sampled");
        assert_eq!(p["unit"], "nanoseconds");
        assert_eq!(p["samples"].as_array().unwrap().len(), n);
        let w: Vec<u64> = p["weights"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w.as_u64().unwrap())
            .collect();
        assert_eq!(w.len(), n);
        assert_eq!(w.iter().sum::<u64>(), total);
        assert_eq!(p["endValue"].as_u64().unwrap(), total);
    }
    // Root first, time order: `a` for 300 samples, then `b` under [native].
    let p0 = &profiles[0]["samples"];
    assert_eq!(stack_names(&p0[0]), ["main", "compute", "a"]);
    assert_eq!(stack_names(&p0[299]), ["main", "compute", "a"]);
    assert_eq!(stack_names(&p0[300]), ["main", "compute", "b", "[native]"]);
    assert_eq!(
        stack_names(&profiles[1]["samples"][0]),
        ["main", "recurse", "recurse", "recurse", "[gc]"]
    );
    assert_eq!(
        stack_names(&profiles[1]["samples"][10]),
        ["main", "recurse", "recurse", "recurse"]
    );
    assert_eq!(
        stack_names(&profiles[2]["samples"][20]),
        Vec::<String>::new()
    );
    // Frames are shared and carry file and line.
    let a = frames.iter().find(|f| f["name"] == "a").unwrap();
    assert_eq!(a["file"], "/srv/lib.py");
    assert_eq!(a["line"], 20);
    assert_eq!(frames.iter().filter(|f| f["name"] == "a").count(), 1);
}

// ---------------------------------------------------------------- chrome

#[test]
fn chrome_trace_timeline() {
    let f = fixture();
    let bytes = views::export(&f.rec, &Selection::all(&f.rec), ExportFormat::Chrome).unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let meta = |name: &str, pid: i64, tid: i64| {
        events
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == name && e["pid"] == pid && e["tid"] == tid)
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
    };
    assert_eq!(meta("process_name", 100, 0).as_deref(), Some("python3.12"));
    assert_eq!(meta("process_name", 200, 0).as_deref(), Some("EngineCore"));
    assert_eq!(meta("thread_name", 100, 102).as_deref(), Some("worker-1"));
    assert_eq!(meta("thread_name", 200, 201).as_deref(), Some("MainThread"));

    let xs = |cat: &str, tid: i64| -> Vec<(String, f64, f64, Value)> {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == cat && e["tid"] == tid)
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["ts"].as_f64().unwrap(),
                    e["dur"].as_f64().unwrap(),
                    e["args"].clone(),
                )
            })
            .collect()
    };
    // tid 101: 300 ms in a, then 100 ms in b (native), then two off-CPU intervals.
    let on = xs("on-cpu", 101);
    assert_eq!(on.len(), 2);
    assert_eq!(
        (on[0].0.as_str(), on[0].1, on[0].2),
        ("a (lib.py:20)", 0.0, 300_000.0)
    );
    assert_eq!(on[0].3["samples"], 300);
    assert_eq!(on[0].3["gil_samples"], 300);
    assert_eq!(on[0].3["mode"], "python");
    assert_eq!(
        on[0].3["stack"],
        serde_json::json!(["main (app.py:1)", "compute (app.py:10)", "a (lib.py:20)"])
    );
    assert_eq!(
        (on[1].0.as_str(), on[1].1, on[1].2),
        ("b (lib.py:30)", 300_000.0, 100_000.0)
    );
    assert_eq!(on[1].3["mode"], "native");
    let off = xs("off-cpu", 101);
    assert_eq!(off.len(), 2);
    assert_eq!(
        (off[0].0.as_str(), off[0].1, off[0].2),
        ("wait (io.py:5)", 400_000.0, 50_000.0)
    );
    assert_eq!(off[0].3["preempted"], false);
    assert_eq!((off[1].1, off[1].2), (460_000.0, 25_000.0));
    assert_eq!(off[1].3["preempted"], true);

    // tid 102: the GC flag splits the run: 10 samples (20 ms), then 40 (80 ms).
    let on = xs("on-cpu", 102);
    let shape: Vec<(f64, f64, u64, bool)> = on
        .iter()
        .map(|e| {
            (
                e.1,
                e.2,
                e.3["samples"].as_u64().unwrap(),
                e.3["gc"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [(0.0, 20_000.0, 10, true), (20_000.0, 80_000.0, 40, false)]
    );
    assert!(xs("off-cpu", 102).is_empty());

    // tid 201: native+kernel, no Python frame, partial.
    let on = xs("on-cpu", 201);
    let names: Vec<&str> = on.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(
        names,
        ["b (lib.py:30)", "[no Python frame]", "a (lib.py:20)"]
    );
    assert_eq!(on[0].3["mode"], "kernel");
    assert_eq!(
        on[2].3["stack"],
        serde_json::json!(["[partial stack]", "a (lib.py:20)"])
    );
    // Every on-CPU microsecond is accounted for: 529 ms.
    let total_us: f64 = events
        .iter()
        .filter(|e| e["cat"] == "on-cpu")
        .map(|e| e["dur"].as_f64().unwrap())
        .sum();
    assert_eq!(total_us, 529_000.0);
}

// ---------------------------------------------------------------- report

#[test]
fn report_json_numbers_are_exact() {
    let f = fixture();
    let bytes = views::report(&f.rec, &Selection::all(&f.rec), ReportFormat::Json).unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["schema"], "enginescope.report/1");
    assert_eq!(v["duration_s"], 1.0);
    assert_eq!(v["truncated"], false);
    assert_eq!(v["recording"]["end_reason"], "duration");
    assert_eq!(v["recording"]["start_utc"], "2023-11-14 22:13:20 UTC");
    assert_eq!(
        v["counters"],
        serde_json::json!({"samples_lost": 3, "stack_read_errors": 1})
    );
    assert_eq!(
        v["totals"],
        serde_json::json!({"samples": 479, "cpu_s": 0.529, "python_s": 0.409, "native_s": 0.12, "offcpu_s": 0.075})
    );

    let threads = v["threads"].as_array().unwrap();
    let t = |i: usize, k: &str| threads[i][k].clone();
    // Most CPU first.
    assert_eq!(
        threads
            .iter()
            .map(|t| t["tid"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        [101, 102, 201]
    );
    assert_eq!(
        threads[0],
        serde_json::json!({
            "pid": 100, "tid": 101, "name": "MainThread", "cpu_s": 0.4, "samples": 400,
            "python_s": 0.3, "native_s": 0.1, "offcpu_s": 0.075, "offcpu_preempted_s": 0.025,
            "gil_held_share": 0.75, "gc_share": 0.0,
        })
    );
    assert_eq!((t(1, "cpu_s"), t(1, "samples")), (0.1.into(), 50.into()));
    assert_eq!(
        (t(1, "gil_held_share"), t(1, "gc_share")),
        (1.0.into(), 0.2.into())
    );
    assert_eq!(
        (t(2, "python_s"), t(2, "native_s")),
        (0.009.into(), 0.02.into())
    );
    assert_eq!(t(2, "offcpu_s"), 0.0);

    let rows: Vec<(String, i64, f64, f64)> = v["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["function"].as_str().unwrap().to_string(),
                f["tid"].as_i64().unwrap(),
                f["self_s"].as_f64().unwrap(),
                f["total_s"].as_f64().unwrap(),
            )
        })
        .collect();
    let r = |f: &str, tid: i64, s: f64, tot: f64| (f.to_string(), tid, s, tot);
    assert_eq!(
        rows,
        [
            r("a", 101, 0.3, 0.3),
            r("b", 101, 0.1, 0.1),
            // Three frames deep, counted once per sample.
            r("recurse", 102, 0.1, 0.1),
            r("b", 201, 0.02, 0.02),
            r("a", 201, 0.004, 0.004),
            r("compute", 101, 0.0, 0.4),
            r("main", 101, 0.0, 0.4),
            r("main", 102, 0.0, 0.1),
            r("compute", 201, 0.0, 0.02),
            r("main", 201, 0.0, 0.02),
        ]
    );
    let rec_row = &v["functions"][2];
    assert_eq!(rec_row["file"], "/srv/lib.py");
    assert_eq!(
        (
            rec_row["self_samples"].as_u64(),
            rec_row["total_samples"].as_u64()
        ),
        (Some(50), Some(50))
    );
    assert_eq!(v["functions"][1]["self_native_s"], 0.1);
    assert_eq!(v["functions"][0]["self_native_s"], 0.0);
}

#[test]
fn report_shares_follow_filters() {
    let f = fixture();
    let v: Value = serde_json::from_slice(
        &views::report(
            &f.rec,
            &select(&f.rec, None, Some(101), None),
            ReportFormat::Json,
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(v["selection"], "tid 101");
    assert_eq!(v["threads"].as_array().unwrap().len(), 1);
    assert_eq!(v["processes"].as_array().unwrap().len(), 1);
    let f0 = &v["functions"][0];
    let f1 = &v["functions"][1];
    // 300 samples in a, 100 in b: 0.75 / 0.25 of the thread's CPU.
    assert_eq!(
        (&f0["function"], &f0["self_share"]),
        (&"a".into(), &0.75.into())
    );
    assert_eq!(
        (&f1["function"], &f1["self_share"]),
        (&"b".into(), &0.25.into())
    );
    // compute and main are on every sample.
    assert_eq!(v["functions"][2]["total_share"], 1.0);
    assert_eq!(v["functions"][2]["self_share"], 0.0);
}

#[test]
fn report_markdown_tables() {
    let f = fixture();
    let md = String::from_utf8(
        views::report(&f.rec, &Selection::all(&f.rec), ReportFormat::Md).unwrap(),
    )
    .unwrap();
    assert!(
        md.contains(
            "| 100 | 101 | MainThread | 0.400 | 400 | 0.300 | 0.100 | 0.075 | 75.0% | 0.0% |"
        ),
        "{md}"
    );
    assert!(
        md.contains(
            "| 100 | 102 | worker-1 | 0.100 | 50 | 0.100 | 0.000 | 0.000 | 100.0% | 20.0% |"
        ),
        "{md}"
    );
    assert!(md.contains("## Top functions: MainThread (tid 101, pid 100)"));
    assert!(
        md.contains("| 0.300 | 75.0% | 0.300 | a | /srv/lib.py |"),
        "{md}"
    );
    assert!(md.contains("| samples_lost | 3 |"));
    assert!(!md.contains("Truncated"));
}

#[test]
fn markdown_keeps_top_15_functions_per_thread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.esrec");
    let mut w = RecordingWriter::create(&path, &Meta::default()).unwrap();
    // 20 functions, function fN gets N+1 samples.
    for n in 0..20u64 {
        let s = w
            .intern_stack(&[frame(&format!("f{n}"), "/m.py", n as i32), main_f()])
            .unwrap();
        for i in 0..=n {
            w.sample(&sample(i, 1, 1, s, 0, MS)).unwrap();
        }
    }
    w.flush().unwrap();
    drop(w);
    let rec = read_recording(&path).unwrap();
    let md =
        String::from_utf8(views::report(&rec, &Selection::all(&rec), ReportFormat::Md).unwrap())
            .unwrap();
    let rows: Vec<&str> = md.lines().filter(|l| l.contains(" | /m.py |")).collect();
    assert_eq!(rows.len(), 15);
    assert!(rows[0].contains("| f19 |"));
    assert!(rows[14].contains("| f5 |"));
    // JSON keeps all of them (20 + main).
    let v: Value = serde_json::from_slice(
        &views::report(&rec, &Selection::all(&rec), ReportFormat::Json).unwrap(),
    )
    .unwrap();
    assert_eq!(v["functions"].as_array().unwrap().len(), 21);
    assert_eq!(v["truncated"], false);
    assert_eq!(v["recording"]["end_reason"], Value::Null);
}

// ---------------------------------------------------------------- truncated files

#[test]
fn cut_recordings_still_render() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("full.esrec");
    write_fixture(&path, false);
    let bytes = std::fs::read(&path).unwrap();
    let full = parse_recording(&bytes).unwrap();
    let mut rendered = 0;
    // Cut everywhere past the header (and a stride so the test stays fast).
    for cut in (40..bytes.len()).step_by(37).chain([bytes.len() - 1]) {
        let Ok(rec) = parse_recording(&bytes[..cut]) else {
            continue;
        };
        let sel = Selection::all(&rec);
        assert!(rec.samples.len() <= full.samples.len());
        for format in [
            ExportFormat::Folded,
            ExportFormat::Pprof,
            ExportFormat::Speedscope,
            ExportFormat::Chrome,
        ] {
            views::export(&rec, &sel, format).unwrap();
        }
        for format in [ReportFormat::Json, ReportFormat::Md] {
            views::report(&rec, &sel, format).unwrap();
        }
        match views::flame::render(&rec, &sel, false) {
            Ok(svg) => {
                assert!(!rec.samples.is_empty());
                assert!(String::from_utf8(svg)
                    .unwrap()
                    .contains("recording cut short"));
                rendered += 1;
            }
            Err(e) => {
                assert!(rec.samples.is_empty(), "{e:#}");
            }
        }
    }
    assert!(rendered > 50, "only {rendered} cuts rendered");
}

#[test]
fn cli_renders_a_cut_file() {
    let f = fixture();
    let bytes = std::fs::read(&f.path).unwrap();
    let cut = f.dir.join("cut.esrec");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let svg = f.dir.join("cut.svg");
    let out = cli(&["flame", cut.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("cut short"));
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("a (lib.py:20)"));

    let out = cli(&["report", cut.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["truncated"], true);
    let samples = v["totals"]["samples"].as_u64().unwrap();
    assert!(samples > 0 && samples < 479, "{samples}");
}

// ---------------------------------------------------------------- CLI

#[test]
fn cli_commands_write_their_formats() {
    let f = fixture();
    let file = f.path.to_str().unwrap();
    let out_path = |name: &str| f.dir.join(name).to_str().unwrap().to_string();

    let svg = out_path("f.svg");
    let o = cli(&[
        "flame",
        file,
        "-o",
        &svg,
        "--thread-name",
        "worker",
        "--offcpu",
    ]);
    assert!(!o.status.success(), "worker-1 has no off-CPU time");
    let o = cli(&["flame", file, "-o", &svg, "--thread-name", "worker"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("recurse (lib.py:40)") && !text.contains("a (lib.py:20)"));

    let folded = out_path("f.folded");
    assert!(
        cli(&["export", file, "--format", "folded", "-o", &folded, "--pid", "200"])
            .status
            .success()
    );
    assert_eq!(std::fs::read_to_string(&folded).unwrap().lines().count(), 3);

    let pb = out_path("f.pb.gz");
    assert!(cli(&["export", file, "--format", "pprof", "-o", &pb])
        .status
        .success());
    let p = views::pprof::decode(&std::fs::read(&pb).unwrap()).unwrap();
    assert_eq!(p.sample.iter().map(|s| s.value[0]).sum::<i64>(), 479);

    for format in ["speedscope", "chrome"] {
        let path = out_path(&format!("f.{format}.json"));
        let o = cli(&[
            "export", file, "--format", format, "-o", &path, "--tid", "101",
        ]);
        assert!(o.status.success());
        let _: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    }

    let o = cli(&["report", file]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("# enginescope report"));
    let json = out_path("r.json");
    assert!(cli(&["report", file, "--format", "json", "-o", &json])
        .status
        .success());
    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["totals"]["samples"], 479);

    // A filter that matches nothing names the threads there are.
    let o = cli(&["report", file, "--pid", "999"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no thread matches pid 999") && err.contains("worker-1"),
        "{err}"
    );
    // Not a recording.
    let o = cli(&["report", &svg]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not an enginescope recording"));
}
