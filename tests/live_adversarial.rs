//! Hostile targets (issue 15): a Python process that corrupts its own interpreter state while
//! enginescope records and dumps it, a `/metrics` server that misbehaves, and clients that
//! abuse the agent's endpoint. enginescope must not panic, hang or grow past a memory bound; it
//! counts the errors and goes on with the healthy threads; and it never writes to the target.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use enginescope::cpython::memory::{MemorySource, ProcessMemory};
use enginescope::cpython::PythonProcess;

/// Peak resident memory any enginescope run here may reach (a normal `record` of this target
/// peaks at ~40 MiB; the bound leaves room for allocator slack, not for unbounded growth).
const MAX_RSS_KIB: i64 = 256 << 10;

struct Run {
    ok: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
    max_rss_kib: i64,
}

/// Run `enginescope ARGS`, killing it if it is still running after `limit`; its own peak RSS
/// comes from wait4.
// The child is reaped with wait4 (for its rusage), which clippy does not see.
#[allow(clippy::zombie_processes)]
fn run_bounded(args: &[&str], limit: Duration) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn enginescope");
    let pid = child.id() as i32;
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let so = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let se = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let done = Arc::new(AtomicBool::new(false));
    let hung = Arc::new(AtomicBool::new(false));
    let (d, h) = (done.clone(), hung.clone());
    // The watchdog: a hang is a failure, reported as such rather than stalling the test run.
    std::thread::spawn(move || {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if d.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if !d.load(Ordering::SeqCst) {
            h.store(true, Ordering::SeqCst);
            // SAFETY: kill(2) on the child we started and have not reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child with valid out-pointers.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    done.store(true, Ordering::SeqCst);
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    let st = std::process::ExitStatus::from_raw(status);
    let run = Run {
        ok: st.success(),
        code: st.code(),
        stdout: so.join().unwrap(),
        stderr: se.join().unwrap(),
        max_rss_kib: ru.ru_maxrss,
    };
    assert!(
        !hung.load(Ordering::SeqCst),
        "enginescope {args:?} still running after {limit:?} (killed)\n{}",
        run.stderr
    );
    assert!(
        !run.stderr.contains("panicked"),
        "enginescope {args:?} panicked:\n{}",
        run.stderr
    );
    assert!(
        run.max_rss_kib < MAX_RSS_KIB,
        "enginescope {args:?} peaked at {} MiB (bound {} MiB)",
        run.max_rss_kib >> 10,
        MAX_RSS_KIB >> 10
    );
    run
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_string_lossy().as_bytes()).unwrap();
    assert_eq!(
        // SAFETY: mkfifo with a valid NUL-terminated path.
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {}",
        p.display()
    );
}

fn send(fifo: &Path, line: &str) {
    // Blocks until the workload opens it for reading.
    let mut f = std::fs::OpenOptions::new().write(true).open(fifo).unwrap();
    f.write_all(line.as_bytes()).unwrap();
}

fn wait_done(fifo: &Path) {
    let mut s = String::new();
    BufReader::new(std::fs::File::open(fifo).unwrap())
        .read_line(&mut s)
        .unwrap();
    assert_eq!(s.trim(), "DONE", "workload said {s:?}");
}

/// The target's bytes in each region the workload listed.
fn regions(pid: i32, listed: &serde_json::Value) -> Vec<(String, Vec<u8>)> {
    let mem = ProcessMemory::open(pid).unwrap();
    listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let name = r[0].as_str().unwrap().to_string();
            let addr = r[1].as_u64().unwrap();
            let len = r[2].as_u64().unwrap() as usize;
            let bytes = mem
                .read_vec(addr, len)
                .unwrap_or_else(|e| panic!("reading {name}: {e}"));
            (name, bytes)
        })
        .collect()
}

