//! Find stretches of a thread's time covered by neither samples nor off-CPU intervals:
//! `cargo run --example gaps FILE.esrec THREAD_NAME`. A debugging aid for the timelines.

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: gaps FILE.esrec THREAD"))?;
    let name = args.next().unwrap_or_default();
    let r = enginescope::record::read_recording(std::path::Path::new(&path))?;
    let tid = r
        .threads
        .iter()
        .find(|t| t.name == name)
        .map(|t| t.tid)
        .ok_or_else(|| anyhow::anyhow!("no thread {name}"))?;
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    for s in r.samples.iter().filter(|s| s.tid == tid) {
        spans.push((s.t_ns.saturating_sub(s.weight_ns as u64), s.t_ns, "sample"));
    }
    for o in r.offcpu.iter().filter(|o| o.tid == tid) {
        spans.push((o.start_ns, o.start_ns + o.dur_ns, "off"));
    }
    spans.sort();
    let mut covered_to = spans.first().map(|s| s.0).unwrap_or(0);
    let mut total_gap = 0;
    for (a, b, k) in &spans {
        if *a > covered_to + 2_000_000 {
            println!(
                "gap {:.3} ms at {:.3} s (before a {k})",
                (*a - covered_to) as f64 / 1e6,
                covered_to as f64 / 1e9
            );
            total_gap += a - covered_to;
        }
        covered_to = covered_to.max(*b);
    }
    println!("total gaps > 2 ms: {:.3} ms", total_gap as f64 / 1e6);
    Ok(())
}
