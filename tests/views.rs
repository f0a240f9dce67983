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
    flags, read_recording, EndInfo, Frame, GcPause, GilWait, Meta, OffCpu, ProcessInfo, Recording,
    RecordingWriter, Sample, ThreadInfo,
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
            python_name: None,
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
        stolen: false,
    })
    .unwrap();
    w.offcpu(&OffCpu {
        pid: 100,
        tid: 101,
        start_ns: 460 * u64::from(MS),
        dur_ns: 25 * u64::from(MS),
        stack: s_wait,
        preempted: true,
        stolen: false,
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
        ..Default::default()
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
        serde_json::json!({"samples": 479, "cpu_s": 0.529, "python_s": 0.409, "native_s": 0.12, "offcpu_s": 0.075,
                           "offcpu_stolen_s": 0.0, "gil_held_s": 0.4, "gil_wait_s": 0.0, "gil_switch_wait_s": 0.0, "gc_s": 0.0})
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
            "pid": 100, "tid": 101, "name": "MainThread", "os_name": "MainThread",
            "cpu_s": 0.4, "samples": 400,
            "python_s": 0.3, "native_s": 0.1, "offcpu_s": 0.075, "offcpu_preempted_s": 0.025, "offcpu_stolen_s": 0.0,
            "gil_held_share": 0.75, "gc_share": 0.0, "gil_held_s": 0.3, "gil_wait_s": 0.0,
            "gil_waits": 0, "gil_switch_wait_s": 0.0, "gc_s": 0.0, "gc_pauses": 0,
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
            "| 100 | python3.12 | 101 | MainThread | 0.400 | 400 | 0.300 | 0.100 | 0.075 | 75.0% | 0.0% |"
        ),
        "{md}"
    );
    assert!(
        md.contains(
            "| 100 | python3.12 | 102 | worker-1 | 0.100 | 50 | 0.100 | 0.000 | 0.000 | 100.0% | 20.0% |"
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

// ---------------------------------------------------------------- GIL and GC
//
// A second fixture: pid 300 "python3.12", a launcher thread held up by a writer thread.
// - tid 301 "launcher": 100 samples of 1 ms in `Worker.execute_model` holding the GIL, then 20
//   NATIVE samples without it (t 0-120 ms). GIL waits (none a switch wait), starting at 200 ms
//   every 10 ms: 6 of 3 ms while aux-writer ran `_evict_to_fit` line 50, 4 of 3 ms at line 52,
//   2 of 4 ms while it ran `put`, 1 of 5 ms while MainThread ran `main`, 1 of 1 ms with the
//   GIL free (holder 0), 1 of 2 ms while aux-writer ran no Python frame: 46 ms in 15 waits.
//   Off CPU 200.01-202.99 ms (inside its first GIL wait). GC gen 1: [500, 510) and [520, 526).
// - tid 302 "aux-writer": 200 samples of 1 ms in `_evict_to_fit` holding the GIL. GIL waits
//   on the launcher (in execute_model): [600, 602), [628, 632), [700, 702) = 8 ms; one while it
//   held the GIL itself (releasing it) [720, 721); switch waits [800, 800.5) and [810, 810.5)
//   = 1 ms. GC: gen 0 at 400, 410, ..., 440 ms lasting 1..5 ms;
//   gen 2 [590, 630) (so the wait at 600 nests inside it and the one at 628 sticks out by
//   2 ms); generation unknown [900, 907).
// - tid 303 "MainThread": 10 samples of 1 ms in `main` holding the GIL.
// The recording lasts 1 s.

const GMS: u64 = 1_000_000;

fn evict(line: i32) -> Frame {
    frame("AuxOutputStore._evict_to_fit", "/srv/aux.py", line)
}
fn put() -> Frame {
    frame("AuxOutputStore.put", "/srv/aux.py", 20)
}
fn aux_run() -> Frame {
    frame("AuxOutputStore.run", "/srv/aux.py", 10)
}
fn execute_model() -> Frame {
    frame("Worker.execute_model", "/srv/worker.py", 30)
}
fn worker_loop() -> Frame {
    frame("Worker.loop", "/srv/worker.py", 5)
}

#[allow(clippy::too_many_arguments)]
fn gil_wait(
    tid: i32,
    start_ns: u64,
    dur_ns: u64,
    holder_tid: i32,
    holder_stack: u32,
    waiter_stack: u32,
    switch_wait: bool,
) -> GilWait {
    GilWait {
        pid: 300,
        tid,
        start_ns,
        dur_ns,
        holder_tid,
        holder_stack,
        waiter_stack,
        switch_wait,
    }
}

fn gc_pause(tid: i32, start_ns: u64, dur_ns: u64, generation: i8) -> GcPause {
    GcPause {
        collected: -1,
        pid: 300,
        tid,
        start_ns,
        dur_ns,
        generation,
    }
}

fn write_gil_fixture(path: &Path, finish: bool) {
    let mut w = RecordingWriter::create(
        path,
        &Meta {
            rate_hz: 1000,
            backend: "bpf".into(),
            ..Meta::default()
        },
    )
    .unwrap();
    w.process(&ProcessInfo {
        pid: 300,
        cmdline: "/usr/bin/python3.12 engine.py".into(),
        python_version: "3.12.1".into(),
        role: String::new(),
    })
    .unwrap();
    for (tid, name) in [(301, "launcher"), (302, "aux-writer"), (303, "MainThread")] {
        w.thread(&ThreadInfo {
            pid: 300,
            tid,
            name: name.into(),
            t_ns: 0,
            python_name: None,
        })
        .unwrap();
    }
    let s_exec = w.intern_stack(&[execute_model(), worker_loop()]).unwrap();
    let s_evict50 = w.intern_stack(&[evict(50), put(), aux_run()]).unwrap();
    let s_evict52 = w.intern_stack(&[evict(52), put(), aux_run()]).unwrap();
    let s_put = w.intern_stack(&[put(), aux_run()]).unwrap();
    let s_main = w.intern_stack(&[frame("main", "/srv/main.py", 1)]).unwrap();
    for i in 0..200u64 {
        let t = i * GMS;
        if i < 120 {
            let f = if i < 100 { flags::GIL } else { flags::NATIVE };
            w.sample(&sample(t, 300, 301, s_exec, f, MS)).unwrap();
        }
        w.sample(&sample(t, 300, 302, s_evict50, flags::GIL, MS))
            .unwrap();
        if i < 10 {
            w.sample(&sample(t, 300, 303, s_main, flags::GIL, MS))
                .unwrap();
        }
    }
    w.offcpu(&OffCpu {
        pid: 300,
        tid: 301,
        start_ns: 200 * GMS + 10_000,
        dur_ns: 2_980_000,
        stack: s_exec,
        preempted: false,
        stolen: false,
    })
    .unwrap();
    for i in 0..15u64 {
        let (holder, stack, dur) = match i {
            0..6 => (302, s_evict50, 3),
            6..10 => (302, s_evict52, 3),
            10..12 => (302, s_put, 4),
            12 => (303, s_main, 5),
            13 => (0, 0, 1),
            _ => (302, 0, 2),
        };
        w.gil_wait(&gil_wait(
            301,
            (200 + 10 * i) * GMS,
            dur * GMS,
            holder,
            stack,
            s_exec,
            false,
        ))
        .unwrap();
    }
    for g in 0..5u64 {
        w.gc_pause(&gc_pause(302, (400 + 10 * g) * GMS, (g + 1) * GMS, 0))
            .unwrap();
    }
    w.gc_pause(&gc_pause(301, 500 * GMS, 10 * GMS, 1)).unwrap();
    w.gc_pause(&gc_pause(301, 520 * GMS, 6 * GMS, 1)).unwrap();
    w.gc_pause(&gc_pause(302, 590 * GMS, 40 * GMS, 2)).unwrap();
    for (start, dur) in [(600, 2), (628, 4), (700, 2)] {
        w.gil_wait(&gil_wait(
            302,
            start * GMS,
            dur * GMS,
            301,
            s_exec,
            s_evict50,
            false,
        ))
        .unwrap();
    }
    w.gil_wait(&gil_wait(
        302,
        720 * GMS,
        GMS,
        302,
        s_evict50,
        s_evict50,
        false,
    ))
    .unwrap();
    for start in [800, 810] {
        w.gil_wait(&gil_wait(302, start * GMS, GMS / 2, 0, 0, s_put, true))
            .unwrap();
    }
    w.gc_pause(&gc_pause(302, 900 * GMS, 7 * GMS, -1)).unwrap();
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

fn gil_fixture() -> (tempfile::TempDir, Recording) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gil.esrec");
    write_gil_fixture(&path, true);
    let rec = read_recording(&path).unwrap();
    assert_eq!((rec.gil_waits.len(), rec.gc_pauses.len()), (21, 9));
    (dir, rec)
}

fn report_json(rec: &Recording, sel: &Selection) -> Value {
    serde_json::from_slice(&views::report(rec, sel, ReportFormat::Json).unwrap()).unwrap()
}

fn thread_row(v: &Value, tid: i64) -> &Value {
    v["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tid"] == tid)
        .unwrap_or_else(|| panic!("no thread {tid}"))
}

#[test]
fn report_gil_and_gc_per_thread() {
    let (_d, rec) = gil_fixture();
    let v = report_json(&rec, &Selection::all(&rec));
    let pick = |tid: i64| {
        let t = thread_row(&v, tid);
        [
            "gil_held_s",
            "gil_held_share",
            "gil_wait_s",
            "gil_waits",
            "gil_switch_wait_s",
            "gc_s",
            "gc_pauses",
        ]
        .map(|k| t[k].clone())
    };
    let j = |x: f64| Value::from(x);
    assert_eq!(
        pick(301),
        [
            j(0.1),
            j(100.0 / 120.0),
            j(0.046),
            15.into(),
            j(0.0),
            j(0.016),
            2.into()
        ]
    );
    assert_eq!(
        pick(302),
        [
            j(0.2),
            j(1.0),
            j(0.009),
            4.into(),
            j(0.001),
            j(0.062),
            7.into()
        ]
    );
    assert_eq!(
        pick(303),
        [j(0.01), j(1.0), j(0.0), 0.into(), j(0.0), j(0.0), 0.into()]
    );
    let t = &v["totals"];
    assert_eq!(
        [
            &t["gil_held_s"],
            &t["gil_wait_s"],
            &t["gil_switch_wait_s"],
            &t["gc_s"]
        ],
        [&j(0.31), &j(0.055), &j(0.001), &j(0.078)]
    );
}

#[test]
fn report_gil_blocking_rows_in_order() {
    let (_d, rec) = gil_fixture();
    let v = report_json(&rec, &Selection::all(&rec));
    let rows: Vec<(i64, i64, String, String, f64, u64, String)> = v["gil_blocking"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["waiter_tid"].as_i64().unwrap(),
                r["holder_tid"].as_i64().unwrap(),
                r["holder_name"].as_str().unwrap().to_string(),
                r["holder_function"].as_str().unwrap().to_string(),
                r["wait_s"].as_f64().unwrap(),
                r["waits"].as_u64().unwrap(),
                r["holder_file"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let r = |w: i64, h: i64, hn: &str, f: &str, s: f64, n: u64, file: &str| {
        (w, h, hn.to_string(), f.to_string(), s, n, file.to_string())
    };
    assert_eq!(
        rows,
        [
            // Lines 50 and 52 of _evict_to_fit merge: one function.
            r(
                301,
                302,
                "aux-writer",
                "AuxOutputStore._evict_to_fit",
                0.03,
                10,
                "/srv/aux.py"
            ),
            r(
                301,
                302,
                "aux-writer",
                "AuxOutputStore.put",
                0.008,
                2,
                "/srv/aux.py"
            ),
            r(
                302,
                301,
                "launcher",
                "Worker.execute_model",
                0.008,
                3,
                "/srv/worker.py"
            ),
            r(301, 303, "MainThread", "main", 0.005, 1, "/srv/main.py"),
            r(301, 302, "aux-writer", "<unknown>", 0.002, 1, ""),
            r(301, 0, "", "<gil free>", 0.001, 1, ""),
            // Held by itself: it was releasing the GIL.
            r(302, 302, "aux-writer", "<releasing>", 0.001, 1, ""),
        ]
    );
    assert_eq!(v["gil_blocking"][0]["waiter_name"], "launcher");
    assert_eq!(v["gil_blocking"][0]["waiter_pid"], 300);

    let pairs = v["gil_blocking_pairs"].as_array().unwrap();
    let shape: Vec<(i64, i64, f64, u64, f64)> = pairs
        .iter()
        .map(|p| {
            (
                p["waiter_tid"].as_i64().unwrap(),
                p["holder_tid"].as_i64().unwrap(),
                p["wait_s"].as_f64().unwrap(),
                p["waits"].as_u64().unwrap(),
                p["share_of_wait"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (301, 302, 0.04, 13, 40.0 / 46.0),
            (302, 301, 0.008, 3, 8.0 / 9.0),
            (301, 303, 0.005, 1, 5.0 / 46.0),
            (301, 0, 0.001, 1, 1.0 / 46.0),
            (302, 302, 0.001, 1, 1.0 / 9.0),
        ]
    );
    assert_eq!(
        pairs[0]["holder_top"],
        serde_json::json!([
            {"function": "AuxOutputStore._evict_to_fit", "file": "/srv/aux.py", "wait_s": 0.03, "waits": 10},
            {"function": "AuxOutputStore.put", "file": "/srv/aux.py", "wait_s": 0.008, "waits": 2},
            {"function": "<unknown>", "file": "", "wait_s": 0.002, "waits": 1},
        ])
    );
    assert_eq!(pairs[3]["holder_name"], "");

    // Only the selected waiters' waits count; holders need not be selected.
    let v = report_json(&rec, &select(&rec, None, None, Some("^aux")));
    assert_eq!(v["gil_blocking"].as_array().unwrap().len(), 2);
    assert_eq!(v["gil_blocking"][0]["holder_name"], "launcher");
    assert_eq!(v["gil_blocking_pairs"][0]["share_of_wait"], 8.0 / 9.0);
}

#[test]
fn report_gc_by_generation() {
    let (_d, rec) = gil_fixture();
    let v = report_json(&rec, &Selection::all(&rec));
    // The fixture's pauses carry no collected counts (-1, unknown), which must not be summed.
    let g = |pauses: u64, total_s: f64, max_ms: f64| serde_json::json!({"pauses": pauses, "collected": 0, "total_s": total_s, "max_ms": max_ms, "share": total_s});
    assert_eq!(
        v["gc"]["by_generation"],
        serde_json::json!({
            "0": g(5, 0.015, 5.0),
            "1": g(2, 0.016, 10.0),
            "2": g(1, 0.04, 40.0),
            "unknown": g(1, 0.007, 7.0),
        })
    );
    assert_eq!(
        (
            &v["gc"]["pauses"],
            &v["gc"]["total_s"],
            &v["gc"]["max_ms"],
            &v["gc"]["share"]
        ),
        (&9.into(), &0.078.into(), &40.0.into(), &0.078.into())
    );
    let by_thread: Vec<(i64, &str, u64, f64)> = v["gc"]["by_thread"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["tid"].as_i64().unwrap(),
                t["name"].as_str().unwrap(),
                t["pauses"].as_u64().unwrap(),
                t["total_s"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        by_thread,
        [(302, "aux-writer", 7, 0.062), (301, "launcher", 2, 0.016)]
    );

    // The numbered generations are always there; "unknown" only when it occurs.
    let v = report_json(&rec, &select(&rec, None, Some(301), None));
    assert_eq!(
        v["gc"]["by_generation"],
        serde_json::json!({"0": g(0, 0.0, 0.0), "1": g(2, 0.016, 10.0), "2": g(0, 0.0, 0.0)})
    );
    // No GC at all (the first fixture): zeros, and no GC or GIL-wait Markdown section.
    let f = fixture();
    let v = report_json(&f.rec, &Selection::all(&f.rec));
    assert_eq!(v["gc"]["pauses"], 0);
    assert_eq!(v["gc"]["by_generation"]["2"], g(0, 0.0, 0.0));
    assert_eq!(v["gil_blocking"], serde_json::json!([]));
}

#[test]
fn report_markdown_gil_and_gc_sections() {
    let (_d, rec) = gil_fixture();
    let md =
        String::from_utf8(views::report(&rec, &Selection::all(&rec), ReportFormat::Md).unwrap())
            .unwrap();
    let gil = md.find("\n## GIL\n").expect("GIL section");
    let gc = md.find("\n## GC\n").expect("GC section");
    let top = md.find("\n## Top functions").unwrap();
    assert!(gil < gc && gc < top, "{md}");
    for line in [
        // Most GIL wait first.
        "| 300 | 301 | launcher | 0.120 | 0.100 | 83.3% | 0.046 | 15 | 4.6% | 0.000 |",
        "| 300 | 302 | aux-writer | 0.200 | 0.200 | 100.0% | 0.009 | 4 | 0.9% | 0.001 |",
        "| aux-writer (tid 302) | itself, \\<releasing\\> | 0.001 | 1 | 11.1% | \\<releasing\\> 0.001 s |",
        "| launcher (tid 301) | aux-writer (tid 302) | 0.040 | 13 | 87.0% | AuxOutputStore._evict_to_fit (aux.py) 0.030 s; AuxOutputStore.put (aux.py) 0.008 s; \\<unknown\\> 0.002 s |",
        "| launcher (tid 301) | \\<gil free\\> | 0.001 | 1 | 2.2% | \\<gil free\\> 0.001 s |",
        "| 0 | 5 | 0.015 | 3.000 | 5.000 | 1.50% |",
        "| 2 | 1 | 0.040 | 40.000 | 40.000 | 4.00% |",
        "| unknown | 1 | 0.007 | 7.000 | 7.000 | 0.70% |",
        "| all | 9 | 0.078 | 8.667 | 40.000 | 7.80% |",
        "| 300 | 302 | aux-writer | 7 | 0.062 | 40.000 |",
    ] {
        assert!(md.contains(line), "missing {line:?} in\n{md}");
    }
    let launcher = md.find("| 300 | 301 | launcher | 0.120 | 0.100").unwrap();
    let writer = md.find("| 300 | 302 | aux-writer | 0.200 | 0.200").unwrap();
    assert!(launcher < writer);

    // The first fixture has GIL flags but no waits and no GC.
    let f = fixture();
    let md = String::from_utf8(
        views::report(&f.rec, &Selection::all(&f.rec), ReportFormat::Md).unwrap(),
    )
    .unwrap();
    assert!(md.contains("No GIL waits in this recording"), "{md}");
    assert!(!md.contains("## GC"), "{md}");
}

/// `(ts, end)` in ns as Perfetto reads them (µs * 1000, rounded).
fn span_ns(e: &Value) -> (i64, i64) {
    let ts = (e["ts"].as_f64().unwrap() * 1000.0).round() as i64;
    let dur = (e["dur"].as_f64().unwrap() * 1000.0).round() as i64;
    (ts, ts + dur)
}

#[test]
fn chrome_gil_and_gc_tracks_nest() {
    let (_d, rec) = gil_fixture();
    let bytes = views::export(&rec, &Selection::all(&rec), ExportFormat::Chrome).unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let meta = |name: &str, tid: i64| {
        events
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == name && e["tid"] == tid)
            .map(|e| e["args"].clone())
    };
    let track = |tid: i64| tid + 1_000_000_000;
    assert_eq!(
        meta("thread_name", track(302)).unwrap()["name"],
        "aux-writer GIL/GC"
    );
    assert_eq!(
        meta("thread_name", track(301)).unwrap()["name"],
        "launcher GIL/GC"
    );
    assert!(
        meta("thread_name", track(303)).is_none(),
        "no GIL/GC events"
    );
    // Each GIL/GC track sorts right after its thread.
    let sort = |tid| meta("thread_sort_index", tid).unwrap()["sort_index"].clone();
    assert_eq!((sort(301), sort(track(301))), (0.into(), 1.into()));
    assert_eq!((sort(302), sort(track(302))), (2.into(), 3.into()));

    // Nothing GIL/GC on the threads' own tracks.
    assert!(events
        .iter()
        .filter(|e| e["cat"] == "gc" || e["cat"] == "gil-wait" || e["cat"] == "gil-switch-wait")
        .all(|e| e["tid"].as_i64().unwrap() > 1_000_000_000));

    let on = |tid: i64| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == tid)
            .collect()
    };
    // The launcher: 15 GIL waits then two gen-1 collections.
    let l = on(track(301));
    assert_eq!(l.len(), 17);
    assert_eq!(
        l[0]["name"],
        "GIL wait (held by aux-writer: AuxOutputStore._evict_to_fit)"
    );
    assert_eq!(l[0]["cat"], "gil-wait");
    assert_eq!(span_ns(l[0]), (200_000_000, 203_000_000));
    assert_eq!(l[0]["args"]["holder_tid"], 302);
    assert_eq!(l[0]["args"]["holder_name"], "aux-writer");
    assert_eq!(
        l[0]["args"]["holder_stack"],
        serde_json::json!([
            "AuxOutputStore.run (aux.py:10)",
            "AuxOutputStore.put (aux.py:20)",
            "AuxOutputStore._evict_to_fit (aux.py:50)"
        ])
    );
    assert_eq!(
        l[0]["args"]["waiter_stack"],
        serde_json::json!([
            "Worker.loop (worker.py:5)",
            "Worker.execute_model (worker.py:30)"
        ])
    );
    assert_eq!(
        l[10]["name"],
        "GIL wait (held by aux-writer: AuxOutputStore.put)"
    );
    assert_eq!(l[12]["name"], "GIL wait (held by MainThread: main)");
    assert_eq!(l[13]["name"], "GIL wait (<gil free>)");
    assert_eq!(l[14]["name"], "GIL wait (held by aux-writer: <unknown>)");
    assert_eq!(
        (
            l[15]["name"].as_str(),
            l[15]["cat"].as_str(),
            span_ns(l[15])
        ),
        (Some("GC gen 1"), Some("gc"), (500_000_000, 510_000_000))
    );
    // Its off-CPU interval stays on its own track, inside the first GIL wait's time.
    let off: Vec<&Value> = on(301)
        .into_iter()
        .filter(|e| e["cat"] == "off-cpu")
        .collect();
    assert_eq!(off.len(), 1);
    assert_eq!(span_ns(off[0]), (200_010_000, 202_990_000));

    // The writer: gen 0 x5, gen 2 with two waits inside (the second clipped), a wait, two
    // switch waits, and a collection of unknown generation.
    let w = on(track(302));
    let shape: Vec<(&str, &str, (i64, i64))> = w
        .iter()
        .map(|e| {
            (
                e["cat"].as_str().unwrap(),
                e["name"].as_str().unwrap(),
                span_ns(e),
            )
        })
        .collect();
    let held = "GIL wait (held by launcher: Worker.execute_model)";
    let ms = |a: i64, b: i64| (a * 1_000_000, b * 1_000_000);
    assert_eq!(
        shape,
        [
            ("gc", "GC gen 0", ms(400, 401)),
            ("gc", "GC gen 0", ms(410, 412)),
            ("gc", "GC gen 0", ms(420, 423)),
            ("gc", "GC gen 0", ms(430, 434)),
            ("gc", "GC gen 0", ms(440, 445)),
            ("gc", "GC gen 2", ms(590, 630)),
            ("gil-wait", held, ms(600, 602)),
            ("gil-wait", held, ms(628, 630)),
            ("gil-wait", held, ms(700, 702)),
            ("gil-wait", "GIL wait (<releasing>)", ms(720, 721)),
            (
                "gil-switch-wait",
                "GIL switch wait",
                (800_000_000, 800_500_000)
            ),
            (
                "gil-switch-wait",
                "GIL switch wait",
                (810_000_000, 810_500_000)
            ),
            ("gc", "GC gen ?", ms(900, 907)),
        ]
    );
    assert_eq!(w[7]["args"]["clipped_ns"], 2_000_000);
    assert_eq!(w[7]["args"]["dur_ns"], 4_000_000);
    assert!(w[6]["args"].get("clipped_ns").is_none());
    assert_eq!(w[5]["args"]["generation"], 2);
    assert_eq!(w[9]["args"]["holder_tid"], 302);
    assert_eq!(w[12]["args"]["generation"], -1);

    // Every track nests: an event either ends before the next starts, or contains it.
    let mut tracks: BTreeMap<(i64, i64), Vec<(i64, i64)>> = BTreeMap::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        tracks
            .entry((e["pid"].as_i64().unwrap(), e["tid"].as_i64().unwrap()))
            .or_default()
            .push(span_ns(e));
    }
    assert_eq!(tracks.len(), 5);
    for (key, mut spans) in tracks {
        spans.sort_by_key(|&(s, e)| (s, -e));
        let mut open: Vec<i64> = Vec::new();
        for (s, e) in spans {
            while open.last().is_some_and(|&end| end <= s) {
                open.pop();
            }
            if let Some(&outer) = open.last() {
                assert!(
                    e <= outer,
                    "{key:?}: [{s}, {e}) sticks out of one ending {outer}"
                );
                // The threads' own tracks do not even nest: they never overlap.
                assert!(key.1 > 1_000_000_000, "{key:?}: overlap at {s}");
            }
            open.push(e);
        }
    }
}

#[test]
fn gil_blame_folds_holder_stacks_by_waiter() {
    let (_d, rec) = gil_fixture();
    let stacks = views::folded::gil_blame_stacks(&rec, &Selection::all(&rec));
    let p = "python3.12 (pid 300)";
    let evict = "AuxOutputStore.run (aux.py:10);AuxOutputStore.put (aux.py:20);AuxOutputStore._evict_to_fit";
    let expected: BTreeMap<String, u64> = [
        (format!("{p};launcher (tid 301);held by aux-writer (tid 302);{evict} (aux.py:50)"), 18 * GMS),
        (format!("{p};launcher (tid 301);held by aux-writer (tid 302);{evict} (aux.py:52)"), 12 * GMS),
        (format!("{p};launcher (tid 301);held by aux-writer (tid 302);AuxOutputStore.run (aux.py:10);AuxOutputStore.put (aux.py:20)"), 8 * GMS),
        (format!("{p};launcher (tid 301);held by aux-writer (tid 302);<unknown>"), 2 * GMS),
        (format!("{p};launcher (tid 301);held by MainThread (tid 303);main (main.py:1)"), 5 * GMS),
        (format!("{p};launcher (tid 301);<gil free>"), GMS),
        // Switch waits are not blamed on anyone.
        (format!("{p};aux-writer (tid 302);held by launcher (tid 301);Worker.loop (worker.py:5);Worker.execute_model (worker.py:30)"), 8 * GMS),
        (format!("{p};aux-writer (tid 302);<releasing>"), GMS),
    ]
    .into_iter()
    .collect();
    assert_eq!(stacks, expected);

    let svg = String::from_utf8(
        views::flame::render_kind(
            &rec,
            &Selection::all(&rec),
            views::flame::FlameKind::GilBlame,
        )
        .unwrap(),
    )
    .unwrap();
    for s in [
        "GIL blame",
        "19 GIL waits",
        "0.055 s waited for the GIL",
        // 40 of the 55 ms waited.
        "held by aux-writer (tid 302) (40,000 µs, 72.73%)",
        "AuxOutputStore._evict_to_fit (aux.py:50) (18,000 µs, 32.73%)",
        "&lt;gil free&gt; (1,000 µs, 1.82%)",
        "&lt;releasing&gt; (1,000 µs, 1.82%)",
    ] {
        assert!(svg.contains(s), "GIL-blame graph lacks {s:?}");
    }
    // Filtered to the writer, only its 8 ms on the launcher and 1 ms releasing.
    let one = views::folded::gil_blame_stacks(&rec, &select(&rec, None, Some(302), None));
    assert_eq!(one.values().copied().collect::<Vec<_>>(), [GMS, 8 * GMS]);
    // MainThread waited for nothing: a clear error.
    let e = views::flame::render_kind(
        &rec,
        &select(&rec, None, Some(303), None),
        views::flame::FlameKind::GilBlame,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("nothing to draw: 0 GIL waits"),
        "{e}"
    );
    let f = fixture();
    let e = views::flame::render_kind(
        &f.rec,
        &Selection::all(&f.rec),
        views::flame::FlameKind::GilBlame,
    )
    .unwrap_err();
    assert!(e.to_string().contains("no GIL wait records"), "{e}");
}

#[test]
fn cut_gil_recordings_still_render() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gil.esrec");
    write_gil_fixture(&path, false);
    let bytes = std::fs::read(&path).unwrap();
    let mut with_waits = 0;
    for cut in (40..bytes.len()).step_by(11).chain([bytes.len() - 1]) {
        let Ok(rec) = parse_recording(&bytes[..cut]) else {
            continue;
        };
        let sel = Selection::all(&rec);
        views::export(&rec, &sel, ExportFormat::Chrome).unwrap();
        let v = report_json(&rec, &sel);
        let waited: f64 = v["threads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["gil_wait_s"].as_f64().unwrap())
            .sum();
        let rows: f64 = v["gil_blocking"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["wait_s"].as_f64().unwrap())
            .sum();
        assert!((waited - rows).abs() < 1e-12, "{waited} != {rows}");
        views::report(&rec, &sel, ReportFormat::Md).unwrap();
        match views::flame::render_kind(&rec, &sel, views::flame::FlameKind::GilBlame) {
            Ok(_) => with_waits += 1,
            Err(e) => assert!(
                rec.gil_waits.iter().all(|g| g.switch_wait || g.dur_ns == 0),
                "{e:#}"
            ),
        }
    }
    assert!(with_waits > 20, "only {with_waits} cuts had GIL waits");
}