/// Events of the healthy thread in `es_healthy_worker` and of every other thread (on-CPU
/// samples and off-CPU intervals: a reader that keeps reading a thread records one or the other
/// each time, however little CPU the machine gives it), over thirds of the recording's span:
/// `[(healthy, others); 3]`.
fn healthy_samples(rec: &enginescope::record::Recording, tid: i32) -> [(usize, usize); 3] {
    let healthy = |stack: u32| {
        rec.stacks[stack as usize].iter().any(|&f| {
            rec.frames[f as usize]
                .function
                .ends_with("es_healthy_worker")
        })
    };
    let events: Vec<(u64, bool)> = rec
        .samples
        .iter()
        .map(|s| (s.t_ns, s.tid == tid && healthy(s.stack)))
        .chain(
            rec.offcpu
                .iter()
                .map(|o| (o.start_ns, o.tid == tid && healthy(o.stack))),
        )
        .collect();
    let (Some(first), Some(last)) = (
        events.iter().map(|e| e.0).min(),
        events.iter().map(|e| e.0).max(),
    ) else {
        return [(0, 0); 3];
    };
    let span = (last - first).max(1);
    let mut thirds = [(0, 0); 3];
    for (t, is_healthy) in events {
        let k = ((t.saturating_sub(first) * 3 / span) as usize).min(2);
        if is_healthy {
            thirds[k].0 += 1;
        } else {
            thirds[k].1 += 1;
        }
    }
    thirds
}

/// For a failure message: the longest stretch with no event of any thread (the reader did not
/// run, or read nothing) and the longest without one of the healthy thread, with each thread's
/// event count and its stacks' innermost frames, so a starved reader and a misread thread can
/// be told apart.
fn reading_gaps(rec: &enginescope::record::Recording, healthy_tid: i32) -> String {
    let events = |tid: Option<i32>| {
        let mut t: Vec<u64> = rec
            .samples
            .iter()
            .filter(|s| tid.is_none_or(|tid| s.tid == tid))
            .map(|s| s.t_ns)
            .chain(
                rec.offcpu
                    .iter()
                    .filter(|o| tid.is_none_or(|tid| o.tid == tid))
                    .map(|o| o.start_ns),
            )
            .collect();
        t.sort_unstable();
        t
    };
    let longest = |t: &[u64]| {
        t.windows(2)
            .map(|w| (w[1] - w[0], w[0]))
            .max()
            .map_or("none".to_string(), |(d, at)| {
                format!("{:.0} ms from {:.3} s", d as f64 / 1e6, at as f64 / 1e9)
            })
    };
    let mut per_thread: std::collections::BTreeMap<
        i32,
        (usize, std::collections::BTreeSet<String>),
    > = Default::default();
    for (tid, stack) in rec
        .samples
        .iter()
        .map(|s| (s.tid, s.stack))
        .chain(rec.offcpu.iter().map(|o| (o.tid, o.stack)))
    {
        let e = per_thread.entry(tid).or_default();
        e.0 += 1;
        if let Some(&f) = rec.stacks.get(stack as usize).and_then(|s| s.first()) {
            e.1.insert(rec.frames[f as usize].function.clone());
        }
    }
    // Across the healthy thread's longest gap: its off-CPU intervals (an interval is dated by
    // its start, so a thread off CPU for the whole gap shows here as one long interval) and its
    // thread records (a second one means the recorder lost the thread and found it again).
    let h = events(Some(healthy_tid));
    let (g0, g1) = h
        .windows(2)
        .max_by_key(|w| w[1] - w[0])
        .map_or((0, 0), |w| (w[0], w[1]));
    let off: Vec<String> = rec
        .offcpu
        .iter()
        .filter(|o| o.tid == healthy_tid && o.start_ns + o.dur_ns >= g0 && o.start_ns <= g1)
        .map(|o| {
            format!(
                "{:.3}+{:.0}ms{}",
                o.start_ns as f64 / 1e9,
                o.dur_ns as f64 / 1e6,
                if o.preempted {
                    " preempted"
                } else {
                    " blocked"
                }
            )
        })
        .collect();
    let records: Vec<String> = rec
        .threads
        .iter()
        .filter(|t| t.tid == healthy_tid)
        .map(|t| format!("{:.3} s {:?}", t.t_ns as f64 / 1e9, t.name))
        .collect();
    format!(
        "longest gap, any thread: {}; the healthy thread ({healthy_tid}): {}, its off-CPU \
         intervals across it {off:?}, its thread records {records:?}; per thread: {per_thread:?}",
        longest(&events(None)),
        longest(&h)
    )
}

