//! Shared helpers for live tests: the interpreter matrix and starting sample workloads the way
//! users run them (plain host processes, or container-style in their own mount and PID
//! namespaces). Workloads signal readiness themselves (a READY line); nothing here sleeps.
#![allow(dead_code)]

pub mod agent;
pub mod cpu;
pub mod probe_truth;
pub mod tmux;
pub mod watchdog;

/// The interpreter matrix written once: one `#[test]` per row, named as given, each calling
/// `check` with the row's arguments (an interpreter label of [`interp`] first, such as
/// `"pyenv-3.12"` or `"sid-3.14"`). `// comments` between rows say why a row is there.
#[macro_export]
macro_rules! interpreter_tests {
    ($check:path { $( $name:ident: ($($arg:expr),* $(,)?) ),* $(,)? }) => {
        $(
            #[test]
            fn $name() {
                $check($($arg),*);
            }
        )*
    };
}

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// How to start one interpreter of the matrix.
#[derive(Debug, Clone)]
pub enum Launch {
    /// A host binary (pyenv builds, the host's /usr/bin/python3.11).
    Host(PathBuf),
    /// `/usr/bin/pythonX.Y` inside a Debian rootfs, run through nsrun.sh --pidns (own mount and
    /// PID namespaces, like a container).
    Container { root: PathBuf, exe: String },
}

