//! Drawing: [`view`] draws one frame from the dashboard's state and nothing else (no I/O, no
//! clock), so tests draw into ratatui's `TestBackend` and read the cells.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Block, Borders, Cell, Clear, HighlightSpacing, Paragraph, Row as TRow, Table, TableState,
};
use ratatui::Frame;

use super::app::{Row, SortKey, Ui, View, TABS};
use super::model::{EngineMetrics, MetricView, ProcessRow, Snapshot, Stats, ThreadRow};
use crate::estimate::larger_side;

/// Where the data comes from and how fast it is drawn: the header line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Header {
    /// `live pid 123,456` or `replay run.esrec`.
    pub source: String,
    pub backend: String,
    pub rate_hz: u32,
    /// Replay only: speed and the recording's length.
    pub replay: Option<(f64, u64)>,
    /// Time to draw the last frame and to take in the last batch of events, ms.
    pub frame_ms: f64,
    pub update_ms: f64,
}

/// Everything a frame shows.
#[derive(Debug, Clone, Default)]
pub struct App {
    pub ui: Ui,
    pub snap: Snapshot,
    pub header: Header,
}

pub fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// `850 µs`, `12.3 ms`, `1.50 s`.
pub fn dur(ns: u64) -> String {
    let (unit, scale, prec) = dur_unit(ns as f64);
    format!("{:.prec$} {unit}", ns as f64 / scale)
}

/// The unit a duration of `ns` is shown in: its name, ns per unit, decimals.
fn dur_unit(ns: f64) -> (&'static str, f64, usize) {
    if ns < 1e3 {
        ("ns", 1.0, 0)
    } else if ns < 1e6 {
        ("µs", 1e3, 0)
    } else if ns < 1e9 {
        ("ms", 1e6, 1)
    } else {
        ("s", 1e9, 2)
    }
}

/// A duration with the larger side of its 95% interval (`[lo, hi]`, ms) in the same unit:
/// `2.4 ms ±0.3`. Without an interval, as [`dur`].
pub(crate) fn dur_pm(ns: u64, interval_ms: Option<[f64; 2]>) -> String {
    let Some([lo, hi]) = interval_ms else {
        return dur(ns);
    };
    let v = ns as f64;
    let half = larger_side(v, [lo * 1e6, hi * 1e6]);
    let (unit, scale, prec) = dur_unit(v);
    format!("{:.prec$} {unit} ±{:.prec$}", v / scale, half / scale)
}

/// A rate with the larger side of its 95% interval (`[lo, hi]` over `span_s`): `180.3 ±7.2`.
pub(crate) fn rate_pm(per_s: f64, calls: u64, interval: Option<[f64; 2]>) -> String {
    match interval {
        Some(ci) if calls > 0 => {
            let c = calls as f64;
            let half = larger_side(c, ci) * per_s / c;
            format!("{per_s:.1} ±{half:.1}")
        }
        _ => format!("{per_s:.1}"),
    }
}

/// A sparkline as text, the last `width` values, scaled to `max` (to the largest value when
/// `max` is None).
pub(crate) fn spark(values: &[f64], max: Option<f64>, width: usize) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let v = &values[values.len().saturating_sub(width)..];
    let top = max
        .unwrap_or_else(|| v.iter().copied().fold(0.0, f64::max))
        .max(f64::MIN_POSITIVE);
    v.iter()
        .map(|&x| {
            if !x.is_finite() || x <= 0.0 {
                ' '
            } else {
                let i = ((x / top) * 7.0).round().clamp(0.0, 7.0) as usize;
                BARS[i]
            }
        })
        .collect()
}

fn function_label(function: &str, file: &str) -> String {
    let f = crate::views::short_file(file);
    if f.is_empty() {
        function.to_string()
    } else {
        format!("{function} ({f})")
    }
}

