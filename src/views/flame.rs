//! Flamegraph SVG (inferno), on-CPU time or off-CPU time, one tower per process and thread.

use anyhow::Context;
use inferno::flamegraph::{self, color, Options};

use super::folded::{self, Measure};
use super::{format_utc, process_label, secs, Selection, PARTIAL_FRAME, PREEMPTED_FRAME};
use crate::record::Recording;

/// Synthetic frames get fixed colours so they stand out from the Python frames around them.
fn palette(rec: &Recording, sel: &Selection) -> color::PaletteMap {
    let rgb = |r, g, b| color::Color { r, g, b };
    let mut m = color::PaletteMap::default();
    m.insert("[native]", rgb(110, 160, 230));
    m.insert("[kernel]", rgb(240, 140, 40));
    m.insert("[gc]", rgb(90, 190, 90));
    m.insert(PARTIAL_FRAME, rgb(190, 190, 190));
    m.insert(PREEMPTED_FRAME, rgb(220, 90, 90));
    for pid in sel.pids() {
        m.insert(process_label(rec, pid), rgb(200, 200, 200));
    }
    for (pid, tid) in sel.threads() {
        m.insert(super::thread_label(rec, pid, tid), rgb(215, 215, 215));
    }
    m
}

/// Title and subtitle: what, where, when.
fn titles(rec: &Recording, sel: &Selection, offcpu: bool, total_ns: u64) -> (String, String) {
    let pids = sel.pids();
    let mut targets: Vec<String> = pids
        .iter()
        .take(4)
        .map(|&p| process_label(rec, p))
        .collect();
    if pids.len() > 4 {
        targets.push(format!("+{} more", pids.len() - 4));
    }
    let what = if offcpu { "Off-CPU" } else { "On-CPU" };
    let title = format!("{what} time: {}", targets.join(", "));
    let samples = sel.samples(rec).count();
    let intervals = sel.offcpu(rec).count();
    let mut sub = format!(
        "{:.1} s recorded, {}, {:.3} s {}, {} backend at {} Hz, {}",
        secs(rec.duration_ns()),
        if offcpu {
            format!("{intervals} off-CPU intervals")
        } else {
            format!("{samples} samples")
        },
        secs(total_ns),
        if offcpu { "off CPU" } else { "on CPU" },
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

/// Render the flamegraph. Widths are time: on-CPU sample weights, or off-CPU interval
/// durations with `offcpu`. Fails when there is nothing to draw.
pub fn render(rec: &Recording, sel: &Selection, offcpu: bool) -> anyhow::Result<Vec<u8>> {
    let measure = if offcpu {
        Measure::OffCpuNs
    } else {
        Measure::OnCpuNs
    };
    let stacks = folded::stacks(rec, sel, measure);
    let total: u64 = stacks.values().sum();
    if total == 0 {
        anyhow::bail!(
            "nothing to draw: {} {} for {}{}",
            if offcpu {
                sel.offcpu(rec).count()
            } else {
                sel.samples(rec).count()
            },
            if offcpu {
                "off-CPU intervals with time"
            } else {
                "on-CPU samples with weight"
            },
            sel.description(),
            if offcpu {
                ""
            } else {
                " (try --offcpu for time spent waiting)"
            }
        );
    }
    let lines: Vec<String> = stacks.iter().map(|(s, n)| format!("{s} {n}")).collect();
    let (title, subtitle) = titles(rec, sel, offcpu, total);
    let mut palette = palette(rec, sel);
    let mut opt = Options::default();
    opt.title = title;
    opt.subtitle = Some(subtitle);
    // Counts are ns; tooltips show µs.
    opt.count_name = "µs".into();
    opt.factor = 1e-3;
    opt.hash = true;
    opt.deterministic = true;
    opt.colors = if offcpu {
        color::Palette::Basic(color::BasicPalette::Io)
    } else {
        color::Palette::Basic(color::BasicPalette::Hot)
    };
    opt.palette_map = Some(&mut palette);
    let mut svg = Vec::new();
    flamegraph::from_lines(&mut opt, lines.iter().map(String::as_str), &mut svg)
        .context("drawing the flamegraph")?;
    Ok(svg)
}
