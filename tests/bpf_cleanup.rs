//! No BPF program, link, perf event or uprobe outlives enginescope: after a normal exit, SIGINT
//! and SIGKILL, every program the recorder held while running is gone from the kernel, and the
//! interpreter's code is its file's again in the target and in a process it did not record.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// BPF program ids held by `pid`, from its fds' fdinfo (`prog_id:` lines).
fn programs_held_by(pid: u32) -> Vec<u64> {
    let mut ids = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
    {
        let info = std::fs::read_to_string(e.path()).unwrap_or_default();
        if let Some(id) = info.lines().find_map(|l| l.strip_prefix("prog_id:")) {
            ids.push(id.trim().parse().unwrap());
        }
    }
    ids.sort();
    ids.dedup();
    ids
}

/// Every BPF program id loaded in the kernel now.
fn all_program_ids() -> Vec<u64> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "--json"])
        .output()
        .expect("bpftool (apt-get install bpftool)");
    assert!(
        out.status.success(),
        "bpftool: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["id"].as_u64())
        .collect()
}

/// BPF link ids held by `pid` (aya attaches tracepoints and uprobes through links).
fn links_held_by(pid: u32) -> Vec<u64> {
    let mut ids = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
    {
        let info = std::fs::read_to_string(e.path()).unwrap_or_default();
        if let Some(id) = info.lines().find_map(|l| l.strip_prefix("link_id:")) {
            ids.push(id.trim().parse().unwrap());
        }
    }
    ids
}

/// Perf event descriptors held by `pid`.
fn perf_events_held_by(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().contains("perf_event"))
        })
        .count()
}

fn all_link_ids() -> Vec<u64> {
    let out = Command::new("bpftool")
        .args(["link", "show", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::json!([]));
    v.as_array()
        .map(|a| a.iter().filter_map(|l| l["id"].as_u64()).collect())
        .unwrap_or_default()
}

/// The first byte of the interpreter's `_Py_RunGC` (3.12: a GC uprobe goes there) in the
/// target's memory and in its file: a uprobe shows as an int3 (0xcc) in memory only.
fn collector_bytes(pid: u32) -> (u8, u8) {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let maps = enginescope::cpython::binary::parse_maps(&maps);
    let bin = enginescope::cpython::binary::find_interpreter(pid as i32, &maps).unwrap();
    let cs = enginescope::cpython::binary::find_collectors(&bin, 12, 0).unwrap();
    let c = cs.iter().find(|c| c.name == "_Py_RunGC").unwrap();
    let addr = bin.symbols["_Py_RunGC"];
    let mut mem = [0u8; 1];
    std::fs::File::open(format!("/proc/{pid}/mem"))
        .unwrap()
        .read_exact_at(&mut mem, addr)
        .unwrap();
    let mut file = [0u8; 1];
    std::fs::File::open(&c.path)
        .unwrap()
        .read_exact_at(&mut file, c.file_offset)
        .unwrap();
    (mem[0], file[0])
}

/// Every site where a GC uprobe of this interpreter goes (each collector's entry, and its
/// start where that is probed past the entry), as its address in `pid` and its byte in the
/// file.
fn probe_sites(pid: u32) -> Vec<(u64, u8)> {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let maps = enginescope::cpython::binary::parse_maps(&maps);
    let bin = enginescope::cpython::binary::find_interpreter(pid as i32, &maps).unwrap();
    let cs = enginescope::cpython::binary::find_collectors(&bin, 12, 0).unwrap();
    let mut sites = Vec::new();
    for c in &cs {
        let entry = bin.symbols[c.name];
        for off in [c.file_offset, c.enter_file_offset] {
            let mut file = [0u8; 1];
            std::fs::File::open(&c.path)
                .unwrap()
                .read_exact_at(&mut file, off)
                .unwrap();
            sites.push((entry + (off - c.file_offset), file[0]));
        }
    }
    sites.sort_unstable();
    sites.dedup();
    sites
}

/// How many of `sites` hold something else than their file's byte in `pid` (an int3).
fn sites_probed(pid: u32, sites: &[(u64, u8)]) -> usize {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    sites
        .iter()
        .filter(|&&(addr, file)| {
            let mut b = [0u8; 1];
            mem.read_exact_at(&mut b, addr).unwrap();
            b[0] != file
        })
        .count()
}

/// Reads `collector_bytes(pid)` until memory and file agree or `bound` passes; returns the
/// last bytes read and how many reads it took (one read is ~40 ms of ELF parsing).
fn restored_within(pid: u32, bound: std::time::Duration) -> ((u8, u8), u32) {
    let t = std::time::Instant::now();
    let mut reads = 0;
    loop {
        let b = collector_bytes(pid);
        reads += 1;
        if b.0 == b.1 || t.elapsed() > bound {
            return (b, reads);
        }
        std::thread::yield_now();
    }
}

/// One recorder at a time. GC uprobes are set on the interpreter's file for every process
/// that maps it, and the kernel keeps a breakpoint while any recorder's uprobe is on it: with
/// the tests in parallel, another test's recorder put int3 into this test's bystander (a CI
/// run: the bystander read 0xcc just after this test's target read clean).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A spinning target and a bystander of the same interpreter (not recorded: the GC uprobes
/// are set on the interpreter's file, so they reach it too, their programs returning at once
/// there, and must leave it as they leave the target), and a BPF recorder of the target at
/// `rate` Hz for `duration` s writing `out`, its stderr piped.
struct Run {
    target: Workload,
    bystander: Workload,
    rec: std::process::Child,
    err: BufReader<std::process::ChildStderr>,
    out: std::path::PathBuf,
}

/// Before anything is recorded: no GC site of the interpreter is probed in `bystander`. The
/// kernel writes a uprobe's int3 into every process that maps the probed file (seen on 6.18:
/// also where the probe's pid filter leaves that process out), so while another
/// process (another enginescope, an agent's soak) probes the same libpython, these tests
/// cannot tell what their own recorder left behind.
fn nobody_else_probes(bystander: &Workload) {
    let sites = probe_sites(bystander.pid as u32);
    // The test before this one may still be removing its own uprobes (its helper waits for
    // the kernel's grace periods after the test ended): a bounded wait for them.
    let t = std::time::Instant::now();
    let mut probed = sites_probed(bystander.pid as u32, &sites);
    while probed > 0 && t.elapsed() < std::time::Duration::from_secs(20) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        probed = sites_probed(bystander.pid as u32, &sites);
    }
    assert_eq!(
        probed,
        0,
        "{probed} of the interpreter's {} GC probe sites hold an int3 in a process nothing records yet, 20 s after it started: another process probes this libpython (another enginescope or agent on a pyenv 3.12 target?); stop it and run again",
        sites.len()
    );
}

