//! Flamegraph SVG (inferno), one tower per process and thread: on-CPU time, off-CPU time, or
//! GIL blame (the stacks of the threads holding the GIL, weighted by how long others waited
//! for it).

use anyhow::Context;
use inferno::flamegraph::{self, color, Options};

use super::folded::{self, Measure};
use super::gil::{GIL_FREE, RELEASING, UNKNOWN_FUNCTION};
use super::{format_utc, process_label, secs, Selection, PARTIAL_FRAME, PREEMPTED_FRAME};
use crate::record::Recording;

/// What a flamegraph measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlameKind {
    /// On-CPU time (sample weights) by the sampled stack.
    OnCpu,
    /// Off-CPU time (interval durations) by the stack the thread blocked in.
    OffCpu,
    /// Time each selected thread waited for the GIL, by the holder thread and the holder's
    /// stack when the wait began: "what was the holder doing while I waited".
    GilBlame,
}

/// Synthetic frames get fixed colours so they stand out from the Python frames around them.
fn palette(rec: &Recording, sel: &Selection) -> color::PaletteMap {
    let rgb = |r, g, b| color::Color { r, g, b };
    let mut m = color::PaletteMap::default();
    m.insert("[native]", rgb(110, 160, 230));
    m.insert("[kernel]", rgb(240, 140, 40));
    m.insert("[gc]", rgb(90, 190, 90));
    m.insert(PARTIAL_FRAME, rgb(190, 190, 190));
    m.insert(PREEMPTED_FRAME, rgb(220, 90, 90));
    m.insert(GIL_FREE, rgb(140, 200, 140));
    m.insert(RELEASING, rgb(170, 210, 170));
    m.insert(UNKNOWN_FUNCTION, rgb(190, 190, 190));
    for g in sel.gil_waits(rec).filter(|g| g.holder_tid != g.tid) {
        m.insert(
            folded::holder_label(rec, g.pid, g.holder_tid),
            rgb(235, 200, 120),
        );
    }
    for pid in sel.pids() {
        m.insert(process_label(rec, pid), rgb(200, 200, 200));
    }
    for (pid, tid) in sel.threads() {
        m.insert(super::thread_label(rec, pid, tid), rgb(215, 215, 215));
    }
    m
}

/// Title and subtitle: what, where, when.
fn titles(rec: &Recording, sel: &Selection, kind: FlameKind, total_ns: u64) -> (String, String) {
    let pids = sel.pids();
    let mut targets: Vec<String> = pids
        .iter()
        .take(4)
        .map(|&p| process_label(rec, p))
        .collect();
    if pids.len() > 4 {
        targets.push(format!("+{} more", pids.len() - 4));
    }
    let title = match kind {
        FlameKind::OnCpu => format!("On-CPU time: {}", targets.join(", ")),
        FlameKind::OffCpu => format!("Off-CPU time: {}", targets.join(", ")),
        FlameKind::GilBlame => format!(
            "GIL blame: who held the GIL, doing what, while these threads waited: {}",
            targets.join(", ")
        ),
    };
    let (count, what) = match kind {
        FlameKind::OnCpu => (format!("{} samples", sel.samples(rec).count()), "on CPU"),
        FlameKind::OffCpu => (
            format!("{} off-CPU intervals", sel.offcpu(rec).count()),
            "off CPU",
        ),
        FlameKind::GilBlame => (
            format!(
                "{} GIL waits",
                sel.gil_waits(rec).filter(|g| !g.switch_wait).count()
            ),
            "waited for the GIL",
        ),
    };
    let mut sub = format!(
        "{:.1} s recorded, {count}, {:.3} s {what}, {} backend at {} Hz, {}",
        secs(rec.duration_ns()),
        secs(total_ns),
        if rec.meta.backend.is_empty() {
            "unknown"
        } else {
            &rec.meta.backend
        },
        rec.meta.rate_hz,
        format_utc(rec.meta.start_unix_s),
    );
    if !rec.meta.hostname.is_empty() {
        sub.push_str(&format!(" on {}", rec.meta.hostname));
    }
    if sel.is_filtered() {
        sub.push_str(&format!("; {}", sel.description()));
    }
    if rec.truncated || rec.end.is_none() {
        sub.push_str("; recording cut short");
    }
    (title, sub)
}

/// Render the on-CPU (or with `offcpu` the off-CPU) flamegraph; see [`render_kind`].
pub fn render(rec: &Recording, sel: &Selection, offcpu: bool) -> anyhow::Result<Vec<u8>> {
    render_kind(
        rec,
        sel,
        if offcpu {
            FlameKind::OffCpu
        } else {
            FlameKind::OnCpu
        },
    )
}

/// Render a flamegraph. Widths are time: on-CPU sample weights, off-CPU interval durations,
/// or for GIL blame the GIL waits' durations (towers: process, waiting thread, `held by`
/// holder thread, then the holder's stack outermost first). Fails when there is nothing to
/// draw.
pub fn render_kind(rec: &Recording, sel: &Selection, kind: FlameKind) -> anyhow::Result<Vec<u8>> {
    let stacks = match kind {
        FlameKind::OnCpu => folded::stacks(rec, sel, Measure::OnCpuNs),
        FlameKind::OffCpu => folded::stacks(rec, sel, Measure::OffCpuNs),
        FlameKind::GilBlame => folded::gil_blame_stacks(rec, sel),
    };
    let total: u64 = stacks.values().sum();
    if total == 0 {
        match kind {
            FlameKind::OnCpu => anyhow::bail!(
                "nothing to draw: {} on-CPU samples with weight for {} (try --offcpu for time \
                 spent waiting)",
                sel.samples(rec).count(),
                sel.description()
            ),
            FlameKind::OffCpu => anyhow::bail!(
                "nothing to draw: {} off-CPU intervals with time for {}",
                sel.offcpu(rec).count(),
                sel.description()
            ),
            FlameKind::GilBlame => anyhow::bail!(
                "nothing to draw: {} GIL waits with time for {}{}",
                sel.gil_waits(rec).filter(|g| !g.switch_wait).count(),
                sel.description(),
                if rec.gil_waits.is_empty() {
                    " (the recording has no GIL wait records: it was made without GIL tracing)"
                } else {
                    ""
                }
            ),
        }
    }
    let lines: Vec<String> = stacks.iter().map(|(s, n)| format!("{s} {n}")).collect();
    let (title, subtitle) = titles(rec, sel, kind, total);
    let mut palette = palette(rec, sel);
    let mut opt = Options::default();
    opt.title = title;
    opt.subtitle = Some(subtitle);
    // Counts are ns; tooltips show µs.
    opt.count_name = "µs".into();
    opt.factor = 1e-3;
    opt.hash = true;
    opt.deterministic = true;
    opt.colors = color::Palette::Basic(match kind {
        FlameKind::OnCpu => color::BasicPalette::Hot,
        FlameKind::OffCpu => color::BasicPalette::Io,
        FlameKind::GilBlame => color::BasicPalette::Purple,
    });
    opt.palette_map = Some(&mut palette);
    let mut svg = Vec::new();
    flamegraph::from_lines(&mut opt, lines.iter().map(String::as_str), &mut svg)
        .context("drawing the flamegraph")?;
    Ok(svg)
}