#[derive(Debug, Clone)]
pub struct Interp {
    pub label: String,
    pub launch: Launch,
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn shared_dir() -> PathBuf {
    std::env::var_os("ENGINESCOPE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("../shared"))
}

fn pyenv_root() -> PathBuf {
    if let Some(r) = std::env::var_os("PYENV_ROOT") {
        return PathBuf::from(r);
    }
    if let Ok(o) = Command::new("pyenv").arg("root").output() {
        let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
        if o.status.success() && !s.is_empty() {
            return PathBuf::from(s);
        }
    }
    PathBuf::from("/root/.pyenv")
}

fn pyvers_prefix() -> PathBuf {
    std::env::var_os("PYVERS_PREFIX")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/pyvers"))
}

/// The interpreter for a matrix label: `pyenv-3.12`, `sid-3.14`, `host-3.11`.
pub fn interp(label: &str) -> Interp {
    let (src, ver) = label.split_once('-').expect("label like pyenv-3.12");
    let launch = match src {
        "pyenv" => {
            let full = match ver {
                "3.10" => "3.10.13",
                "3.11" => "3.11.7",
                "3.12" => "3.12.1",
                "3.13" => "3.13.0",
                _ => panic!("no pyenv version for {ver}"),
            };
            Launch::Host(
                pyenv_root()
                    .join("versions")
                    .join(full)
                    .join("bin")
                    .join(format!("python{ver}")),
            )
        }
        "host" => Launch::Host(PathBuf::from(format!("/usr/bin/python{ver}"))),
        "sid" => Launch::Container {
            root: pyvers_prefix().join("sid"),
            exe: format!("/usr/bin/python{ver}"),
        },
        _ => panic!("unknown source {src}"),
    };
    Interp {
        label: label.to_string(),
        launch,
    }
}

/// Whether the interpreter is here. Under CI=true a missing one fails the test instead of
/// skipping it.
pub fn available(i: &Interp) -> bool {
    let ok = match &i.launch {
        Launch::Host(p) => p.exists(),
        Launch::Container { root, exe } => {
            root.join(exe.trim_start_matches('/')).exists()
                && shared_dir().join("harness/pyvers/nsrun.sh").exists()
        }
    };
    if !ok {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("interpreter {} is missing (CI=true: the matrix must be complete; run scripts/test-env.sh)", i.label);
        }
        eprintln!(
            "SKIP {}: interpreter not installed (scripts/test-env.sh installs it)",
            i.label
        );
    }
    ok
}

/// A running sample workload. Killed (with everything in its namespace) on drop.
pub struct Workload {
    pub child: Child,
    /// The Python process's host PID.
    pub pid: i32,
    /// Host path of the workload's scratch directory (truth files land here).
    pub dir: PathBuf,
    /// The same directory as the workload sees it.
    pub inner_dir: String,
}

impl Drop for Workload {
    fn drop(&mut self) {
        // Its children first (a forked consumer left behind waited on a pipe for good,
        // holding the test's output open); then itself.
        for c in children_of(self.pid) {
            // SAFETY: kill(2) on a child of a process we started.
            unsafe {
                libc::kill(c, libc::SIGKILL);
            }
        }
        // SAFETY: kill(2) with a pid we started; harmless if it already exited.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Calls of `function` in a workload's truth (samples/mq_pipeline.py), timed in its body:
/// (start, dur), ns, CLOCK_MONOTONIC, in order.
pub fn truth_calls(truth: &serde_json::Value, function: &str) -> Vec<(u64, u64)> {
    timed_calls(truth, "calls", function)
}

/// The calls of `function` under `key` of the truth ("calls", "outer_calls"), in order.
pub fn timed_calls(truth: &serde_json::Value, key: &str, function: &str) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = truth[key][function]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| (c[1].as_u64().unwrap(), c[2].as_u64().unwrap()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The consumer process `samples/mq_pipeline.py` forks.
pub fn consumer_of(w: &Workload) -> i32 {
    children_of(w.pid)
        .into_iter()
        .find(|&c| {
            std::fs::read(format!("/proc/{c}/cmdline"))
                .map(|b| String::from_utf8_lossy(&b).contains("mq_pipeline"))
                .unwrap_or(false)
        })
        .expect("consumer process")
}

pub fn children_of(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
                // ppid is the 2nd field after the ")" that ends comm.
                if let Some(rest) = stat.rsplit_once(')').map(|x| x.1) {
                    let ppid: i32 = rest
                        .split_whitespace()
                        .nth(1)
                        .and_then(|x| x.parse().ok())
                        .unwrap_or(0);
                    if ppid == pid {
                        out.push(p);
                    }
                }
            }
        }
    }
    out
}

/// The descendant of `pid` (or `pid` itself) whose executable is a Python interpreter.
pub fn find_python(pid: i32) -> Option<i32> {
    let mut stack = vec![pid];
    while let Some(p) = stack.pop() {
        let exe = std::fs::read_link(format!("/proc/{p}/exe")).ok()?;
        let name = exe.file_name()?.to_string_lossy().into_owned();
        if name.starts_with("python") {
            return Some(p);
        }
        stack.extend(children_of(p));
    }
    None
}

/// Start `samples/<script>` with `args` (`{dir}` in an argument is replaced by the scratch
/// directory as the workload sees it) and wait for its READY line.
pub fn start(i: &Interp, script: &str, args: &[&str]) -> Workload {
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let name = format!("es-test-{}-{}-{}", i.label, std::process::id(), n);
    let (dir, inner_dir, mut cmd) = match &i.launch {
        Launch::Host(exe) => {
            let dir = std::env::temp_dir().join(&name);
            let inner = dir.to_string_lossy().into_owned();
            (dir, inner, Command::new(exe))
        }
        Launch::Container { root, exe } => {
            let dir = root.join("tmp").join(&name);
            let inner = format!("/tmp/{name}");
            let mut c = Command::new("bash");
            c.arg(shared_dir().join("harness/pyvers/nsrun.sh"))
                .arg("--pidns")
                .arg(root)
                .arg(exe);
            (dir, inner, c)
        }
    };
    std::fs::create_dir_all(&dir).unwrap();
    if args.contains(&"{dir}/go") {
        make_go_fifo(&dir);
    }
    std::fs::copy(repo_root().join("samples").join(script), dir.join(script)).unwrap();
    cmd.arg(format!("{inner_dir}/{script}"));
    for a in args {
        cmd.arg(a.replace("{dir}", &inner_dir));
    }
    // nsrun.sh creates and removes `ROOT/.nsrun-oldroot` around its pivot_root, so two starts in
    // the same rootfs at once can break each other: serialize container starts until READY
    // (across test threads with a mutex, across test processes with flock).
    static NSRUN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = matches!(i.launch, Launch::Container { .. }).then(|| {
        let g = NSRUN.lock().unwrap_or_else(|e| e.into_inner());
        let lock =
            std::fs::File::create(std::env::temp_dir().join("enginescope-nsrun.lock")).unwrap();
        // SAFETY: flock on a file descriptor we own; released when `lock` is dropped.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
        (g, lock)
    });
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn workload");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).unwrap();
        if n == 0 {
            let st = child.wait();
            panic!("{}: workload exited before READY: {st:?}", i.label);
        }
        if line.trim() == "READY" {
            break;
        }
    }
    drop(_guard);
    // Keep draining stdout so the workload never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while out.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    let pid = find_python(child.id() as i32).expect("python process of the workload");
    Workload {
        child,
        pid,
        dir,
        inner_dir,
    }
}