fn start_run(i: &Interp, rate: &str, duration: &str) -> Run {
    let args = ["--truth", "{dir}/truth.json", "--threads", "1", "--spin"];
    let target = start(i, "stacks.py", &args);
    let bystander = start(i, "stacks.py", &args);
    nobody_else_probes(&bystander);
    let out = target.dir.join("x.esrec");
    let mut rec = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(["record", "--backend", "bpf", "--rate", rate])
        .args([
            "--duration",
            duration,
            "--pid",
            &target.pid.to_string(),
            "-o",
        ])
        .arg(&out)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = BufReader::new(rec.stderr.take().unwrap());
    Run {
        target,
        bystander,
        rec,
        err,
        out,
    }
}

fn check(how: &str) {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let duration = if how == "exit" { "1" } else { "60" };
    let Run {
        target: w,
        bystander,
        mut rec,
        mut err,
        out,
    } = start_run(&i, "499", duration);
    // The recorder says "recording ..." once its programs are loaded and attached.
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("recording") && line.contains("bpf"), "{line}");
    let held = programs_held_by(rec.id());
    assert!(
        held.len() >= 2,
        "the recorder should hold on_sample and on_switch, held {held:?}"
    );
    let links = links_held_by(rec.id());
    assert!(!links.is_empty(), "a link for sched_switch, got {links:?}");
    // The sampling clock: a cpu-clock perf event per CPU running on_sample, set by ioctl
    // (no link; src/bpf/clock.rs). Closing them, at any exit, releases the program (below).
    let cpus = std::thread::available_parallelism().unwrap().get();
    let perf_events = perf_events_held_by(rec.id());
    assert!(
        perf_events >= cpus,
        "one cpu-clock perf event per CPU ({cpus}), held {perf_events}"
    );
    assert!(links.iter().all(|id| all_link_ids().contains(id)));
    assert!(held.iter().all(|id| all_program_ids().contains(id)));
    // GC pauses are timed by uprobes on this interpreter (it has symbols): the collector's
    // first instruction is a breakpoint in the target while the recorder runs. The recorder
    // attaches them as it configures the target, after "recording ...", and says so.
    let mut gc_line = String::new();
    for _ in 0..50 {
        gc_line.clear();
        if err.read_line(&mut gc_line).unwrap_or(0) == 0 || gc_line.contains("GC pauses of process")
        {
            break;
        }
    }
    assert!(
        gc_line.contains("uprobe"),
        "{how}: GC method line: {gc_line}"
    );
    let (mem, file) = collector_bytes(w.pid as u32);
    assert_eq!(
        mem, 0xcc,
        "{how}: no uprobe on _Py_RunGC while recording (file byte {file:#x})"
    );
    match how {
        "exit" => {}
        // SAFETY: kill(2) with plain integers.
        "sigint" => unsafe {
            libc::kill(rec.id() as i32, libc::SIGINT);
        },
        // SAFETY: kill(2) with plain integers.
        "sigkill" => unsafe {
            libc::kill(rec.id() as i32, libc::SIGKILL);
        },
        _ => unreachable!(),
    }
    let st = rec.wait().unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    match how {
        "sigkill" => assert!(!st.success()),
        _ => assert!(st.success(), "{how}: {st:?} {rest}"),
    }
    // The kernel frees a program and its id after an RCU grace period once the last fd is
    // closed, so ids can stay listed for a moment after the process is gone. Ids are never
    // reused, so a survivor after that bound is a real leak. Bounded, and the time is printed.
    let t0 = std::time::Instant::now();
    let (left_progs, left_links) = loop {
        let progs = all_program_ids();
        let lnks = all_link_ids();
        let lp: Vec<u64> = held
            .iter()
            .filter(|id| progs.contains(id))
            .copied()
            .collect();
        let ll: Vec<u64> = links
            .iter()
            .filter(|id| lnks.contains(id))
            .copied()
            .collect();
        if (lp.is_empty() && ll.is_empty()) || t0.elapsed() > std::time::Duration::from_secs(5) {
            break (lp, ll);
        }
        std::thread::yield_now();
    };
    eprintln!(
        "{how}: programs and links released {:.0} ms after exit",
        t0.elapsed().as_secs_f64() * 1e3
    );
    assert!(
        left_progs.is_empty(),
        "{how}: BPF programs left behind: {left_progs:?}"
    );
    assert!(
        left_links.is_empty(),
        "{how}: BPF links (perf events, tracepoints) left behind: {left_links:?}"
    );
    // The uprobes are gone with the recorder's fds: the target's code is its file's again, and
    // so is the bystander's. The recorder removes them before it exits (a kill: the kernel as
    // it closes the fds, before the exit is reported), so both should read back at once; the
    // bound only turns a deferred removal into a time printed rather than a failure.
    let bound = std::time::Duration::from_secs(5);
    let ((mem, file), reads) = restored_within(w.pid as u32, bound);
    eprintln!("{how}: the target's collector read clean at read {reads}");
    assert_eq!(
        mem, file,
        "{how}: a uprobe is left in the target's _Py_RunGC"
    );
    let ((mem, file), reads) = restored_within(bystander.pid as u32, bound);
    eprintln!("{how}: the bystander's collector read clean at read {reads}");
    assert_eq!(
        mem, file,
        "{how}: a uprobe is left in the _Py_RunGC of a process that was not recorded"
    );
    // After SIGINT the recording is finished cleanly; after SIGKILL it still reads.
    let r = enginescope::record::read_recording(&out).unwrap();
    if how != "sigkill" {
        assert!(r.end.is_some(), "{how}: no end record");
    }
}