fn counter(rec: &enginescope::record::Recording, name: &str) -> u64 {
    rec.counters.get(name).copied().unwrap_or(0)
}

fn record_and_check(w: &common::Workload, healthy_tid: i32, backend: &str, what: &str) -> String {
    let out = w.dir.join(format!("{what}-{backend}.esrec"));
    let pid = w.pid.to_string();
    let r = run_bounded(
        &[
            "record",
            "--pid",
            &pid,
            "--duration",
            "3",
            "--backend",
            backend,
            "--rate",
            "499",
            "-o",
            out.to_str().unwrap(),
        ],
        Duration::from_secs(90),
    );
    assert!(
        r.ok,
        "{what}: record --backend {backend} failed:\n{}",
        r.stderr
    );
    let rec = enginescope::record::format::read_recording(&out).unwrap();
    // Read throughout: in every third of the recording in which the reader read other
    // threads, it read the healthy one too; and it read in at least two thirds. (A reader the
    // machine does not run reads nothing at all for a while: on a 2-core machine at load 17,
    // with the target's four busy threads, the debug build's memory backend once went a whole
    // middle third without a tick: [14, 0, 16] events of the healthy thread, 45 samples in
    // all where a run at load 5 records over 2,000. That is not this test's subject; a
    // corrupted thread that stops the reader from reading the others is.)
    let thirds = healthy_samples(&rec, healthy_tid);
    assert!(
        thirds.iter().all(|&(h, others)| h > 0 || others == 0)
            && thirds.iter().filter(|&&(h, _)| h > 0).count() >= 2,
        "{what} ({backend}): the healthy thread must be read throughout; events per third {thirds:?}\n{}\n{:?}\n{}",
        reading_gaps(&rec, healthy_tid),
        rec.counters,
        r.stderr
    );
    // The corrupted threads' errors are counted: frames left unresolved or unreadable (BPF
    // collects code addresses in the kernel, user space resolves them), or samples marked
    // partial (the memory backend walks in user space).
    let partial = rec
        .samples
        .iter()
        .filter(|s| s.flags & enginescope::record::flags::PARTIAL != 0)
        .count() as u64;
    let counted = counter(&rec, "unresolved_frames")
        + counter(&rec, "bpf_read_frame_errors")
        + counter(&rec, "bpf_read_tstate_errors")
        + counter(&rec, "bpf_skipped_noncode_frames")
        + partial;
    assert!(
        counted > 0,
        "{what} ({backend}): no error counted for the corrupted threads: {:?}",
        rec.counters
    );
    format!(
        "{what} {backend}: healthy events per third {thirds:?}, {partial} partial samples, peak {} MiB, counters {:?}; {}",
        r.max_rss_kib >> 10,
        rec.counters,
        reading_gaps(&rec, healthy_tid)
    )
}

fn dump(w: &common::Workload) -> (Run, Option<serde_json::Value>) {
    let pid = w.pid.to_string();
    let r = run_bounded(&["dump", "--pid", &pid, "--json"], Duration::from_secs(60));
    let v = if r.ok {
        Some(serde_json::from_str(&r.stdout).expect("dump --json output"))
    } else {
        None
    };
    (r, v)
}

