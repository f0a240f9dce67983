//! Errors say what failed and what to do, and never panic: a process that exits, a process
//! that is not Python, a caller without the rights to read the target.

mod common;

use common::*;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn exited_process_is_a_clean_error() {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    let out = enginescope(&["dump", "--pid", &pid.to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let e = stderr_of(&out);
    assert!(e.contains("does not exist"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
}

#[test]
fn not_python_is_explained() {
    // `cat` echoing a line back proves it is past execve and running its own code, so the
    // kernel has filled in its command line (no readiness sleep).
    use std::io::{BufRead, Write};
    let mut c = Command::new("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = c.stdin.take().unwrap();
    stdin.write_all(b"ready\n").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(c.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "ready\n");
    let out = enginescope(&["dump", "--pid", &c.id().to_string()]);
    drop(stdin);
    c.kill().unwrap();
    c.wait().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = stderr_of(&out);
    assert!(
        e.contains("not a CPython process") && e.contains("(cat)"),
        "{e}"
    );
    assert!(e.contains("hint:"), "{e}");
}

#[test]
fn target_killed_while_attached_never_panics() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    // Dump repeatedly while the workload is killed underneath: every run must end in either a
    // full dump or a clean error.
    let w = start(
        &i,
        "stacks.py",
        &["--truth", "{dir}/truth.json", "--threads", "40"],
    );
    let pid = w.pid.to_string();
    let killer = std::thread::spawn({
        let pid = w.pid;
        move || {
            // SAFETY: sending SIGKILL to the workload we started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        let out = enginescope(&["dump", "--pid", &pid, "--json"]);
        let e = stderr_of(&out);
        assert!(!e.contains("panicked"), "{e}");
        assert!(
            out.status.code() == Some(0) || out.status.code() == Some(1),
            "{e}"
        );
        outcomes.push(out.status.code());
    }
    killer.join().unwrap();
    let out = enginescope(&["dump", "--pid", &pid]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "after the kill the dump must fail cleanly"
    );
    drop(w);
}

#[test]
fn unprivileged_caller_gets_advice() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: needs root to start a target the unprivileged caller cannot read");
        return;
    }
    let w = start(
        &i,
        "stacks.py",
        &["--truth", "{dir}/truth.json", "--threads", "1"],
    );
    let out = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(["dump", "--pid", &w.pid.to_string()])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = stderr_of(&out);
    assert!(
        e.contains("permission denied") && e.contains("CAP_SYS_PTRACE"),
        "{e}"
    );
}