#[test]
fn no_probe_left_after_normal_exit() {
    check("exit");
}

#[test]
fn no_probe_left_after_sigint() {
    check("sigint");
}

#[test]
fn no_probe_left_after_sigkill() {
    check("sigkill");
}

/// A SIGKILL while the recorder removes its GC uprobes (after SIGINT: the recording ends and
/// closes them, each waiting for kernel grace periods) leaves none behind, in the target or in a process
/// it did not record. The kill is sent once some probe sites read clean and others do not,
/// so it lands in the middle of the removal. Before the removal moved to a helper process,
/// this left int3 at 3 of the 4 collectors in both processes ("failed to unregister, leaking
/// uprobe" in the kernel log).
#[test]
fn no_probe_left_after_sigkill_while_removing() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Run {
        target: w,
        bystander,
        mut rec,
        mut err,
        ..
    } = start_run(&i, "99", "60");
    let sites = probe_sites(w.pid as u32);
    assert!(sites.len() >= 4, "{sites:?}");
    let mut line = String::new();
    while !line.contains("GC pauses of process") {
        line.clear();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "recorder ended early"
        );
    }
    assert!(line.contains("uprobe"), "{line}");
    let all = sites_probed(w.pid as u32, &sites);
    assert_eq!(all, sites.len(), "every site probed while recording");
    // SAFETY: signals to the recorder we started.
    unsafe { libc::kill(rec.id() as i32, libc::SIGINT) };
    let t = std::time::Instant::now();
    let mut seen = all;
    while seen == all && t.elapsed() < std::time::Duration::from_secs(10) {
        seen = sites_probed(w.pid as u32, &sites);
    }
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(rec.id() as i32, libc::SIGKILL) };
    let st = rec.wait().unwrap();
    eprintln!(
        "killed {:.0} ms after SIGINT with {seen} of {all} sites still probed",
        t.elapsed().as_secs_f64() * 1e3
    );
    // The helper closes the links in children of its own, all at once, and the recorder
    // waits for them only briefly: the kill lands while they are being removed (some sites
    // clean, some not), or, where they all went at once, just after; either way nothing may
    // be left.
    assert!(
        seen < all,
        "the removal had not begun ({seen} of {all} probed)"
    );
    eprintln!("recorder: {st}");
    // The removal goes on without the recorder: bounded wait for it.
    for (who, pid) in [("target", w.pid), ("bystander", bystander.pid)] {
        let sites = probe_sites(pid as u32);
        let t = std::time::Instant::now();
        let mut left = sites_probed(pid as u32, &sites);
        while left > 0 && t.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::yield_now();
            left = sites_probed(pid as u32, &sites);
        }
        eprintln!(
            "{who}: {left} sites probed {:.0} ms later",
            t.elapsed().as_secs_f64() * 1e3
        );
        assert_eq!(
            left, 0,
            "{who}: uprobes left after a SIGKILL during their removal"
        );
    }
}

