//! Print what a recording holds, record kind by kind: `cargo run --example inspect FILE.esrec`.
//! A debugging aid for the recording format, independent of the views.

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: inspect FILE.esrec"))?;
    let r = enginescope::record::read_recording(std::path::Path::new(&path))?;
    println!(
        "backend {} rate {} Hz, duration {:.3} s, truncated {}",
        r.meta.backend,
        r.meta.rate_hz,
        r.duration_ns() as f64 / 1e9,
        r.truncated
    );
    println!(
        "processes {} threads {} frames {} stacks {}",
        r.processes.len(),
        r.threads.len(),
        r.frames.len(),
        r.stacks.len()
    );
    println!(
        "samples {} off-CPU intervals {} GIL waits {} GC pauses {}",
        r.samples.len(),
        r.offcpu.len(),
        r.gil_waits.len(),
        r.gc_pauses.len()
    );
    let mut by_gen = std::collections::BTreeMap::<i8, (u64, u64, u64)>::new();
    for g in &r.gc_pauses {
        let e = by_gen.entry(g.generation).or_default();
        e.0 += 1;
        e.1 += g.dur_ns;
        e.2 = e.2.max(g.dur_ns);
    }
    for (g, (n, tot, max)) in by_gen {
        println!(
            "  GC gen {g}: {n} pauses, {:.3} ms total, max {:.3} ms",
            tot as f64 / 1e6,
            max as f64 / 1e6
        );
    }
    let mut by_tid = std::collections::BTreeMap::<i32, (u64, u64)>::new();
    for w in r.gil_waits.iter().filter(|w| !w.switch_wait) {
        let e = by_tid.entry(w.tid).or_default();
        e.0 += 1;
        e.1 += w.dur_ns;
    }
    for (tid, (n, tot)) in by_tid {
        println!(
            "  GIL waits of {tid} ({}): {n}, {:.3} ms",
            r.thread_name(r.processes.first().map(|p| p.pid).unwrap_or(0), tid),
            tot as f64 / 1e6
        );
    }
    for (k, v) in &r.counters {
        println!("  {k} = {v}");
    }
    Ok(())
}