/// Draw one frame.
pub fn view(f: &mut Frame, app: &App) {
    let [header, findings, tabs, body, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(f.area());
    draw_header(f, header, app);
    draw_findings(f, findings, app);
    draw_tabs(f, tabs, app);
    match app.ui.view {
        View::Threads if app.ui.detail => draw_detail(f, body, app),
        View::Threads => draw_threads(f, body, app),
        View::Metrics => draw_metrics(f, body, app),
        View::Latency => draw_latency(f, body, app),
    }
    draw_status(f, status, app);
    if app.ui.help {
        draw_help(f, f.area(), app);
    }
}

fn draw_header(f: &mut Frame, area: Rect, app: &App) {
    let h = &app.header;
    let s = &app.snap;
    let mut spans = vec![
        Span::styled(" enginescope top ", Style::new().bold().reversed()),
        Span::raw(format!(" {} ", h.source)),
        Span::raw(format!(
            "│ {} {} Hz │ window {:.1} s │ ",
            if h.backend.is_empty() {
                "?"
            } else {
                &h.backend
            },
            h.rate_hz,
            s.wall_ns as f64 / 1e9
        )),
    ];
    match h.replay {
        Some((speed, len)) => spans.push(Span::raw(format!(
            "t {:.1} / {:.1} s │ {speed}x │ ",
            s.now_ns as f64 / 1e9,
            len as f64 / 1e9
        ))),
        None => spans.push(Span::raw(format!("t {:.1} s │ ", s.now_ns as f64 / 1e9))),
    }
    if let Some(c) = &s.cost {
        // What watching costs the targets, so far: the figure a user weighs the rest against.
        spans.push(Span::raw(format!(
            "cost {:.2}% CPU{} │ ",
            c.share_of_cpu * 100.0,
            if c.bpf_timed { "" } else { " (BPF untimed)" }
        )));
    }
    spans.push(Span::styled(
        format!("frame {:.1} ms, update {:.1} ms ", h.frame_ms, h.update_ms),
        Style::new().dim(),
    ));
    if app.ui.paused {
        spans.push(Span::styled(
            " PAUSED ",
            Style::new().bold().fg(Color::Black).bg(Color::Yellow),
        ));
    }
    if let Some(r) = &s.ended {
        spans.push(Span::styled(
            format!(" recording ended: {r} "),
            Style::new().fg(Color::Yellow),
        ));
    }
    f.render_widget(Line::from(spans), area);
}

/// The window's top finding (the report's kinds that its sums carry), and how many more.
fn draw_findings(f: &mut Frame, area: Rect, app: &App) {
    let s = &app.snap;
    // Under a filter, the findings of the threads it lists (a process's, by its name).
    let shown: Vec<&crate::views::findings::Finding> = s
        .findings
        .iter()
        .filter(|f| {
            app.ui.filter.as_ref().is_none_or(|n| {
                n.matches(&f.thread) || s.process(f.pid).is_some_and(|p| n.matches(&p.name))
            })
        })
        .collect();
    let line = match shown.first() {
        Some(top) => {
            let mut spans = vec![
                Span::styled(
                    format!(" {} {:.1}% ", top.kind, top.score * 100.0),
                    Style::new().bold().fg(Color::Black).bg(Color::LightRed),
                ),
                Span::raw(format!(" {}", top.verdict)),
            ];
            if shown.len() > 1 {
                spans.push(Span::styled(
                    format!("  (+{} more: enginescope report)", shown.len() - 1),
                    Style::new().dim(),
                ));
            }
            Line::from(spans)
        }
        None => Line::from(Span::styled(
            " no finding over the window (GIL waits, GC, polling under their thresholds)",
            Style::new().dim(),
        )),
    };
    f.render_widget(line, area);
}

fn draw_tabs(f: &mut Frame, area: Rect, app: &App) {
    let mut spans = vec![Span::raw(" ")];
    for (i, v) in TABS.iter().enumerate() {
        if i > 0 {
            spans.push(Span::raw(" │ "));
        }
        let st = if *v == app.ui.view {
            Style::new().bold().underlined().fg(Color::Cyan)
        } else {
            Style::new()
        };
        spans.push(Span::styled(v.title(), st));
    }
    if app.ui.view == View::Threads && app.ui.detail {
        if let Some((_, t)) = app.ui.detail_thread(&app.snap) {
            spans.push(Span::raw(format!(" › {} (tid {})", t.name, t.tid)));
        }
    }
    spans.push(Span::raw("    "));
    spans.push(Span::styled(
        format!(
            "sort: {} {}",
            app.ui.sort.label(),
            if app.ui.ascending { "▲" } else { "▼" }
        ),
        Style::new().dim(),
    ));
    if let Some(flt) = &app.ui.filter {
        spans.push(Span::styled(
            format!("  filter: {}", flt.text),
            Style::new().fg(Color::Magenta),
        ));
    }
    if app.ui.hide_idle {
        spans.push(Span::styled(
            "  idle hidden",
            Style::new().fg(Color::Magenta),
        ));
    }
    f.render_widget(Line::from(spans), area);
}

fn draw_status(f: &mut Frame, area: Rect, app: &App) {
    let line = if let Some(text) = &app.ui.input {
        Line::from(vec![
            Span::styled(
                "filter (regex or text, Enter applies, Esc cancels): /",
                Style::new().bold(),
            ),
            Span::raw(text.clone()),
            Span::styled("█", Style::new().slow_blink()),
        ])
    } else {
        let mut spans = Vec::new();
        if !app.ui.status.is_empty() {
            spans.push(Span::styled(
                format!("{}  ", app.ui.status),
                Style::new().fg(Color::Green),
            ));
        }
        spans.push(Span::styled(
            "q quit  ? help  Tab view  ↑↓ select  Enter detail  s sort  / filter  f flamegraph  p pause",
            Style::new().dim(),
        ));
        Line::from(spans)
    };
    f.render_widget(line, area);
}

/// A thread's or process's figures; `narrow` leaves out off-CPU (see [`NARROW_BELOW`]).
fn stat_cells(s: &Stats, process: bool, narrow: bool) -> Vec<Cell<'static>> {
    let off = if process {
        String::new()
    } else {
        pct(s.offcpu)
    };
    let mut cells = vec![
        Cell::from(pct(s.cpu)),
        Cell::from(pct(s.gil_held)),
        Cell::from(pct(s.gil_wait)),
        Cell::from(pct(s.gc)),
    ];
    if !narrow {
        cells.push(Cell::from(off));
    }
    cells
}

/// Below this many columns the Threads view leaves out its off-CPU and CPU-history columns
/// and narrows the name, so that what each process is doing (its headline, each thread's
/// top function) still shows at 80 columns.
pub(crate) const NARROW_BELOW: u16 = 120;

/// Header of a sortable column, with the sort arrow on the one sorted by.
fn sort_header(ui: &Ui, key: SortKey, label: &str) -> String {
    if ui.sort == key {
        format!("{label}{}", if ui.ascending { "▲" } else { "▼" })
    } else {
        label.to_string()
    }
}

fn thread_top(t: &ThreadRow) -> String {
    if t.idle {
        return "(nothing in the window: blocked since before it, or not running)".into();
    }
    match t.top_self.first() {
        Some(fr) => format!(
            "{} {}",
            function_label(&fr.function, &fr.file),
            pct(fr.self_share)
        ),
        None => String::new(),
    }
}