/// Processes whose name is `comm` now.
fn processes_named(comm: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == comm)
        })
        .collect()
}

/// SIGKILL at random points of start-up, the window and shutdown, 50 times (a 1 s window
/// with an exact probe, so watchpoints too; kills from at once to 2.5 s after the spawn, past
/// the recorder's end in some trials): afterwards no BPF program or link loaded since the
/// test began is left, no GC uprobe is left in the target or in a process it did not record,
/// and no helper process (`es-uprobe-close`) outlives its work. The seed is
/// printed; `ES_KILL_SEED` replays one.
#[test]
fn no_probe_left_after_sigkill_at_random_points() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let args = ["--truth", "{dir}/truth.json", "--threads", "1", "--spin"];
    let target = start(&i, "stacks.py", &args);
    let bystander = start(&i, "stacks.py", &args);
    nobody_else_probes(&bystander);
    let progs_before = all_program_ids();
    let links_before = all_link_ids();
    let mut seed: u64 = std::env::var("ES_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos() as u64
        });
    eprintln!("ES_KILL_SEED={seed}");
    let pid = target.pid.to_string();
    let (mut killed, mut finished) = (0, 0);
    for trial in 0..50 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let delay = std::time::Duration::from_millis((seed >> 33) % 2500);
        let out = target.dir.join(format!("kill-{trial}.esrec"));
        let mut rec = Command::new(env!("CARGO_BIN_EXE_enginescope"))
            .args(["record", "--backend", "bpf", "--rate", "499"])
            .args(["--duration", "1", "--probe", "spin", "--pid", &pid, "-o"])
            .arg(&out)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        // SAFETY: a signal to the recorder we started.
        unsafe { libc::kill(rec.id() as i32, libc::SIGKILL) };
        let st = rec.wait().unwrap();
        if st.success() {
            finished += 1;
        } else {
            killed += 1;
        }
    }
    eprintln!("{killed} killed, {finished} finished before the kill");
    assert!(killed >= 25, "{killed} of 50 trials killed the recorder");
    // The kernel releases what a killed process held as it closes its fds; the uprobes'
    // helper goes on removing them by itself: bounded waits.
    let t = std::time::Instant::now();
    let bound = std::time::Duration::from_secs(20);
    let left = |before: &[u64], now: Vec<u64>| -> Vec<u64> {
        now.into_iter().filter(|id| !before.contains(id)).collect()
    };
    let (mut progs, mut links, mut helpers);
    loop {
        progs = left(&progs_before, all_program_ids());
        links = left(&links_before, all_link_ids());
        helpers = [
            processes_named("es-uprobe-close"),
            processes_named("es-watch"),
        ]
        .concat();
        if (progs.is_empty() && links.is_empty() && helpers.is_empty()) || t.elapsed() > bound {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(progs.is_empty(), "BPF programs left behind: {progs:?}");
    assert!(links.is_empty(), "BPF links left behind: {links:?}");
    assert!(helpers.is_empty(), "helper processes left: {helpers:?}");
    for (who, p) in [("target", target.pid), ("bystander", bystander.pid)] {
        let sites = probe_sites(p as u32);
        let t = std::time::Instant::now();
        let mut probed = sites_probed(p as u32, &sites);
        while probed > 0 && t.elapsed() < bound {
            std::thread::sleep(std::time::Duration::from_millis(50));
            probed = sites_probed(p as u32, &sites);
        }
        assert_eq!(probed, 0, "{who}: {probed} GC uprobe sites left");
    }
}