/// Map a thread id inside the workload's PID namespace to the host's, from NSpid lines
/// (independently of enginescope's own mapping).
pub fn host_tid(pid: i32, ns_tid: i32) -> Option<i32> {
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let host: i32 = e.file_name().to_str()?.parse().ok()?;
        let status = std::fs::read_to_string(e.path().join("status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
        let inner: i32 = line.split_whitespace().last()?.parse().ok()?;
        if inner == ns_tid {
            return Some(host);
        }
    }
    None
}

/// Run the enginescope binary (killed, with its threads' kernel stacks printed, if it runs
/// past the [`watchdog`]'s limit).
pub fn enginescope(args: &[&str]) -> std::process::Output {
    let child = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run enginescope");
    let _dog = watchdog::watch(child.id(), &format!("enginescope {}", args.join(" ")));
    child.wait_with_output().expect("run enginescope")
}

pub fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

impl Workload {
    /// Let a workload started with `--go-fifo {dir}/go` begin its measurement window.
    pub fn go(&self) {
        use std::io::Write;
        // Blocks until the workload opens the FIFO for reading (it does so right after READY).
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("go"))
            .unwrap();
        f.write_all(b"GO\n").unwrap();
    }
}

/// A recorder running in the background; `wait` returns its output.
pub struct Recorder {
    pub child: std::process::Child,
    stderr: BufReader<std::process::ChildStderr>,
    pub early_stderr: String,
    /// What [`Self::start`] read that [`Self::wait_for_lines`] has not looked at yet.
    unscanned: String,
    _watchdog: watchdog::Watchdog,
}

impl Recorder {
    /// Start `enginescope record ARGS` and return once it says sampling has started.
    pub fn start(args: &[&str]) -> Recorder {
        Self::start_env(args, &[])
    }

    /// As [`Self::start`], with `env` set for the recorder.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Recorder {
        let mut child = Command::new(env!("CARGO_BIN_EXE_enginescope"))
            .arg("record")
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn enginescope record");
        let _watchdog = watchdog::watch(
            child.id(),
            &format!("enginescope record {}", args.join(" ")),
        );
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut early = String::new();
        loop {
            let mut line = String::new();
            let n = stderr.read_line(&mut line).unwrap();
            early.push_str(&line);
            if n == 0 {
                let st = child.wait();
                panic!("recorder exited before sampling started: {st:?}\n{early}");
            }
            if line.contains("sampling started") {
                break;
            }
        }
        Recorder {
            child,
            stderr,
            unscanned: early.clone(),
            early_stderr: early,
            _watchdog,
        }
    }

    /// Read the recorder's stderr until `n` lines containing `needle` have appeared, counting
    /// those before `sampling started` (the default probes are placed before the window
    /// begins; a probe found later says so later); returns those lines. Panics if it exits
    /// first.
    pub fn wait_for_lines(&mut self, needle: &str, n: usize) -> Vec<String> {
        // Lines read before `sampling started` count once, at the first call.
        let mut found: Vec<String> = std::mem::take(&mut self.unscanned)
            .lines()
            .filter(|l| l.contains(needle))
            .map(|l| format!("{l}\n"))
            .collect();
        while found.len() < n {
            let mut line = String::new();
            let got = self.stderr.read_line(&mut line).unwrap();
            self.early_stderr.push_str(&line);
            if got == 0 {
                panic!(
                    "recorder ended before {n} lines with {needle:?}:\n{}",
                    self.early_stderr
                );
            }
            if line.contains(needle) {
                found.push(line);
            }
        }
        found
    }

    /// Wait for the recorder to finish; returns (success, stdout, all stderr).
    pub fn wait(mut self) -> (bool, String, String) {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stderr, &mut rest).unwrap();
        let mut out = String::new();
        if let Some(mut o) = self.child.stdout.take() {
            std::io::Read::read_to_string(&mut o, &mut out).unwrap();
        }
        let st = self.child.wait().unwrap();
        (st.success(), out, format!("{}{rest}", self.early_stderr))
    }
}