fn draw_threads(f: &mut Frame, area: Rect, app: &App) {
    let ui = &app.ui;
    // The table's border and header take two rows.
    ui.table_rows
        .set(usize::from(area.height.saturating_sub(2)));
    let rows = ui.rows(&app.snap);
    if rows.is_empty() {
        let msg = if ui.filter.is_some() {
            "No thread or process matches the filter (/ to change it)."
        } else {
            "Waiting for the first samples…"
        };
        f.render_widget(Paragraph::new(msg).block(Block::bordered()), area);
        return;
    }
    let narrow = area.width < NARROW_BELOW;
    let mut head = vec![
        Cell::from("PID/TID"),
        Cell::from(sort_header(ui, SortKey::Name, "NAME")),
        Cell::from(sort_header(ui, SortKey::Cpu, "CPU")),
        Cell::from(sort_header(ui, SortKey::GilHeld, "GIL")),
        Cell::from(sort_header(
            ui,
            SortKey::GilWait,
            if narrow { "WAIT" } else { "GILWAIT" },
        )),
        Cell::from(sort_header(ui, SortKey::Gc, "GC")),
    ];
    if !narrow {
        head.push(Cell::from(sort_header(ui, SortKey::OffCpu, "OFFCPU")));
        head.push(Cell::from("CPU HISTORY"));
    }
    head.push(Cell::from(if narrow {
        "DOING (top function)"
    } else {
        "TOP FUNCTION (self)"
    }));
    let header = TRow::new(head).style(Style::new().bold().underlined());
    let spark_w = 12;
    let table_rows: Vec<TRow> = rows
        .iter()
        .map(|r| match r {
            Row::Group(g) => label_row(
                "engine".into(),
                g.engine.clone().unwrap_or_else(|| g.label.clone()),
                g.label.clone(),
                narrow,
            )
            .style(Style::new().fg(Color::Cyan).bold()),
            Row::Process(p) => process_row(p, &app.snap, narrow),
            Row::Folded(_, f) => label_row(
                String::new(),
                format!(
                    "  +{} {}",
                    f.threads,
                    if f.busy > 0 { "more" } else { "quiet" }
                ),
                format!("{} (x lists them)", f.label(4)),
                narrow,
            )
            .style(Style::new().dim()),
            Row::Thread(_, t) => {
                let mut cells = vec![
                    Cell::from(format!("  {}", t.tid)),
                    Cell::from(format!("  {}", t.name)),
                ];
                cells.extend(stat_cells(&t.stats, false, narrow));
                if !narrow {
                    let h: Vec<f64> = t.cpu_history.iter().map(|&v| v as f64).collect();
                    cells.push(Cell::from(spark(&h, Some(1000.0), spark_w)).fg(Color::Green));
                }
                cells.push(Cell::from(thread_top(t)));
                let row = TRow::new(cells);
                if t.idle {
                    row.style(Style::new().dim())
                } else {
                    row
                }
            }
        })
        .collect();
    let widths: Vec<Constraint> = if narrow {
        vec![
            Constraint::Length(9),
            Constraint::Length(14),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(5),
            Constraint::Fill(1),
        ]
    } else {
        vec![
            Constraint::Length(9),
            Constraint::Length(22),
            Constraint::Length(7),
            Constraint::Length(7),
            Constraint::Length(8),
            Constraint::Length(6),
            Constraint::Length(7),
            Constraint::Length(spark_w as u16),
            Constraint::Fill(1),
        ]
    };
    let table = Table::new(table_rows, widths)
        .header(header)
        .row_highlight_style(Style::new().reversed())
        .highlight_symbol("▶")
        .highlight_spacing(HighlightSpacing::Always)
        .block(Block::new().borders(Borders::TOP));
    let mut state = TableState::default().with_selected(ui.selected_index(&rows));
    f.render_stateful_widget(table, area, &mut state);
}

/// A table row with text in the id, name and last columns only (an engine's heading, a
/// process's folded quiet threads).
fn label_row(id: String, name: String, last: String, narrow: bool) -> TRow<'static> {
    let mut cells = vec![Cell::from(id), Cell::from(name)];
    cells.extend((0..if narrow { 4 } else { 6 }).map(|_| Cell::from("")));
    cells.push(Cell::from(last));
    TRow::new(cells)
}

fn process_row(p: &ProcessRow, snap: &Snapshot, narrow: bool) -> TRow<'static> {
    let mut cells = vec![
        Cell::from(p.pid.to_string()),
        Cell::from(format!("▾ {}", p.name)),
    ];
    cells.extend(stat_cells(&p.stats, true, narrow));
    if !narrow {
        cells.push(Cell::from(""));
    }
    // What it is doing first (the line is cut at the terminal's width), then what it is.
    cells.push(Cell::from(
        match super::app::process_headline(p, snap, narrow) {
            Some(h) => format!("{h} · {} threads  {}", p.threads.len(), p.cmdline),
            None => format!("{} threads  {}", p.threads.len(), p.cmdline),
        },
    ));
    TRow::new(cells).style(Style::new().bold().fg(Color::Yellow))
}

fn draw_detail(f: &mut Frame, area: Rect, app: &App) {
    let Some((p, t)) = app.ui.detail_thread(&app.snap) else {
        f.render_widget(
            Paragraph::new("No thread selected (Esc goes back).").block(Block::bordered()),
            area,
        );
        return;
    };
    let [summary, funcs, bottom] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Min(6),
        Constraint::Length(9),
    ])
    .areas(area);
    draw_detail_summary(f, summary, p, t);
    draw_detail_functions(f, funcs, t);
    let [blame, gc] =
        Layout::horizontal([Constraint::Percentage(62), Constraint::Percentage(38)]).areas(bottom);
    draw_detail_blame(f, blame, t);
    draw_detail_gc(f, gc, p);
}

/// The detail view's first lines: the thread, its shares of the window, its CPU history.
fn draw_detail_summary(f: &mut Frame, area: Rect, p: &ProcessRow, t: &ThreadRow) {
    let s = &t.stats;
    let h: Vec<f64> = t.cpu_history.iter().map(|&v| v as f64).collect();
    let lines = vec![
        Line::from(vec![
            Span::styled(format!("{} (tid {})", t.name, t.tid), Style::new().bold()),
            Span::raw(format!("  in {} (pid {})", p.name, p.pid)),
        ]),
        Line::from(format!(
            "CPU {} (native {})  GIL held {}  GIL wait {} ({} waits)  switch wait {}  GC {} ({} pauses)  off-CPU {}  {} samples",
            pct(s.cpu),
            pct(s.native),
            pct(s.gil_held),
            pct(s.gil_wait),
            s.gil_waits,
            pct(s.switch_wait),
            pct(s.gc),
            s.gc_pauses,
            pct(s.offcpu),
            s.samples
        )),
        Line::from(vec![
            Span::raw("CPU history "),
            Span::styled(
                spark(&h, Some(1000.0), area.width.saturating_sub(14) as usize),
                Style::new().fg(Color::Green),
            ),
        ]),
    ];
    f.render_widget(
        Paragraph::new(lines).block(Block::new().borders(Borders::TOP)),
        area,
    );
}

