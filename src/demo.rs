//! `enginescope demo`: start a bundled sample workload and show what enginescope reads from it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};

use crate::cpython::PythonProcess;

const STACKS_PY: &str = include_str!("../samples/stacks.py");

/// Kills the child when dropped, so no sample outlives the demo.
struct Reaper(Child);
impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start `samples/stacks.py` and return it once it printed READY (its own signal; no sleeping).
pub fn start_stacks_sample(
    python: &str,
    dir: &std::path::Path,
    extra: &[&str],
) -> anyhow::Result<(Child, std::path::PathBuf)> {
    let script = dir.join("stacks.py");
    std::fs::write(&script, STACKS_PY).context("writing the sample script")?;
    let truth = dir.join("truth.json");
    let mut child = Command::new(python)
        .arg(&script)
        .arg("--truth")
        .arg(&truth)
        .args(extra)
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| {
            format!("starting {python} (pass --python PATH to choose another interpreter)")
        })?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    let n = BufReader::new(stdout).read_line(&mut line)?;
    if n == 0 || line.trim() != "READY" {
        let _ = child.kill();
        let _ = child.wait();
        bail!("the sample exited before it was ready (got {line:?})");
    }
    Ok((child, truth))
}

pub fn run(python: &str) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("enginescope-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (child, _truth) = start_stacks_sample(python, &dir, &["--threads", "2", "--spin"])?;
    let child = Reaper(child);
    let pid = child.0.id() as i32;
    println!("Started a sample Python workload (pid {pid}) with threads parked at known stacks.");
    println!("Reading it from outside, without pausing it:\n");
    let t0 = Instant::now();
    let p = PythonProcess::attach(pid)?;
    let snap = p.snapshot()?;
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    print!("{}", crate::dump::to_text(&p, &snap, ms));
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