/// Make the FIFO `dir/go` (a workload's `--go-fifo {dir}/go`); `start` does it when asked.
pub fn make_go_fifo(dir: &Path) {
    let p = std::ffi::CString::new(dir.join("go").to_string_lossy().as_bytes()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(p.as_ptr(), 0o600) };
    assert!(rc == 0, "mkfifo {}", dir.join("go").display());
}

/// Run `samples/<script> --truth {dir}/truth.json --duration SECONDS --go-fifo {dir}/go` on `i`,
/// record it with `enginescope record --backend BACKEND --rate RATE` attached between READY and
/// GO (so the truth window lies inside the recording), and return the recording and the
/// truth. `None` when the interpreter is not installed (outside CI).
pub fn record_workload(
    i: &Interp,
    script: &str,
    seconds: &str,
    backend: &str,
    rate: &str,
) -> Option<(enginescope::record::Recording, serde_json::Value)> {
    record_workload_at(i, script, &[], seconds, backend, rate).map(|(r, t, kept)| {
        let _ = std::fs::remove_file(kept);
        (r, t)
    })
}

/// A TCP port free on loopback now (for a server a test starts next).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

/// [`record_workload`] with `extra` arguments for the script; also gives the path of a copy of
/// the recording in the temporary directory (the workload's own directory goes with it),
/// which the caller removes.
pub fn record_workload_at(
    i: &Interp,
    script: &str,
    extra: &[&str],
    seconds: &str,
    backend: &str,
    rate: &str,
) -> Option<(enginescope::record::Recording, serde_json::Value, PathBuf)> {
    record_workload_with(i, script, extra, seconds, backend, rate, &[])
}

