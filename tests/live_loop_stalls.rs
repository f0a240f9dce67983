//! Event-loop stalls of a plain asyncio server recorded with `record --pid` (no vLLM, no role):
//! `samples/asyncio_stalls.py` runs request-handler tasks that stall the loop with `json.dumps`
//! of large responses (150-400 ms of CPU each) and times every busy stretch of its own loop
//! (its selector reads the clock around each wait). `report --from/--to` over its window must
//! list the process in `api_server_stalls.servers` with its main thread as the loop thread and
//! match every true stall longer than 150 ms to exactly one reported stall, start and duration
//! within ±10% or ±2 sampling periods, and name the asyncio task that ran in each (task name,
//! coroutine, await chain) as the workload's own record does (`asyncio.current_task()` and the
//! coroutine frames, read inside the render). While it records, after the window, the workload
//! holds its loop in one more task (`dump-probe`): `dump` (text and `--json`) must show the main
//! thread running that task and its chain.

mod common;

use common::*;
use serde_json::Value;

const MUST_REPORT_NS: u64 = 150_000_000;

fn check(label: &str) {
    let i = interp(label);
    if !available(&i) {
        return;
    }
    check_interp(&i, false);
}

/// `uvloop`: the workload runs on uvloop's loop (`--uvloop`), whose poll it cannot time: the
/// truth is each render (`json.dumps`, timed around the call), which lies inside its stall, so
/// each long render must fall in exactly one reported stall at least 90% as long, named by the
/// render's task.
fn check_interp(i: &Interp, uvloop: bool) {
    let label = i.label.as_str();
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let mut args = vec![
        "--truth",
        "{dir}/truth.json",
        "--requests",
        "10",
        "--go-fifo",
        "{dir}/go",
        "--hold-fifo",
        "{dir}/held",
        "--release",
        "{dir}/release",
    ];
    if uvloop {
        args.push("--uvloop");
    }
    let w = start(i, "asyncio_stalls.py", &args);
    let held = w.dir.join("held");
    let c = std::ffi::CString::new(held.to_string_lossy().as_bytes()).unwrap();
    assert_eq!(
        // SAFETY: mkfifo(3) on a NUL-terminated path we own.
        unsafe { libc::mkfifo(c.as_ptr(), 0o666) },
        0,
        "mkfifo {held:?}"
    );
    let out = w.dir.join("run.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let pid = w.pid.to_string();
    let rec = Recorder::start(&[
        "--rate",
        "999",
        "--duration",
        "300",
        "--pid",
        &pid,
        "-o",
        &out_s,
    ]);
    w.go();
    // The workload opens the FIFO for writing once its window is over and its loop runs
    // `dump-probe`, which keeps it busy until `release` exists.
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(std::fs::File::open(&held).unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "HOLDING", "{label}");
    let dump_json = enginescope(&["dump", "--pid", &pid, "--json"]);
    let dump_text = enginescope(&["dump", "--pid", &pid]);
    std::fs::write(w.dir.join("release"), b"").unwrap();
    let (ok, _, err) = rec.wait();
    assert!(ok, "{label}: record failed: {err}");
    let truth = read_json(&w.dir.join("truth.json"));
    // dump: the main thread runs the hold task, awaiting the chain the workload recorded.
    let hold = &truth["hold"];
    let want_chain: Vec<&str> = hold["chain"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(
        dump_json.status.success(),
        "{label}: dump --json: {}",
        String::from_utf8_lossy(&dump_json.stderr)
    );
    let d: Value = serde_json::from_slice(&dump_json.stdout).unwrap();
    let main = d["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tid"].as_i64() == Some(i64::from(w.pid)))
        .unwrap_or_else(|| panic!("{label}: the main thread in dump --json: {d}"));
    let task = &main["asyncio_task"];
    assert_eq!(task["name"], hold["task"], "{label}: dump's task: {main}");
    assert_eq!(
        task["coro"], hold["coro"],
        "{label}: dump's coroutine: {main}"
    );
    let got_chain: Vec<&str> = task["chain"]
        .as_array()
        .unwrap_or_else(|| panic!("{label}: a chain in {main}"))
        .iter()
        .filter_map(|c| c.as_str())
        .collect();
    assert_eq!(got_chain, want_chain, "{label}: dump's await chain");
    let text = String::from_utf8_lossy(&dump_text.stdout);
    let want_line = format!(
        "asyncio task \"{}\" ({}), awaiting: {}",
        hold["task"].as_str().unwrap(),
        hold["coro"].as_str().unwrap(),
        want_chain.join(" -> ")
    );
    assert!(
        text.contains(&want_line),
        "{label}: dump's text shows {want_line:?}:\n{text}"
    );
    let r = enginescope::record::read_recording(&out).unwrap();
    // The failure paths of off-CPU pairing and thread tracking (shown with --nocapture).
    eprintln!(
        "{label}: {:?}",
        r.counters
            .iter()
            .filter(|(k, _)| k.starts_with("offcpu_")
                || k.starts_with("thread")
                || k.starts_with("events_unparsed")
                || k.contains("lost"))
            .collect::<Vec<_>>()
    );
    let base = r.meta.start_mono_ns;
    let w0 = truth["window"]["start_mono_ns"].as_u64().unwrap();
    let w1 = truth["window"]["end_mono_ns"].as_u64().unwrap();
    assert!(
        w0 > base,
        "{label}: the recording started before the window"
    );
    let from = format!("{:.9}", (w0 - base) as f64 / 1e9);
    let to = format!("{:.9}", (w1 - base) as f64 / 1e9);
    let o = enginescope(&[
        "report", &out_s, "--format", "json", "--from", &from, "--to", &to,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rep: Value = serde_json::from_slice(&o.stdout).unwrap();
    let st = &rep["api_server_stalls"];
    let server = st["servers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["pid"].as_i64() == Some(i64::from(w.pid)))
        .unwrap_or_else(|| panic!("{label}: the asyncio process is in servers: {st}"));
    assert_eq!(server["main_tid"].as_i64(), Some(i64::from(w.pid)));
    let period = 1_000_000_000 / u64::from(r.meta.rate_hz);
    let reported_stalls: Vec<&Value> = st["stalls"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["pid"].as_i64() == Some(i64::from(w.pid)))
        .collect();
    let reported: Vec<(u64, u64)> = reported_stalls
        .iter()
        .map(|s| {
            (
                w0 + (s["start_s"].as_f64().unwrap() * 1e9) as u64,
                (s["duration_ms"].as_f64().unwrap() * 1e6) as u64,
            )
        })
        .collect();
    let long_truth: Vec<&Value> = truth[if uvloop { "renders" } else { "stalls" }]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["dur_ns"].as_u64().unwrap() >= MUST_REPORT_NS)
        .collect();
    let long: Vec<(u64, u64)> = long_truth
        .iter()
        .map(|s| {
            (
                s["start_mono_ns"].as_u64().unwrap(),
                s["dur_ns"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(
        long.len() >= 8,
        "{label}: at least 8 of the 10 requests stalled the loop over 150 ms: {long:?}"
    );
    let mut named = 0;
    for (k, &(a, d)) in long.iter().enumerate() {
        let idx: Vec<usize> = (0..reported.len())
            .filter(|&i| reported[i].0 < a + d && a < reported[i].0 + reported[i].1)
            .collect();
        let m: Vec<&(u64, u64)> = idx.iter().map(|&i| &reported[i]).collect();
        let tol = (d / 10).max(2 * period);
        // uvloop: the loop's own time between callbacks is C, so a stall's start is only as
        // exact as the samples; its duration must still cover the true one.
        let ok = m.len() == 1
            && if uvloop {
                m[0].1 >= d - d / 10
            } else {
                m[0].0.abs_diff(a) <= tol && m[0].1.abs_diff(d) <= tol
            };
        assert!(
            ok,
            "{label}: true stall +{:.3} s {:.1} ms matches one reported within {:.1} ms: {:?}\n{}",
            (a - w0) as f64 / 1e9,
            d as f64 / 1e6,
            tol as f64 / 1e6,
            m.iter()
                .map(|&&(x, y)| format!(
                    "+{:.3} s {:.1} ms",
                    (x as f64 - w0 as f64) / 1e9,
                    y as f64 / 1e6
                ))
                .collect::<Vec<_>>(),
            diagnose(label, &r, &w.dir, w.pid, &truth, (a, d), &m)
        );
        // The task that ran: name, coroutine and await chain as the workload recorded them.
        let t = &long_truth[k];
        let got = &reported_stalls[idx[0]]["task"];
        assert!(
            !t["task"].as_str().unwrap_or("").is_empty(),
            "{label}: the workload names the task of its stall at +{:.3} s: {t}",
            (a - w0) as f64 / 1e9
        );
        // What the recorder read around the stall (ms from its start), for a failure.
        let near: Vec<String> = r
            .task_changes
            .iter()
            .filter(|c| {
                c.pid == w.pid
                    && c.t_ns + 1_000_000_000 > a - base
                    && c.t_ns < a - base + d + 1_000_000_000
            })
            .map(|c| {
                format!(
                    "{:+.1} {} (prev seen {:?})",
                    (c.t_ns as f64 - (a - base) as f64) / 1e6,
                    c.task.as_ref().map_or("-", |k| k.name.as_str()),
                    c.prev_seen_ns.map(|p| (p as f64 - (a - base) as f64) / 1e6)
                )
            })
            .collect();
        assert_eq!(
            (&got["name"], &got["coro"], &got["chain"]),
            (&t["task"], &t["coro"], &t["chain"]),
            "{label}: the task of the stall at +{:.3} s ({:.1} ms): reported {got}, true {t}; task reads around it (ms from its start): {near:?}",
            (a - w0) as f64 / 1e9,
            d as f64 / 1e6
        );
        named += 1;
    }
    // The markdown report's stall table names the same tasks (each row of this process).
    let o = enginescope(&["report", &out_s, "--from", &from, "--to", &to]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = String::from_utf8_lossy(&o.stdout);
    assert!(
        md.contains("asyncio task (await chain)"),
        "{label}: the markdown stall table has the task column:\n{md}"
    );
    for t in &long_truth {
        let chain: Vec<&str> = t["chain"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c.as_str())
            .collect();
        let cell = format!("{} ({})", t["task"].as_str().unwrap(), chain.join(" → "));
        assert!(
            md.contains(&cell),
            "{label}: markdown names {cell:?}:\n{md}"
        );
    }
    eprintln!(
        "{label}: {} true stalls over 150 ms, {} reported, all matched, {named} named by their task; dump: {want_line}; task reads: {} in {} µs, {} errors",
        long.len(),
        reported.len(),
        r.counters.get("asyncio_task_reads").copied().unwrap_or(0),
        r.counters.get("asyncio_task_read_us").copied().unwrap_or(0),
        r.counters.get("asyncio_task_read_errors").copied().unwrap_or(0),
    );
}

#[test]
fn asyncio_server_stalls_pyenv_310() {
    check("pyenv-3.10");
}

#[test]
fn asyncio_server_stalls_pyenv_312() {
    check("pyenv-3.12");
}

/// vLLM's API server runs on uvloop: the vLLM venv's Python 3.11 with its uvloop (0.23).
#[test]
fn uvloop_server_stalls_vllm_venv_311() {
    let exe = std::path::PathBuf::from("/opt/vllm-cpu-venv/bin/python");
    if !exe.exists() {
        eprintln!("SKIP uvloop: no /opt/vllm-cpu-venv (the vLLM harness installs it)");
        return;
    }
    check_interp(
        &Interp {
            label: "vllm-venv-3.11-uvloop".into(),
            launch: Launch::Host(exe),
        },
        true,
    );
}

#[test]
fn asyncio_server_stalls_pyenv_311() {
    check("pyenv-3.11");
}

#[test]
fn asyncio_server_stalls_pyenv_313() {
    check("pyenv-3.13");
}

#[test]
fn asyncio_server_stalls_sid_313() {
    check("sid-3.13");
}

#[test]
fn asyncio_server_stalls_sid_314() {
    check("sid-3.14");
}

/// What a failed match needs to be root-caused: the recording and the truth kept (the
/// workload's directory is removed), the recorder's backend and loss counters, the loop
/// thread's records (one written mid-recording means it was lost and found again), and its
/// timeline from 100 ms before to 100 ms after the true and reported stalls: runs of samples by
/// innermost frame, off-CPU intervals (blocked or preempted, innermost frame) and GIL waits.
fn diagnose(
    label: &str,
    r: &enginescope::record::Recording,
    dir: &std::path::Path,
    pid: i32,
    truth: &Value,
    (a, d): (u64, u64),
    reported: &[&(u64, u64)],
) -> String {
    use std::fmt::Write;
    let keep = std::env::temp_dir().join(format!("enginescope-loop-stalls-{label}-{pid}"));
    let kept = std::fs::create_dir_all(&keep).is_ok()
        && std::fs::copy(dir.join("run.esrec"), keep.join("run.esrec")).is_ok()
        && std::fs::copy(dir.join("truth.json"), keep.join("truth.json")).is_ok();
    let base = r.meta.start_mono_ns;
    let from = reported
        .iter()
        .map(|x| x.0)
        .chain([a])
        .min()
        .unwrap_or(a)
        .saturating_sub(100_000_000);
    let to = reported
        .iter()
        .map(|x| x.0 + x.1)
        .chain([a + d])
        .max()
        .unwrap_or(a + d)
        + 100_000_000;
    let rel = |t: u64| (t as f64 - (from as f64 - base as f64)) / 1e6;
    let inside = |t: u64| t + base >= from && t + base < to;
    let leaf = |stack: u32| {
        r.stack_frames(stack)
            .next()
            .map_or("(no Python frame)".to_string(), |f| {
                format!(
                    "{} ({})",
                    f.function,
                    f.file.rsplit('/').next().unwrap_or("")
                )
            })
    };
    let mut o = String::new();
    let _ = writeln!(
        o,
        "recording {} (truth {}), backend {} at {} Hz; counters {:?}",
        if kept {
            keep.display().to_string()
        } else {
            "not kept".into()
        },
        truth["python"].as_str().unwrap_or("?"),
        r.meta.backend,
        r.meta.rate_hz,
        r.counters
            .iter()
            .filter(|(k, v)| **v > 0
                && (k.contains("lost")
                    || k.contains("skipped")
                    || k.contains("no_tstate")
                    || k.contains("error")))
            .collect::<Vec<_>>()
    );
    for t in r.threads.iter().filter(|t| t.pid == pid) {
        let _ = writeln!(
            o,
            "thread {} {:?} {:?} at {:.3} s",
            t.tid,
            t.name,
            t.python_name,
            t.t_ns as f64 / 1e9
        );
    }
    let _ = writeln!(
        o,
        "loop thread from +0 = {:.3} s of the recording (ms):",
        (from - base) as f64 / 1e9
    );
    let mut ev: Vec<(u64, String)> = Vec::new();
    let mut run: Option<(u64, u64, u32, usize)> = None;
    let mut samples: Vec<&enginescope::record::Sample> = r
        .samples
        .iter()
        .filter(|s| s.pid == pid && s.tid == pid && inside(s.t_ns))
        .collect();
    samples.sort_by_key(|s| s.t_ns);
    let flush = |ev: &mut Vec<(u64, String)>, run: Option<(u64, u64, u32, usize)>| {
        if let Some((t0, t1, st, n)) = run {
            ev.push((
                t0,
                format!("{:9.1}-{:.1} {n} samples in {}", rel(t0), rel(t1), leaf(st)),
            ));
        }
    };
    for s in samples {
        let leaf_now = leaf(s.stack);
        match run {
            Some((t0, _, st, n)) if leaf(st) == leaf_now => run = Some((t0, s.t_ns, st, n + 1)),
            _ => {
                flush(&mut ev, run);
                run = Some((s.t_ns, s.t_ns, s.stack, 1));
            }
        }
    }
    flush(&mut ev, run);
    // Short preemptions (a loaded machine has hundreds) are summed, not listed.
    let (mut short_n, mut short_ns) = (0u64, 0u64);
    for x in r.offcpu.iter().filter(|x| x.pid == pid && x.tid == pid) {
        if x.preempted && x.dur_ns < 10_000_000 && inside(x.start_ns) {
            short_n += 1;
            short_ns += x.dur_ns;
            continue;
        }
        if inside(x.start_ns) || inside(x.start_ns + x.dur_ns) {
            ev.push((
                x.start_ns,
                format!(
                    "{:9.1} off CPU {:.1} ms, {} in {}",
                    rel(x.start_ns),
                    x.dur_ns as f64 / 1e6,
                    if x.preempted { "preempted" } else { "blocked" },
                    leaf(x.stack)
                ),
            ));
        }
    }
    for g in r
        .gil_waits
        .iter()
        .filter(|g| g.pid == pid && g.tid == pid && inside(g.start_ns))
    {
        ev.push((
            g.start_ns,
            format!(
                "{:9.1} GIL wait {:.1} ms",
                rel(g.start_ns),
                g.dur_ns as f64 / 1e6
            ),
        ));
    }
    ev.sort();
    let _ = writeln!(
        o,
        "  (and {short_n} preemptions under 10 ms, {:.1} ms in all)",
        short_ns as f64 / 1e6
    );
    for (_, l) in ev.iter().take(400) {
        let _ = writeln!(o, "  {l}");
    }
    o
}

#[test]
fn asyncio_server_stalls_sid_315() {
    check("sid-3.15");
}