fn corrupted_target(label: &str) {
    let i = common::interp(label);
    if !common::available(&i) {
        return;
    }
    let w = common::start(
        &i,
        "corrupt.py",
        &["--dir", "{dir}", "--go-fifo", "{dir}/go"],
    );
    let done = w.dir.join("done");
    mkfifo(&done);
    let p = PythonProcess::attach(w.pid).expect("attach before corrupting");
    let o = &p.offsets;
    let offsets = serde_json::json!({
        "interp_threads_head": o.interp_threads_head,
        "tstate_next": o.tstate_next,
        "tstate_frame": o.tstate_frame,
        "cframe_current_frame": o.cframe_current_frame,
        "frame_code": o.frame_code,
        "frame_previous": o.frame_previous,
        "frame_code_tag_mask": o.frame_code_tag_mask,
        "code_linetable": o.code_linetable,
        "bytes_size": o.bytes_size,
    });
    drop(p);
    send(&w.dir.join("go"), &format!("{offsets}\n"));
    wait_done(&done);
    let info = common::read_json(&w.dir.join("corrupted.json"));
    let before = regions(w.pid, &info["regions"]);
    let ns_healthy = info["native"]["es-healthy"].as_i64().unwrap() as i32;
    let healthy = common::host_tid(w.pid, ns_healthy).unwrap_or(ns_healthy);
    let mut report = vec![];

    // Phase 1: bad code pointers, garbage line tables, a cyclic thread list.
    let (r, d) = dump(&w);
    let d = d.unwrap_or_else(|| panic!("{label}: dump failed:\n{}", r.stderr));
    let threads = d["threads"].as_array().unwrap();
    let by_name = |n: &str| threads.iter().find(|t| t["name"] == n);
    let h = by_name("es-healthy").expect("healthy thread in the dump");
    assert!(
        h["frames"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["function"] == "es_healthy_worker"),
        "{label}: {h}"
    );
    let bad = by_name("es-bad-code").expect("es-bad-code in the dump");
    assert!(
        bad["error"].is_string(),
        "{label}: a frame whose code pointer is unmapped is an error: {bad}"
    );
    assert!(d["read_errors"].as_u64().unwrap() >= 1, "{label}: {d}");
    assert!(
        threads.len() >= 5 && threads.len() <= 7,
        "{label}: the cyclic list is read once: {} threads",
        threads.len()
    );
    report.push(format!(
        "dump: {} threads, {} read errors, peak {} MiB",
        threads.len(),
        d["read_errors"],
        r.max_rss_kib >> 10
    ));
    report.push(record_and_check(&w, healthy, "bpf", "corrupt"));
    report.push(record_and_check(&w, healthy, "memory", "corrupt"));

    // Phase 2: a thread state linked, unmapped and unlinked over and over while we read.
    send(&w.dir.join("go"), "CHURN\n");
    wait_done(&done);
    report.push(record_and_check(&w, healthy, "bpf", "churn"));
    report.push(record_and_check(&w, healthy, "memory", "churn"));
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..10 {
        let (r, d) = dump(&w);
        match d {
            Some(_) => ok += 1,
            None => {
                // A dump may fail cleanly when the list head itself is bad; it says why.
                assert_eq!(
                    r.code,
                    Some(1),
                    "{label}: dump exit {:?}: {}",
                    r.code,
                    r.stderr
                );
                assert!(r.stderr.contains("enginescope"), "{}", r.stderr);
                failed += 1;
            }
        }
    }
    report.push(format!("churn dumps: {ok} ok, {failed} failed cleanly"));
    assert!(ok > 0, "{label}: no dump succeeded under churn");

    // Never written: the corrupted structures and a sentinel are byte for byte the same.
    let after = regions(w.pid, &info["regions"]);
    for ((name, a), (_, b)) in before.iter().zip(&after) {
        assert_eq!(a, b, "{label}: target region {name} changed");
    }
    assert!(
        std::fs::read_to_string(format!("/proc/{}/stat", w.pid))
            .map(|s| !s.contains(") Z"))
            .unwrap_or(false),
        "{label}: the target died"
    );
    eprintln!("{label}:\n  {}", report.join("\n  "));
}