/// [`record_workload_at`] with `record_extra` arguments for `record` (probes, a metrics URL).
pub fn record_workload_with(
    i: &Interp,
    script: &str,
    extra: &[&str],
    seconds: &str,
    backend: &str,
    rate: &str,
    record_extra: &[&str],
) -> Option<(enginescope::record::Recording, serde_json::Value, PathBuf)> {
    if !available(i) {
        return None;
    }
    let mut args = vec![
        "--truth",
        "{dir}/truth.json",
        "--duration",
        seconds,
        "--go-fifo",
        "{dir}/go",
    ];
    args.extend_from_slice(extra);
    let w = start(i, script, &args);
    let out = w.dir.join("run.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let pid = w.pid.to_string();
    let mut rec_args = vec![
        "--backend",
        backend,
        "--rate",
        rate,
        "--duration",
        "60",
        "--pid",
        &pid,
        "-o",
        &out_s,
    ];
    rec_args.extend_from_slice(record_extra);
    let rec = Recorder::start(&rec_args);
    w.go();
    let (ok, _, err) = rec.wait();
    assert!(ok, "{}: record failed: {err}", i.label);
    let truth = read_json(&w.dir.join("truth.json"));
    let r = enginescope::record::read_recording(&out).unwrap();
    assert_eq!(r.meta.backend, backend);
    // The directory goes with the workload: keep the file beside it.
    let kept = std::env::temp_dir().join(format!(
        "es-{}-{}-{}.esrec",
        i.label,
        script.trim_end_matches(".py"),
        w.pid
    ));
    std::fs::copy(&out, &kept).expect("keep the recording");
    Some((r, truth, kept))
}

/// `report --format json` of `path` over the truth's window (`truth.window.start_mono_ns` to
/// `end_mono_ns`, monotonic ns), which must begin after the recording.
pub fn window_report(
    path: &Path,
    r: &enginescope::record::Recording,
    truth: &serde_json::Value,
) -> serde_json::Value {
    let base = r.meta.start_mono_ns;
    let w0 = truth["window"]["start_mono_ns"].as_u64().unwrap();
    let w1 = truth["window"]["end_mono_ns"].as_u64().unwrap();
    assert!(w0 > base, "the recording started before the window");
    let from = format!("{:.9}", (w0 - base) as f64 / 1e9);
    let to = format!("{:.9}", (w1 - base) as f64 / 1e9);
    let path = path.to_string_lossy();
    let o = enginescope(&[
        "report", &path, "--format", "json", "--from", &from, "--to", &to,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("report JSON")
}

/// A small tmpfs mounted for a test, unmounted however the test ends.
pub struct TinyFs(tempfile::TempDir);

impl TinyFs {
    /// `size` bytes, or None where mounting is not allowed (not root).
    pub fn mount(size: &str) -> Option<TinyFs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(TinyFs(dir))
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

/// A child's stderr read line by line on a thread of its own, and every line read so far.
pub struct StderrLines {
    rx: std::sync::mpsc::Receiver<String>,
    pub log: String,
}

impl StderrLines {
    /// Follow `child`'s stderr (piped).
    pub fn follow(child: &mut Child) -> StderrLines {
        let err = BufReader::new(child.stderr.take().expect("stderr piped"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in err.lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        StderrLines {
            rx,
            log: String::new(),
        }
    }

    fn keep(&mut self, l: &str) {
        self.log.push_str(l);
        self.log.push('\n');
    }

    /// Lines until one `want` accepts (returned), or Err when `within` passes or the child
    /// closes its stderr first; every line read is kept in `log`.
    pub fn wait(
        &mut self,
        want: impl Fn(&str) -> bool,
        within: std::time::Duration,
    ) -> Result<String, std::sync::mpsc::RecvTimeoutError> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let l = self.rx.recv_timeout(left)?;
            self.keep(&l);
            if want(&l) {
                return Ok(l);
            }
        }
    }

    /// Keep the lines already read, without waiting.
    pub fn drain(&mut self) {
        while let Ok(l) = self.rx.try_recv() {
            self.keep(&l);
        }
    }

    /// Keep lines until the child closes its stderr (or says nothing for 5 s).
    pub fn read_to_end(&mut self) {
        while let Ok(l) = self.rx.recv_timeout(std::time::Duration::from_secs(5)) {
            self.keep(&l);
        }
    }
}

/// A tool on PATH from Debian package `package` (scripts/test.sh installs it); under CI=true a
/// missing one fails, else the test is skipped.
pub fn tool_binary(name: &str, package: &str) -> Option<std::path::PathBuf> {
    let p = std::env::var_os("PATH")?;
    let found = std::env::split_paths(&p)
        .map(|d| d.join(name))
        .find(|p| p.is_file());
    if found.is_none() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("{name} is missing (CI=true; scripts/test.sh installs {package})");
        }
        eprintln!("SKIP: {name} not installed (apt-get install {package})");
    }
    found
}

/// Probed calls the recorder itself flagged as not timed: an edge it could not classify
/// (another reference to the code object changed its count between the traps), a pop with no
/// push, a push never popped. A call lost or mistimed without one of these reasons is a defect.
pub fn flagged_calls(rec: &enginescope::record::Recording) -> u64 {
    [
        "probe_ambiguous_edges",
        "probe_unmatched_returns",
        "probe_calls_unfinished",
    ]
    .iter()
    .map(|k| rec.counters.get(*k).copied().unwrap_or(0))
    .sum()
}