/// The detail view's two function tables: self time and total time.
fn draw_detail_functions(f: &mut Frame, area: Rect, t: &ThreadRow) {
    let [left, right] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(area);
    let fn_table = |title: &str, rows: Vec<TRow<'static>>, head: [&'static str; 3]| {
        Table::new(
            rows,
            [
                Constraint::Length(7),
                Constraint::Length(9),
                Constraint::Fill(1),
            ],
        )
        .header(TRow::new(head.to_vec()).style(Style::new().bold().underlined()))
        .block(Block::bordered().title(title.to_string()))
    };
    let self_rows = t
        .top_self
        .iter()
        .map(|r| {
            TRow::new(vec![
                pct(r.self_share),
                dur(r.self_ns),
                function_label(&r.function, &r.file),
            ])
        })
        .collect();
    f.render_widget(
        fn_table(
            "Top functions: self (innermost)",
            self_rows,
            ["SELF", "TIME", "FUNCTION"],
        ),
        left,
    );
    let total_rows = t
        .top_total
        .iter()
        .map(|r| {
            TRow::new(vec![
                pct(r.total_share),
                dur(r.total_ns),
                function_label(&r.function, &r.file),
            ])
        })
        .collect();
    f.render_widget(
        fn_table(
            "Top functions: total (on the stack)",
            total_rows,
            ["TOTAL", "TIME", "FUNCTION"],
        ),
        right,
    );
}

/// The detail view's GIL blame: who held the GIL while the thread waited.
fn draw_detail_blame(f: &mut Frame, area: Rect, t: &ThreadRow) {
    let s = &t.stats;
    let blame_rows: Vec<TRow> = t
        .blame
        .iter()
        .map(|b| {
            let holder = if b.holder_tid == 0 {
                "-".to_string()
            } else {
                format!("{} ({})", b.holder, b.holder_tid)
            };
            TRow::new(vec![
                holder,
                function_label(&b.function, &b.file),
                dur(b.wait_ns),
                b.waits.to_string(),
                pct(b.share),
            ])
        })
        .collect();
    let blame_title = format!(
        "GIL blame: who held the GIL while {} waited ({} in the window)",
        t.name,
        pct(s.gil_wait)
    );
    if blame_rows.is_empty() {
        f.render_widget(
            Paragraph::new("no GIL waits in the window")
                .block(Block::bordered().title(blame_title)),
            area,
        );
    } else {
        f.render_widget(
            Table::new(
                blame_rows,
                [
                    Constraint::Length(25),
                    Constraint::Fill(1),
                    Constraint::Length(9),
                    Constraint::Length(6),
                    Constraint::Length(6),
                ],
            )
            .header(
                TRow::new(vec!["HOLDER", "RUNNING", "WAIT", "WAITS", "SHARE"])
                    .style(Style::new().bold().underlined()),
            )
            .block(Block::bordered().title(blame_title)),
            area,
        );
    }
}

/// The detail view's GC pauses of the thread's process.
fn draw_detail_gc(f: &mut Frame, area: Rect, p: &ProcessRow) {
    let gc_rows: Vec<TRow> =
        p.gc.iter()
            .map(|g| {
                TRow::new(vec![
                    if g.generation < 0 {
                        "?".to_string()
                    } else {
                        g.generation.to_string()
                    },
                    g.pauses.to_string(),
                    dur(g.total_ns),
                    dur(g.max_ns),
                    pct(g.share),
                ])
            })
            .collect();
    let gc_title = format!("GC pauses in {} (pid {})", p.name, p.pid);
    if gc_rows.is_empty() {
        f.render_widget(
            Paragraph::new("no collections in the window").block(Block::bordered().title(gc_title)),
            area,
        );
    } else {
        f.render_widget(
            Table::new(
                gc_rows,
                [
                    Constraint::Length(4),
                    Constraint::Length(7),
                    Constraint::Length(9),
                    Constraint::Length(9),
                    Constraint::Fill(1),
                ],
            )
            .header(
                TRow::new(vec!["GEN", "PAUSES", "TOTAL", "MAX", "SHARE"])
                    .style(Style::new().bold().underlined()),
            )
            .block(Block::bordered().title(gc_title)),
            area,
        );
    }
}

fn metric_line(
    label: &str,
    m: &MetricView,
    fmt: fn(f64) -> String,
    max: Option<f64>,
    w: usize,
) -> Line<'static> {
    let now = m.now.map(fmt).unwrap_or_else(|| "-".into());
    Line::from(vec![
        Span::raw(format!("{label:<22}")),
        Span::styled(format!("{now:>10}  "), Style::new().bold()),
        Span::styled(spark(&m.history, max, w), Style::new().fg(Color::Green)),
    ])
}

/// A gauge's line: its last value, its mean and max over the window, then its sparkline.
fn gauge_line(label: &str, m: &MetricView, w: usize) -> Line<'static> {
    let now = m.now.map_or("-".into(), |v| format!("{v:.0}"));
    let over = m.window_mean_max().map_or(String::new(), |(mean, max)| {
        format!("mean {mean:.1}, max {max:.0}")
    });
    Line::from(vec![
        Span::raw(format!("{label:<22}")),
        Span::styled(format!("{now:>10}  "), Style::new().bold()),
        Span::raw(format!("{over:<22}")),
        Span::styled(
            spark(&m.history, None, w.saturating_sub(22)),
            Style::new().fg(Color::Green),
        ),
    ])
}