#[test]
fn corrupted_interpreter_pyenv_3_12() {
    corrupted_target("pyenv-3.12");
}

#[test]
fn corrupted_interpreter_sid_3_14() {
    corrupted_target("sid-3.14");
}

// ---------------------------------------------------------------------------------------------
// A /metrics server that misbehaves.

/// How a fake /metrics server answers.
#[derive(Clone, Copy, Debug)]
enum Misbehave {
    /// The real vLLM page.
    Good,
    /// Accepts, reads the request, never answers.
    Silent,
    /// Headers at once, then one byte of body every 100 ms.
    Trickle,
    /// A chunked body that never ends, as fast as it is read.
    Endless,
    /// `Content-Length` of 1 GiB of valid `vllm:` lines, each series new.
    Huge,
    /// 200 OK with binary garbage and broken exposition lines.
    Malformed,
}

/// Serve `how` on a loopback port until the process ends; returns the URL.
fn metrics_server(how: Misbehave, served: Arc<AtomicU64>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metrics", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let served = served.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf);
                served.fetch_add(1, Ordering::SeqCst);
                let _ = answer(&mut c, how);
            });
        }
    });
    url
}

fn answer(c: &mut TcpStream, how: Misbehave) -> std::io::Result<()> {
    match how {
        Misbehave::Good => {
            let body = std::fs::read_to_string(
                common::repo_root().join("src/vllm/testdata/metrics-sample.txt"),
            )?;
            write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        }
        Misbehave::Silent => {
            std::thread::sleep(Duration::from_secs(30));
            Ok(())
        }
        Misbehave::Trickle => {
            c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")?;
            for _ in 0..600 {
                c.write_all(b"v")?;
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        }
        Misbehave::Endless => {
            c.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")?;
            let line = "vllm:num_requests_running{engine=\"0\"} 1\n".repeat(400);
            let chunk = format!("{:x}\r\n{line}\r\n", line.len());
            loop {
                c.write_all(chunk.as_bytes())?;
            }
        }
        Misbehave::Huge => {
            c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")?;
            let mut n = 0u64;
            loop {
                let mut s = String::with_capacity(64 << 10);
                for _ in 0..1000 {
                    n += 1;
                    s.push_str(&format!("vllm:x{{id=\"{n}\"}} {n}\n"));
                }
                c.write_all(s.as_bytes())?;
            }
        }
        Misbehave::Malformed => {
            let mut body = Vec::new();
            body.extend_from_slice(b"vllm:a{x=\"unterminated 1\nvllm:b{=} 2\nvllm:c 1e999999\n");
            body.extend_from_slice(
                b"vllm:d{a=\"\\\"} NaN\n# TYPE\n# HELP vllm:e\nvllm:e{le=\"+Inf\"} -Inf\n",
            );
            body.extend((0..20_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
            body.extend_from_slice("vllm:\u{fffd}{\u{0}=\"\u{7f}\"} 3\n".as_bytes());
            write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )?;
            c.write_all(&body)
        }
    }
}

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn scraper_bounded_by_misbehaving_servers() {
    use enginescope::vllm::metrics::{ScrapeEvent, Scraper};
    let kinds = [
        Misbehave::Good,
        Misbehave::Silent,
        Misbehave::Trickle,
        Misbehave::Endless,
        Misbehave::Huge,
        Misbehave::Malformed,
    ];
    let counts: Vec<Arc<AtomicU64>> = kinds.iter().map(|_| Arc::default()).collect();
    let engines: Vec<enginescope::record::EngineInfo> = kinds
        .iter()
        .zip(&counts)
        .map(|(k, n)| enginescope::record::EngineInfo {
            id: format!("{k:?}"),
            metrics_url: metrics_server(*k, n.clone()),
            ..Default::default()
        })
        .collect();
    let interval = Duration::from_millis(500);
    // Shorter than the product's (30 s at this interval), so that a silent server's request
    // ends within the test's rounds: what is checked is that each one is bounded by it.
    let timeout = Duration::from_secs(5);
    let (scraper, rx) = Scraper::spawn_with_timeout(engines, interval, timeout, 0).unwrap();
    // Three whole rounds: each bad server costs at most one request timeout per round.
    let round = timeout * kinds.len() as u32 + interval;
    let mut good_scrapes = 0;
    let mut errors: std::collections::BTreeMap<String, usize> = Default::default();
    let mut series = 0;
    let t0 = Instant::now();
    // Each engine has its own scrape thread: the good server's scrapes come every interval
    // while a bad one hangs to its timeout, so wait for both (an error from every bad server).
    let bad = ["Silent", "Trickle", "Endless", "Huge"];
    while good_scrapes < 3 || bad.iter().any(|k| !errors.contains_key(*k)) {
        assert!(
            t0.elapsed() < round * 4,
            "3 scrapes of the good server and an error from each bad one did not come in {:?}: \
             {good_scrapes} good, errors {errors:?}",
            round * 4
        );
        match rx.recv_timeout(round) {
            Ok(ScrapeEvent::Points(p)) => {
                if !p.is_empty() {
                    good_scrapes += 1;
                }
            }
            Ok(ScrapeEvent::Series(_)) => series += 1,
            Ok(ScrapeEvent::Error(e)) => *errors.entry(e.engine).or_default() += 1,
            Err(e) => panic!("no scrape event within a round ({round:?}): {e}; errors {errors:?}"),
        }
    }
    // Stopping waits for one request at most, even with a silent server mid-request.
    let t = Instant::now();
    scraper.stop();
    assert!(
        t.elapsed() <= timeout + Duration::from_secs(2),
        "stop took {:?}",
        t.elapsed()
    );
    for k in bad {
        assert!(
            errors.get(k).copied().unwrap_or(0) >= 1,
            "{k}: no scrape error counted: {errors:?}"
        );
    }
    assert!(series <= 2 * enginescope::vllm::metrics::MAX_SERIES_PER_ENGINE * kinds.len());
    let hwm = vm_hwm_kib();
    assert!(
        hwm < 768 << 10,
        "peak RSS of the test process {} MiB",
        hwm >> 10
    );
    eprintln!(
        "scraper: {good_scrapes} good scrapes, errors {errors:?}, {series} series, served {:?}, peak RSS {} MiB",
        counts.iter().map(|c| c.load(Ordering::SeqCst)).collect::<Vec<_>>(),
        hwm >> 10
    );
}

// ---------------------------------------------------------------------------------------------
// The agent's endpoint under slow clients and a load generator.

fn endpoint(timeout: Duration) -> enginescope::agent::exporter::Exporter {
    use prometheus_client::metrics::counter::Counter;
    let mut reg = prometheus_client::registry::Registry::default();
    let c: Counter = Counter::default();
    c.inc_by(42);
    reg.register("es_adversarial_things", "Things", c);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    enginescope::agent::exporter::Exporter::spawn(l, Arc::new(reg.into()), timeout).unwrap()
}

fn get(addr: std::net::SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// A client that sends its request head one byte at a time, `gap` apart, never finishing.
fn slowloris(addr: std::net::SocketAddr, gap: Duration, stop: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let Ok(mut s) = TcpStream::connect(addr) else {
            return;
        };
        for b in b"GET /metrics HTTP/1.1\r\nX-Slow: ".iter().cycle() {
            if stop.load(Ordering::SeqCst) || s.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(gap);
        }
    });
}

/// Connection handler threads of every endpoint in this process (each test has its own, and
/// two tests may run at once).
fn handler_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.starts_with("es-exporter-con"))
        })
        .count()
}

