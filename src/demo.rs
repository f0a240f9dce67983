//! `enginescope demo`: start a bundled sample workload and show what enginescope reads from it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};

use crate::cpython::PythonProcess;

const STACKS_PY: &str = include_str!("../samples/stacks.py");
const CPU_MIX_PY: &str = include_str!("../samples/cpu_mix.py");

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
    start_sample(python, dir, "stacks.py", STACKS_PY, extra)
}

fn start_sample(
    python: &str,
    dir: &std::path::Path,
    name: &str,
    source: &str,
    extra: &[&str],
) -> anyhow::Result<(Child, std::path::PathBuf)> {
    let script = dir.join(name);
    std::fs::write(&script, source).context("writing the sample script")?;
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

pub fn run(python: &str, out_dir: &std::path::Path, seconds: f64) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("enginescope-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run_in(python, &dir, out_dir, seconds);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in(
    python: &str,
    dir: &std::path::Path,
    out_dir: &std::path::Path,
    seconds: f64,
) -> anyhow::Result<()> {
    // 1. dump: stacks of a process whose threads are parked at known places.
    let (child, _truth) = start_stacks_sample(python, dir, &["--threads", "2", "--spin"])?;
    let child = Reaper(child);
    let pid = child.0.id() as i32;
    println!("== 1. dump: a sample process (pid {pid}) with threads parked at known stacks, read from outside without pausing it\n");
    let t0 = Instant::now();
    let p = PythonProcess::attach(pid)?;
    let snap = p.snapshot()?;
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    print!("{}", crate::dump::to_text(&p, &snap, ms));
    drop(child);

    // 2. record: a workload whose threads compute, sleep and block on I/O in known proportions.
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let window = format!("{}", seconds + 1.0);
    let (child, _truth) = start_sample(
        python,
        dir,
        "cpu_mix.py",
        CPU_MIX_PY,
        &["--duration", &window],
    )?;
    let child = Reaper(child);
    let pid = child.0.id() as i32;
    let rec_path = out_dir.join("demo.esrec");
    println!("\n== 2. record: {seconds} s of a mixed workload (pid {pid}): mix-cpu splits its CPU 70/30 between hot_a and hot_b, the others mostly wait\n");
    let summary = crate::sampler::record(&crate::sampler::RecordOptions {
        duration: Some(std::time::Duration::from_secs_f64(seconds)),
        rate_hz: 997,
        ..crate::sampler::RecordOptions::new(vec![pid], rec_path.clone())
    })?;
    drop(child);
    println!(
        "{} samples, {} off-CPU intervals, {} bytes, backend {}\n",
        summary.samples, summary.offcpu_intervals, summary.bytes, summary.backend
    );

    // 3. views: report and flamegraph.
    let (rec, sel) = crate::views::open(&rec_path, &crate::views::filter::FilterArgs::default())?;
    // The flamegraphs are written next to the report, so it links them by name.
    let opts = crate::views::report::ReportOptions {
        flame_links: vec!["flame.svg".into(), "flame-offcpu.svg".into()],
        ..Default::default()
    };
    let md = crate::views::report_with(&rec, &sel, crate::views::ReportFormat::Md, &opts)?;
    let md_path = out_dir.join("report.md");
    std::fs::write(&md_path, &md)?;
    let svg = crate::views::flame::render(&rec, &sel, false)?;
    let svg_path = out_dir.join("flame.svg");
    std::fs::write(&svg_path, svg)?;
    let off = crate::views::flame::render(&rec, &sel, true)?;
    let off_path = out_dir.join("flame-offcpu.svg");
    std::fs::write(&off_path, off)?;
    println!("{}", String::from_utf8_lossy(&md));
    println!(
        "\n== written: {} (recording), {} (report), {} (on-CPU flamegraph), {} (off-CPU flamegraph)",
        rec_path.display(),
        md_path.display(),
        svg_path.display(),
        off_path.display()
    );
    Ok(())
}