fn engine_block(e: &EngineMetrics, width: u16) -> Paragraph<'static> {
    let w = width.saturating_sub(38) as usize;
    let mut lines = vec![
        metric_line(
            "generation tokens/s",
            &e.gen_tokens_per_s,
            |v| format!("{v:.1}"),
            None,
            w,
        ),
        metric_line("KV cache usage", &e.kv_cache, pct, Some(1.0), w),
        gauge_line("requests running", &e.running, w),
        gauge_line("requests waiting", &e.waiting, w),
        {
            let ([t50, t90, _], [_, p90, _]) = (e.ttft.shown(0), e.tpot.shown(0));
            Line::from(vec![
                Span::raw(format!("{:<22}", "TTFT p50 / p90 ms")),
                Span::styled(
                    format!("{:>10}  ", format!("{t50} / {t90}")),
                    Style::new().bold(),
                ),
                Span::raw(format!("{:<20}", "TPOT mean / p90 ms")),
                Span::styled(
                    format!("{} / {p90}", tpot_mean_cell(e)),
                    Style::new().bold(),
                ),
            ])
        },
    ];
    if let Some(err) = &e.scrape_error {
        lines.push(Line::styled(
            format!("last scrape failed: {err}"),
            Style::new().fg(Color::Red),
        ));
    }
    let title = if e.metrics_url.is_empty() {
        format!("engine {}", e.engine)
    } else {
        format!("engine {} ({})", e.engine, e.metrics_url)
    };
    Paragraph::new(lines).block(Block::bordered().title(title))
}

/// The window's mean time per output token, ms (`-` without finished requests).
fn tpot_mean_cell(e: &EngineMetrics) -> String {
    e.tpot.mean.map_or("-".into(), |m| format!("{m:.1}"))
}

/// From this many engines the Metrics view is one table row per engine (the fleet view).
pub(crate) const FLEET_TABLE_FROM: usize = 3;

/// One row per engine: throughput with its trend, KV usage, running, waiting, scrape
/// coverage; sorted by the fleet sort column (`s`/`S`, `r` reverses).
fn draw_fleet(f: &mut Frame, area: Rect, app: &App) {
    let rows = app.ui.fleet_rows(&app.snap);
    let spark_w = area.width.saturating_sub(90).clamp(8, 40) as usize;
    let gen_max = rows
        .iter()
        .filter_map(|e| e.gen_tokens_per_s.history.iter().copied().reduce(f64::max))
        .reduce(f64::max);
    let num = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |x| format!("{x:.prec$}"));
    let body: Vec<TRow> = rows
        .iter()
        .map(|e| {
            let cov = super::app::coverage(e);
            let cov_cell = Cell::from(cov.map_or("-".to_string(), pct)).style(
                if cov.is_some_and(|c| c < 0.95) {
                    Style::new().fg(Color::Red).bold()
                } else {
                    Style::new()
                },
            );
            TRow::new(vec![
                Cell::from(e.engine.clone()),
                Cell::from(num(e.gen_tokens_per_s.now, 1)),
                Cell::from(spark(&e.gen_tokens_per_s.history, gen_max, spark_w))
                    .style(Style::new().fg(Color::Green)),
                Cell::from(e.kv_cache.now.map_or("-".to_string(), pct)),
                Cell::from(num(e.running.now, 0)),
                Cell::from(num(e.waiting.now, 0)),
                Cell::from(e.ttft.shown(0)[1].clone()),
                Cell::from(tpot_mean_cell(e)),
                cov_cell,
            ])
        })
        .collect();
    let sort = format!(
        "sort: {} {} (s/S, r)",
        app.ui.fleet_sort.label(),
        if app.ui.ascending { "↑" } else { "↓" }
    );
    let table = Table::new(
        body,
        [
            Constraint::Length(16),
            Constraint::Length(10),
            Constraint::Length(spark_w as u16),
            Constraint::Length(7),
            Constraint::Length(8),
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Length(9),
            Constraint::Length(11),
        ],
    )
    .header(
        TRow::new(vec![
            "ENGINE",
            "GEN TOK/S",
            "TREND",
            "KV",
            "RUNNING",
            "WAITING",
            "TTFT P90",
            "TPOT ms",
            "SCRAPES OK",
        ])
        .style(Style::new().bold().underlined()),
    )
    .block(Block::bordered().title(format!("Fleet: {} engines, {sort}", rows.len())));
    f.render_widget(table, area);
}

fn draw_metrics(f: &mut Frame, area: Rect, app: &App) {
    let engines = &app.snap.engines;
    if engines.is_empty() {
        f.render_widget(
            Paragraph::new(
                "No engine metrics in this recording: metrics are scraped from vLLM's /metrics \
                 when the engine is known (top --vllm).",
            )
            .block(Block::bordered().title("Metrics")),
            area,
        );
        return;
    }
    if engines.len() > FLEET_TABLE_FROM - 1 {
        draw_fleet(f, area, app);
        return;
    }
    let heights: Vec<Constraint> = engines
        .iter()
        .map(|e| Constraint::Length(if e.scrape_error.is_some() { 8 } else { 7 }))
        .chain(std::iter::once(Constraint::Min(0)))
        .collect();
    let areas = Layout::vertical(heights).split(area);
    for (e, a) in engines.iter().zip(areas.iter()) {
        f.render_widget(engine_block(e, a.width), *a);
    }
}