#[test]
fn agent_endpoint_under_slow_clients_and_load() {
    // Long per-connection timeout: with connections served one at a time (the old design),
    // every request below would wait behind the slow clients for a multiple of it.
    let timeout = Duration::from_secs(30);
    let e = endpoint(timeout);
    let stop = Arc::new(AtomicBool::new(false));
    // 6 slow clients: with 4 loaders, each of which may still count one handler finishing
    // (it has closed, the thread has not yet counted itself out), at most 6 + 4 + 4 = 14
    // connections are held at once, under the limit of 16.
    for _ in 0..6 {
        slowloris(e.addr, Duration::from_millis(500), stop.clone());
    }
    // A load generator on loopback: 4 clients × 200 requests, each answered in full.
    let t0 = Instant::now();
    let loaders: Vec<_> = (0..4)
        .map(|_| {
            let addr = e.addr;
            std::thread::spawn(move || {
                let mut ok = 0;
                let mut busy = 0;
                for _ in 0..200 {
                    let r = get(addr).expect("request under load");
                    if r.starts_with("HTTP/1.1 200") {
                        assert!(r.contains("es_adversarial_things_total 42"), "{r}");
                        ok += 1;
                    } else {
                        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
                        busy += 1;
                    }
                }
                (ok, busy)
            })
        })
        .collect();
    let (mut ok, mut busy) = (0, 0);
    for l in loaders {
        let (o, b) = l.join().unwrap();
        ok += o;
        busy += b;
    }
    let took = t0.elapsed();
    // They fit in the connection limit: everything is served.
    assert_eq!((ok, busy), (800, 0));
    assert!(
        took < timeout,
        "800 requests took {took:?} behind 6 slow clients (per-connection timeout {timeout:?})"
    );
    let threads = handler_threads();
    assert!(threads <= 2 * enginescope::agent::exporter::MAX_CONNECTIONS);
    stop.store(true, Ordering::SeqCst);
    eprintln!(
        "agent endpoint: 800 requests in {took:?} beside 6 slow clients; {threads} handler threads"
    );
    e.stop();
}

