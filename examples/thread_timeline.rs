//! A thread's samples (innermost frame, flags) and off-CPU intervals in a time range:
//! `cargo run --example thread_timeline FILE.esrec TID FROM_S TO_S` (seconds since the
//! recording's start); `... FILE.esrec partial`: per thread, samples whose stack could not be
//! read whole. A debugging aid for the stall and probe views.

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 2 || (a[1] != "partial" && a.len() < 4) {
        anyhow::bail!("usage: thread_timeline FILE.esrec (TID FROM_S TO_S | partial)");
    }
    let r = enginescope::record::read_recording(std::path::Path::new(&a[0]))?;
    if a[1] == "partial" {
        // Per thread: samples, partial samples, partial samples with no Python frame.
        let mut by = std::collections::BTreeMap::<i32, (u64, u64, u64)>::new();
        for s in &r.samples {
            let e = by.entry(s.tid).or_default();
            e.0 += 1;
            if s.flags & enginescope::record::flags::PARTIAL != 0 {
                e.1 += 1;
                if r.stack_frames(s.stack).next().is_none() {
                    e.2 += 1;
                    println!(
                        "tid {} empty partial sample at {:.6}",
                        s.tid,
                        s.t_ns as f64 / 1e9
                    );
                }
            }
        }
        for (tid, (n, p, e)) in by {
            println!("tid {tid}: {n} samples, {p} partial, {e} partial and empty");
        }
        return Ok(());
    }
    let tid: i32 = a[1].parse()?;
    let from = (a[2].parse::<f64>()? * 1e9) as u64;
    let to = (a[3].parse::<f64>()? * 1e9) as u64;
    let mut ev: Vec<(u64, String)> = Vec::new();
    for s in r
        .samples
        .iter()
        .filter(|s| s.tid == tid && s.t_ns >= from && s.t_ns < to)
    {
        let inner = r
            .stack_frames(s.stack)
            .next()
            .map(|f| format!("{} ({}:{})", f.function, f.file, f.line.unwrap_or(0)))
            .unwrap_or_else(|| "<no Python frame>".into());
        ev.push((
            s.t_ns,
            format!("sample w={} flags={:#x} {}", s.weight_ns, s.flags, inner),
        ));
    }
    for o in r
        .offcpu
        .iter()
        .filter(|o| o.tid == tid && o.start_ns + o.dur_ns >= from && o.start_ns < to)
    {
        let inner = r
            .stack_frames(o.stack)
            .next()
            .map(|f| format!("{} ({})", f.function, f.file))
            .unwrap_or_else(|| "<no Python frame>".into());
        ev.push((
            o.start_ns,
            format!(
                "{} {:.3} ms at {}",
                if o.preempted { "preempted" } else { "blocked" },
                o.dur_ns as f64 / 1e6,
                inner
            ),
        ));
    }
    for g in r
        .gil_waits
        .iter()
        .filter(|g| g.tid == tid && g.start_ns >= from && g.start_ns < to)
    {
        ev.push((
            g.start_ns,
            format!("GIL wait {:.3} ms", g.dur_ns as f64 / 1e6),
        ));
    }
    ev.sort();
    for (t, s) in ev {
        println!("{:.6} {s}", t as f64 / 1e9);
    }
    Ok(())
}
