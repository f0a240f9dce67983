//! A real terminal for `top`: a tmux server of the test's own, its screen read with
//! capture-pane and polled until what the test waits for shows (never a sleep for readiness).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A tmux server of our own (its own socket), killed on drop.
pub struct Tmux {
    pub socket: String,
}

impl Tmux {
    /// `None` when tmux is not installed (outside CI).
    pub fn start(width: u16, height: u16) -> Option<Tmux> {
        if Command::new("tmux").arg("-V").output().is_err() {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("tmux is missing (scripts/test.sh installs it)");
            }
            eprintln!("SKIP: tmux not installed");
            return None;
        }
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let t = Tmux {
            socket: format!("es-tui-test-{}-{n}", std::process::id()),
        };
        t.run(&[
            "new-session",
            "-d",
            "-s",
            "main",
            "-x",
            &width.to_string(),
            "-y",
            &height.to_string(),
            "env PS1='es$ ' TERM=xterm-256color bash --norc --noprofile",
        ]);
        t.wait_for("the shell prompt", |s| s.contains("es$"));
        Some(t)
    }

    pub fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "main"])
    }

    /// Type keys (tmux key names: `Tab`, `Enter`, `Escape`, or text).
    pub fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "main"];
        args.extend_from_slice(keys);
        self.run(&args);
    }

    /// Poll the screen until `ok` holds (at most 60 s); returns that screen.
    pub fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}; the screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Write a recording named `name` with `write` into a new directory and run `top
    /// --replay` on it in the pane from there; the shell prints `TOP-EXIT=N` after it.
    pub fn replay(&self, name: &str, write: fn(&Path)) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let rec = dir.path().join(name);
        write(&rec);
        self.keys(&[
            &format!(
                "cd {} && {} top --replay {}; echo TOP-EXIT=$?",
                dir.path().display(),
                env!("CARGO_BIN_EXE_enginescope"),
                rec.display()
            ),
            "Enter",
        ]);
        dir
    }

    /// PID of the shell in the pane.
    pub fn shell_pid(&self) -> i32 {
        self.run(&["display-message", "-p", "-t", "main", "#{pane_pid}"])
            .trim()
            .parse()
            .expect("pane pid")
    }

    /// Whether a line of the screen starts with `prefix` (output, not the typed command).
    pub fn has_line(screen: &str, prefix: &str) -> bool {
        screen.lines().any(|l| l.starts_with(prefix))
    }

    /// Wait for `top`'s exit status, which the shell prints after it: `TOP-EXIT=N`.
    pub fn wait_exit(&self) -> String {
        let s = self.wait_for("the shell after top", |s| Tmux::has_line(s, "TOP-EXIT="));
        assert!(Tmux::has_line(&s, "TOP-EXIT=0"), "top failed:\n{s}");
        assert!(
            !s.contains("PID/TID"),
            "the dashboard is still on screen:\n{s}"
        );
        s
    }

    /// The terminal is back in canonical mode with echo and signals (what raw mode turns
    /// off): `stty -a` run in the pane after top, its answer read from a file in `dir`.
    pub fn assert_terminal_restored(&self, dir: &Path) {
        let out = dir.join("stty.txt");
        self.keys(&[
            &format!("stty -a > {}; echo STTY-DONE", out.display()),
            "Enter",
        ]);
        self.wait_for("stty", |s| Tmux::has_line(s, "STTY-DONE"));
        let stty = std::fs::read_to_string(&out).unwrap();
        let words: Vec<&str> = stty.split([' ', ';', '\n']).collect();
        for flag in ["icanon", "echo", "isig", "icrnl", "opost"] {
            assert!(words.contains(&flag), "terminal left with -{flag}:\n{stty}");
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
    }
}

/// The enginescope process started by the pane's shell.
pub fn top_pid(shell: i32) -> Option<i32> {
    let exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_enginescope")).ok()?;
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: i32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        (ppid == shell && std::fs::read_link(format!("/proc/{pid}/exe")).ok()? == exe)
            .then_some(pid)
    })
}

/// The header's window length (`window 2.5 s`), in seconds.
pub fn window_secs(screen: &str) -> Option<f64> {
    let rest = screen.split("window ").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// Print a screen for the test log (the views as a person sees them).
pub fn show(what: &str, screen: &str) {
    eprintln!("----- {what} -----\n{}", screen.trim_end());
}

// ---- what top leaves behind ----

/// BPF program ids held by `pid` (its fds' fdinfo `prog_id:` lines).
pub fn programs_held_by(pid: i32) -> Vec<u64> {
    let mut ids: Vec<u64> = std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let info = std::fs::read_to_string(e.path()).ok()?;
                    info.lines()
                        .find_map(|l| l.strip_prefix("prog_id:"))
                        .and_then(|id| id.trim().parse().ok())
                })
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids.dedup();
    ids
}

pub fn loaded_programs() -> Vec<u64> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "--json"])
        .output()
        .expect("bpftool (apt-get install bpftool)");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v.as_array()
        .map(|a| a.iter().filter_map(|p| p["id"].as_u64()).collect())
        .unwrap_or_default()
}

/// Programs are freed an RCU grace period after their last fd closes: bounded wait.
pub fn assert_programs_released(held: &[u64]) {
    let t0 = Instant::now();
    loop {
        let loaded = loaded_programs();
        let left: Vec<u64> = held
            .iter()
            .copied()
            .filter(|id| loaded.contains(id))
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "BPF programs left behind by top: {left:?}"
        );
        std::thread::yield_now();
    }
}