#[test]
fn agent_endpoint_flooded_recovers() {
    // More slow clients than connections served at once: the rest are told 503 at once, and
    // once the slow ones run out of time (2 s each, whole request) the endpoint serves again.
    let timeout = Duration::from_secs(2);
    let e = endpoint(timeout);
    let stop = Arc::new(AtomicBool::new(false));
    let n = enginescope::agent::exporter::MAX_CONNECTIONS * 3;
    for _ in 0..n {
        slowloris(e.addr, Duration::from_millis(300), stop.clone());
    }
    let t = Instant::now();
    let r = get(e.addr).unwrap();
    assert!(
        r.starts_with("HTTP/1.1 200") || r.starts_with("HTTP/1.1 503"),
        "{r}"
    );
    assert!(
        t.elapsed() < timeout * 3,
        "an answer took {:?}",
        t.elapsed()
    );
    // Handler threads stay within the limit (this endpoint's and, at most, another test's).
    let peak = handler_threads();
    assert!(
        peak <= 2 * enginescope::agent::exporter::MAX_CONNECTIONS,
        "{peak} handler threads with {n} slow clients"
    );
    // Each slow client holds its connection until the whole-request deadline cuts it (they do
    // not reconnect): once that has passed for all of them, a request is served in full.
    std::thread::sleep(
        (t + timeout + Duration::from_secs(2)).saturating_duration_since(Instant::now()),
    );
    let r = get(e.addr).unwrap();
    assert!(
        r.starts_with("HTTP/1.1 200"),
        "after the slow clients' deadline: {r}"
    );
    // A head far past 8 KiB is refused without reading it all.
    let mut s = TcpStream::connect(e.addr).unwrap();
    let big = format!(
        "GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n",
        "a".repeat(1 << 20)
    );
    let _ = s.write_all(big.as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.is_empty() || out.starts_with("HTTP/1.1 431"), "{out}");
    stop.store(true, Ordering::SeqCst);
    e.stop();
}