fn draw_latency(f: &mut Frame, area: Rect, app: &App) {
    let ui = &app.ui;
    let mut rows: Vec<_> = app
        .snap
        .latency
        .iter()
        .filter(|r| {
            ui.filter.as_ref().is_none_or(|flt| {
                flt.matches(&r.thread)
                    || flt.matches(&r.function)
                    || app
                        .snap
                        .process(r.pid)
                        .is_some_and(|p| flt.matches(&p.name))
            })
        })
        .collect();
    if rows.is_empty() {
        f.render_widget(
            Paragraph::new(
                "No probed function calls in the window (record --probe FILE:FUNCTION).",
            )
            .block(Block::bordered().title("Function latency")),
            area,
        );
        return;
    }
    rows.sort_by(|a, b| {
        b.p99_ns
            .cmp(&a.p99_ns)
            .then((a.probe, a.tid).cmp(&(b.probe, b.tid)))
    });
    // Room for the ± of estimates only where a row has them, and for the longest method
    // (`exact, 23% of the window` says what share the figures come from: never cut).
    let estimates = rows.iter().any(|r| r.interval.is_some());
    let method_width = rows
        .iter()
        .map(|r| r.method.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(6, 32) as u16;
    let table_rows: Vec<TRow> = rows
        .iter()
        .map(|r| {
            TRow::new(vec![
                r.function.clone(),
                format!("{} ({})", r.thread, r.tid),
                r.method.clone(),
                // A probe watched for part of the window: its estimates say how sure they
                // are (± the larger side of the 95% interval, as `report` prints it).
                rate_pm(r.calls_per_s, r.calls, r.interval.as_ref().map(|u| u.calls)),
                dur_pm(r.p50_ns, r.interval.as_ref().map(|u| u.p50_ms)),
                dur_pm(r.p90_ns, r.interval.as_ref().map(|u| u.p90_ms)),
                dur(r.p99_ns),
                dur(r.max_ns),
            ])
        })
        .collect();
    f.render_widget(
        Table::new(
            table_rows,
            [
                Constraint::Fill(1),
                Constraint::Length(24),
                Constraint::Length(method_width),
                Constraint::Length(if estimates { 13 } else { 9 }),
                Constraint::Length(if estimates { 15 } else { 9 }),
                Constraint::Length(if estimates { 15 } else { 9 }),
                Constraint::Length(9),
                Constraint::Length(9),
            ],
        )
        .header(
            TRow::new(vec![
                "FUNCTION", "THREAD", "METHOD", "CALLS/S", "P50", "P90", "P99", "MAX",
            ])
            .style(Style::new().bold().underlined()),
        )
        .block(Block::bordered().title("Function latency (slowest p99 first)")),
        area,
    );
}

const HELP: &[(&str, &str)] = &[
    (
        "Tab / Shift-Tab",
        "next / previous view: Threads, Metrics, Latency",
    ),
    ("↑ ↓ j k PgUp PgDn", "select a thread"),
    ("Enter / Esc", "open / close the selected thread's detail"),
    (
        "s / S",
        "sort by the next / previous column (threads: CPU, GIL, GIL wait, GC, off-CPU, name; \
         fleet table: gen tok/s, KV, running, waiting, TTFT p90, TPOT, scrapes ok, engine)",
    ),
    ("r", "reverse the sort order"),
    (
        "/",
        "filter threads by thread or process name (regex or text; empty clears)",
    ),
    (
        "f",
        "save a flamegraph SVG of the window (the shown thread in its detail)",
    ),
    (
        "i",
        "hide / show idle threads (under 0.1% CPU, GIL wait and GC)",
    ),
    (
        "x",
        "list / fold each process's quiet threads (under 0.5% CPU, GIL wait and GC)",
    ),
    ("p / space", "pause / resume the display"),
    ("+ / -", "replay: faster / slower"),
    ("] / [", "replay: jump one window forward / back"),
    ("q / Esc / Ctrl-C", "quit"),
];

fn draw_help(f: &mut Frame, area: Rect, _app: &App) {
    let w = area.width.min(96);
    let h = (HELP.len() as u16 + 6).min(area.height);
    let r = Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    };
    let mut lines: Vec<Line> = HELP
        .iter()
        .map(|(k, d)| {
            Line::from(vec![
                Span::styled(format!("{k:<20}"), Style::new().bold().fg(Color::Cyan)),
                Span::raw(*d),
            ])
        })
        .collect();
    lines.push(Line::raw(""));
    lines.push(Line::styled(
        "Shares are of the window's wall time. CPU and GIL held are sampled; GIL wait, GC and",
        Style::new().add_modifier(Modifier::DIM),
    ));
    lines.push(Line::styled(
        "off-CPU are exact intervals, counted once the recorder has written them (a thread",
        Style::new().add_modifier(Modifier::DIM),
    ));
    lines.push(Line::styled(
        "still blocked shows its wait when it wakes). A process row sums its threads.",
        Style::new().add_modifier(Modifier::DIM),
    ));
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(" help (? or Esc closes) ")),
        r,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::synth::*;
    use crate::record::{MetricPoint, MetricSeries};
    use crate::tui::app::NameFilter;
    use crate::tui::model::{snapshot, Topology};
    use crate::tui::window::Window;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    /// An estimate's figures carry ± the larger side of their interval, in their own unit.
    #[test]
    fn estimates_carry_their_error_bars() {
        assert_eq!(dur_pm(2_400_000, Some([2.35, 2.47])), "2.4 ms ±0.1");
        assert_eq!(dur_pm(103_000, Some([0.094, 0.110])), "103 µs ±9");
        assert_eq!(dur_pm(2_400_000, None), dur(2_400_000));
        // 14,000 calls +-600 over a window where they came at 180/s: +-7.7/s.
        assert_eq!(
            rate_pm(180.0, 14_000, Some([13_400.0, 14_500.0])),
            "180.0 ±7.7"
        );
        assert_eq!(rate_pm(180.0, 14_000, None), "180.0");
    }

    /// The screen as text, one string per row.
    fn screen(app: &App, w: u16, h: u16) -> Vec<String> {
        let mut t = Terminal::new(TestBackend::new(w, h)).expect("test terminal");
        t.draw(|f| view(f, app)).expect("draw");
        let buf = t.backend().buffer();
        (0..h)
            .map(|y| (0..w).map(|x| buf[(x, y)].symbol().to_string()).collect())
            .collect()
    }

    /// The first row holding `text`, the findings line (row 1) aside.
    fn row_with<'a>(scr: &'a [String], text: &str) -> &'a str {
        scr.iter()
            .enumerate()
            .filter(|(i, _)| *i != 1)
            .map(|(_, l)| l)
            .find(|l| l.contains(text))
            .unwrap_or_else(|| panic!("no row with {text:?}:\n{}", scr.join("\n")))
    }

    /// The GIL-contention shape: a launcher waiting on an aux writer, plus GC, a probe and an
    /// engine with metrics.
    fn app() -> App {
        let mut b = Rec::new()
            .process(1, "/usr/bin/python3.12 serve.py", "EngineCore")
            .thread(1, 2, "launcher")
            .thread(1, 3, "aux-writer");
        let l = b.stack(&["Worker.execute_model", "loop"], "/srv/worker.py");
        let h = b.stack(
            &["AuxOutputStore._evict_to_fit", "AuxOutputStore.put"],
            "/srv/aux.py",
        );
        let probe = b.probe(
            1,
            "worker.py:Worker.execute_model",
            "Worker.execute_model",
            "exact",
        );
        for i in 0..10u64 {
            let t0 = i * 100 * MS;
            b.samples((1, 2), t0, 30, MS, l, GIL);
            b.samples((1, 3), t0 + 30 * MS, 60, MS, h, GIL);
            b.gil_wait(1, 2, t0 + 30 * MS, 50 * MS, 3, h);
            b.call(probe, 1, 2, t0, 40 * MS + i * MS);
        }
        b.gc(1, 3, 500 * MS, 4 * MS, 2);
        b.0.engines.push(crate::record::EngineInfo {
            id: "engine0".into(),
            engine_core_pids: vec![1],
            ..Default::default()
        });
        b.0.series.push(MetricSeries {
            id: 0,
            engine: "engine0".into(),
            name: "vllm:generation_tokens_total".into(),
            kind: "counter".into(),
            ..Default::default()
        });
        b.0.series.push(MetricSeries {
            id: 1,
            engine: "engine0".into(),
            name: "vllm:kv_cache_usage_perc".into(),
            kind: "gauge".into(),
            ..Default::default()
        });
        for k in 0..=4u64 {
            b.0.metrics.push(MetricPoint {
                t_ns: k * 250 * MS,
                series: 0,
                value: 120.0 * k as f64,
            });
            b.0.metrics.push(MetricPoint {
                t_ns: k * 250 * MS,
                series: 1,
                value: 0.42,
            });
        }
        let mut w = Window::new(10 * S, 40, 10 * S);
        w.update(&b.0, S);
        App {
            ui: Ui::default(),
            snap: snapshot(&w, &b.0, &Topology::default()),
            header: Header {
                source: "live pid 1".into(),
                backend: "bpf".into(),
                rate_hz: 999,
                replay: None,
                frame_ms: 1.5,
                update_ms: 0.5,
            },
        }
    }

    #[test]
    fn threads_view() {
        let a = app();
        let scr = screen(&a, 150, 20);
        assert!(
            scr[0].contains("live pid 1 │ bpf 999 Hz │ window 1.0 s │ t 1.0 s"),
            "{}",
            scr[0]
        );
        assert!(scr[0].contains("frame 1.5 ms"));
        assert!(scr[2].contains("Threads │ Metrics │ Latency") && scr[2].contains("sort: CPU ▼"));
        // The top finding under the header, the others counted.
        assert!(
            scr[1].contains("gil_contention 50.0%") && scr[1].contains("launcher (tid 2"),
            "{}",
            scr[1]
        );
        let head = row_with(&scr, "PID/TID");
        assert!(head.contains("CPU▼") && head.contains("GILWAIT") && head.contains("TOP FUNCTION"));
        let engine = row_with(&scr, "engine0");
        assert!(engine.contains("engine0: EngineCore 1"), "{engine}");
        let p = row_with(&scr, "▾ EngineCore");
        assert!(p.contains("90.0%"), "process CPU is the threads' sum: {p}");
        // What the process is doing, on its line: its probe's median call and its busiest
        // thread's top function.
        assert!(
            p.contains("execute_model p50 44.00 ms, 10/s · aux-writer: AuxOutputStore._"),
            "{p}"
        );
        // Busiest first, and selected (▶).
        let aux = row_with(&scr, "aux-writer ");
        assert!(aux.starts_with('▶'), "{aux}");
        assert!(
            aux.contains("60.0%") && aux.contains("AuxOutputStore._evict_to_fit (aux.py) 100.0%")
        );
        let l = row_with(&scr, "launcher");
        // 30% CPU with the GIL, 50% waiting for it.
        assert_eq!(
            l.split_whitespace().take(6).collect::<Vec<_>>(),
            ["2", "launcher", "30.0%", "30.0%", "50.0%", "0.0%"]
        );
        let below_findings = |t: &str| scr.iter().skip(2).position(|r| r.contains(t));
        assert!(below_findings("aux-writer") < below_findings("launcher"));
        assert!(scr[19].contains("q quit"));
        // At 80 columns: no off-CPU or history column, and the process's line still says what
        // it is doing (its probe's median call), each thread its top function.
        let scr = screen(&a, 80, 24);
        let head = row_with(&scr, "PID/TID");
        assert!(head.contains("WAIT") && head.contains("DOING") && !head.contains("OFFCPU"));
        let p = row_with(&scr, "▾ EngineCore");
        assert!(
            p.contains("90.0%") && p.contains("execute_model p50 44.00ms"),
            "{p}"
        );
        let aux = row_with(&scr, "aux-writer ");
        assert!(
            aux.contains("60.0%") && aux.contains("AuxOutputStore._evi"),
            "{aux}"
        );
    }

    /// Three processes with eight busy threads each: at 80x24 every process is on the first
    /// screen, each with its busiest threads and the others folded into a counted row; at
    /// 200x50 every thread shows.
    #[test]
    fn every_process_fits_a_small_screen() {
        let mut b = Rec::new();
        for pid in [10, 20, 30] {
            b = b.process(pid, "python3 app.py", &format!("role{pid}"));
            for k in 1..=8 {
                b = b.thread(pid, pid + k, &format!("t{pid}-{k}"));
            }
        }
        let st = b.stack(&["work", "main"], "/srv/app.py");
        for pid in [10, 20, 30] {
            for k in 1..=8 {
                // 5-12% of the window each: none quiet.
                b.samples((pid, pid + k), 0, 40 + 10 * k as u64, MS, st, 0);
            }
        }
        b.0.samples.sort_by_key(|s| s.t_ns);
        let mut w = Window::new(10 * S, 40, 10 * S);
        w.update(&b.0, S);
        let a = App {
            snap: snapshot(&w, &b.0, &Topology::default()),
            ..app()
        };
        // The first draw learns the table's height; the second fits to it.
        let _ = screen(&a, 80, 24);
        let scr = screen(&a, 80, 24);
        for pid in [10, 20, 30] {
            let p = row_with(&scr, &format!("▾ role{pid}"));
            assert!(p.starts_with(&format!(" {pid}")), "{p}");
            // The busiest thread of each shows.
            row_with(&scr, &format!("t{pid}-8"));
        }
        let folded = row_with(&scr, "more");
        assert!(folded.contains("busy"), "{folded}");
        let a = App {
            ui: Ui::default(),
            ..a
        };
        let _ = screen(&a, 200, 50);
        let scr = screen(&a, 200, 50);
        assert!(!scr.iter().any(|r| r.contains("more")), "{scr:#?}");
        row_with(&scr, "t30-1");
    }

    #[test]
    fn detail_view() {
        let mut a = app();
        a.ui.selected = Some((1, 2));
        a.ui.detail = true;
        let scr = screen(&a, 150, 30);
        assert!(scr[2].contains("› launcher (tid 2)"));
        row_with(&scr, "launcher (tid 2)  in EngineCore (pid 1)");
        let stats = row_with(&scr, "GIL wait 50.0% (10 waits)");
        assert!(
            stats.contains("CPU 30.0%") && stats.contains("300 samples"),
            "{stats}"
        );
        assert!(row_with(&scr, "Top functions: self").contains("Top functions: total"));
        assert!(row_with(&scr, "Worker.execute_model (worker.py)").contains("100.0%"));
        assert!(row_with(&scr, "loop (worker.py)").contains("100.0%"));
        let blame = row_with(&scr, "aux-writer (3)");
        assert!(
            blame.contains("AuxOutputStore._evict_to_fit (aux.py)") && blame.contains("500.0 ms"),
            "{blame}"
        );
        row_with(&scr, "GC pauses in EngineCore (pid 1)");
        let gc = row_with(&scr, "4.0 ms");
        let cells = gc.split('│').rfind(|c| !c.trim().is_empty()).unwrap_or("");
        assert_eq!(
            cells.split_whitespace().collect::<Vec<_>>(),
            ["2", "1", "4.0", "ms", "4.0", "ms", "0.4%"],
            "{gc}"
        );
    }

    #[test]
    fn metrics_view() {
        let mut a = app();
        a.ui.view = View::Metrics;
        let scr = screen(&a, 120, 12);
        row_with(&scr, "engine engine0");
        let gen = row_with(&scr, "generation tokens/s");
        assert!(gen.contains("480.0"), "{gen}");
        // 120 tokens per 250 ms at every step: a flat sparkline.
        assert!(gen.contains("████"), "{gen}");
        assert!(row_with(&scr, "KV cache usage").contains("42.0%"));
        assert!(row_with(&scr, "requests running").contains(" - "));
        let lat = row_with(&scr, "TTFT p50 / p90 ms");
        assert!(lat.contains("TPOT mean / p90 ms"), "{lat}");
        a.snap.engines.clear();
        let scr = screen(&a, 120, 12);
        row_with(&scr, "No engine metrics");
    }

    #[test]
    fn latency_view() {
        let mut a = app();
        a.ui.view = View::Latency;
        let scr = screen(&a, 120, 10);
        let h = row_with(&scr, "FUNCTION");
        assert!(h.contains("CALLS/S") && h.contains("P99"));
        let r = row_with(&scr, "Worker.execute_model");
        // 10 calls of 40..49 ms in 1 s.
        assert_eq!(
            r.trim_matches(|c| c == '│' || c == ' ')
                .split_whitespace()
                .collect::<Vec<_>>(),
            [
                "Worker.execute_model",
                "launcher",
                "(2)",
                "exact",
                "10.0",
                "44.0",
                "ms",
                "48.0",
                "ms",
                "49.0",
                "ms",
                "49.0",
                "ms"
            ]
        );
        // A probe watched for part of the window: its estimates carry their error bars.
        a.snap.latency[0].interval = Some(crate::estimate::Uncertainty {
            calls: [8.0, 12.5],
            p50_ms: [42.0, 45.0],
            p90_ms: [47.0, 49.0],
            method: "phases".into(),
            phases: 5,
        });
        a.snap.latency[0].method = "exact, 23% of the window".into();
        let scr = screen(&a, 140, 10);
        let r = row_with(&scr, "Worker.execute_model");
        // The method whole: the share of the window the figures come from.
        assert!(r.contains("exact, 23% of the window"), "{r}");
        assert!(r.contains("10.0 ±2.5"), "{r}");
        assert!(r.contains("44.0 ms ±2.0"), "{r}");
        assert!(r.contains("48.0 ms ±1.0"), "{r}");
        a.ui.filter = Some(NameFilter::new("nothing-matches"));
        let scr = screen(&a, 120, 10);
        row_with(&scr, "No probed function calls");
    }

    #[test]
    fn help_filter_pause_and_replay_header() {
        let mut a = app();
        a.ui.help = true;
        let scr = screen(&a, 120, 30);
        row_with(&scr, "help (? or Esc closes)");
        assert!(row_with(&scr, "Tab / Shift-Tab").contains("Threads, Metrics, Latency"));
        a.ui.help = false;
        a.ui.input = Some("^work".into());
        a.ui.paused = true;
        a.header.replay = Some((4.0, 30 * S));
        let scr = screen(&a, 150, 12);
        assert!(scr[11].contains("/^work"), "{}", scr[11]);
        assert!(scr[0].contains("PAUSED"));
        assert!(scr[0].contains("t 1.0 / 30.0 s │ 4x"), "{}", scr[0]);
        a.ui.input = None;
        a.ui.filter = Some(NameFilter::new("^aux"));
        let scr = screen(&a, 150, 12);
        assert!(scr[2].contains("filter: ^aux"));
        assert!(scr.iter().all(|r| !r.contains("launcher")));
    }

    #[test]
    fn sparklines_scale_and_keep_the_latest() {
        assert_eq!(spark(&[0.0, 500.0, 1000.0], Some(1000.0), 10), " ▅█");
        assert_eq!(spark(&[1.0, 2.0, 3.0, 4.0], None, 2), "▆█");
        assert_eq!(dur(850_000), "850 µs");
        assert_eq!(dur(12_340_000), "12.3 ms");
        assert_eq!(pct(0.1234), "12.3%");
    }
}
