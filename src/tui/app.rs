//! The dashboard's own state (which view, sort, selection, filter, pause) and what each key
//! does to it. Keys change this state and return a [`Command`] for what the loop must do
//! outside it (quit, save a flamegraph, move the replay clock); nothing here does I/O.

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

use super::model::{EngineMetrics, Group, ProcessRow, Snapshot, Stats, ThreadRow};
use super::window::ThreadKey;
use crate::estimate::larger_side;

/// The views Tab cycles through. A thread's detail opens over `Threads` with Enter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    Threads,
    Metrics,
    Latency,
}

pub(crate) const TABS: [View; 3] = [View::Threads, View::Metrics, View::Latency];

impl View {
    pub fn title(self) -> &'static str {
        match self {
            View::Threads => "Threads",
            View::Metrics => "Metrics",
            View::Latency => "Latency",
        }
    }
}

/// Columns the fleet table (the Metrics view with several engines) sorts by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetSort {
    GenTokens,
    KvCache,
    Running,
    Waiting,
    /// TTFT p90 over the window (slowest first by default).
    TtftP90,
    /// Mean time per output token over the window.
    TpotMean,
    Coverage,
    Name,
}

impl FleetSort {
    pub(crate) const ALL: [FleetSort; 8] = [
        FleetSort::GenTokens,
        FleetSort::KvCache,
        FleetSort::Running,
        FleetSort::Waiting,
        FleetSort::TtftP90,
        FleetSort::TpotMean,
        FleetSort::Coverage,
        FleetSort::Name,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FleetSort::GenTokens => "gen tok/s",
            FleetSort::KvCache => "KV",
            FleetSort::Running => "running",
            FleetSort::Waiting => "waiting",
            FleetSort::TtftP90 => "TTFT p90",
            FleetSort::TpotMean => "TPOT",
            FleetSort::Coverage => "scrapes ok",
            FleetSort::Name => "engine",
        }
    }

    fn step(self, by: isize) -> FleetSort {
        let i = Self::ALL.iter().position(|&k| k == self).unwrap_or(0) as isize;
        Self::ALL[(i + by).rem_euclid(Self::ALL.len() as isize) as usize]
    }

    fn value(self, e: &EngineMetrics) -> Option<f64> {
        match self {
            FleetSort::GenTokens => e.gen_tokens_per_s.now,
            FleetSort::KvCache => e.kv_cache.now,
            FleetSort::Running => e.running.now,
            FleetSort::Waiting => e.waiting.now,
            FleetSort::TtftP90 => e.ttft.p90,
            FleetSort::TpotMean => e.tpot.mean,
            FleetSort::Coverage => coverage(e),
            FleetSort::Name => None,
        }
    }
}

/// Scrapes that got a page over those tried, in the window.
pub fn coverage(e: &EngineMetrics) -> Option<f64> {
    let tried = e.scrapes + e.scrape_failures;
    (tried > 0).then(|| e.scrapes as f64 / tried as f64)
}

/// Columns the thread table sorts by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    Cpu,
    GilHeld,
    GilWait,
    Gc,
    OffCpu,
    Name,
}

impl SortKey {
    pub(crate) const ALL: [SortKey; 6] = [
        SortKey::Cpu,
        SortKey::GilHeld,
        SortKey::GilWait,
        SortKey::Gc,
        SortKey::OffCpu,
        SortKey::Name,
    ];

    pub fn label(self) -> &'static str {
        match self {
            SortKey::Cpu => "CPU",
            SortKey::GilHeld => "GIL held",
            SortKey::GilWait => "GIL wait",
            SortKey::Gc => "GC",
            SortKey::OffCpu => "off-CPU",
            SortKey::Name => "name",
        }
    }

    fn step(self, by: isize) -> SortKey {
        let n = Self::ALL.len() as isize;
        let i = Self::ALL.iter().position(|&k| k == self).unwrap_or(0) as isize;
        Self::ALL[(i + by).rem_euclid(n) as usize]
    }

    fn value(self, s: &Stats) -> f64 {
        match self {
            SortKey::Cpu => s.cpu,
            SortKey::GilHeld => s.gil_held,
            SortKey::GilWait => s.gil_wait,
            SortKey::Gc => s.gc,
            SortKey::OffCpu => s.offcpu,
            SortKey::Name => 0.0,
        }
    }
}

/// A thread/process name filter: a regular expression, or (when it is not one) a substring.
#[derive(Debug, Clone)]
pub struct NameFilter {
    pub text: String,
    re: Option<regex::Regex>,
}

impl NameFilter {
    pub fn new(text: &str) -> Self {
        NameFilter {
            text: text.to_string(),
            re: regex::Regex::new(text).ok(),
        }
    }

    pub fn matches(&self, name: &str) -> bool {
        match &self.re {
            Some(r) => r.is_match(name),
            None => name.contains(&self.text),
        }
    }
}

/// A thread that did (almost) nothing in the window: under 0.1% of it on CPU, waiting for the
/// GIL and collecting garbage. A vLLM worker has dozens of such threads (gloo, ZMQ, pools).
pub(crate) fn is_idle(s: &Stats) -> bool {
    s.cpu < 0.001 && s.gil_wait < 0.001 && s.gc < 0.001
}

/// A thread folded into its process's quiet row by default: under 0.5% of the window on CPU,
/// waiting for the GIL and collecting garbage (a vLLM worker's 15 `gloo_tcp_loop` threads at
/// 0.0-0.3% each, and 29 with nothing in the window, filled a 50-line screen before its
/// EngineCore and API server came).
pub(crate) fn is_quiet(s: &Stats) -> bool {
    s.cpu < 0.005 && s.gil_wait < 0.005 && s.gc < 0.005
}

/// What a process is doing, for its line: its event loop's stalls where it runs one (an API
/// server), its headline probe's median call (a vLLM step or model run where probed, else
/// the probe whose calls take the most of the window: `execute_model p50 2.40 ms, 180/s`),
/// then its busiest thread's top
/// function. None when it has none of them. `compact` (a narrow terminal): the loop's and
/// the probe's figures shortened, and the top function only where neither is known (the
/// busiest thread's row under it shows it anyway).
pub(crate) fn process_headline(
    p: &ProcessRow,
    snap: &crate::tui::model::Snapshot,
    compact: bool,
) -> Option<String> {
    use crate::tui::model::LatencyRow;
    // This window's rows, else the latest of an earlier window (with its age).
    let mut mine: Vec<(&LatencyRow, u64)> = snap
        .latency
        .iter()
        .filter(|l| l.pid == p.pid && l.calls > 0)
        .map(|l| (l, 0))
        .collect();
    if mine.is_empty() {
        mine = snap
            .recalled
            .iter()
            .filter(|r| r.row.pid == p.pid)
            .map(|r| (&r.row, r.age_ns.max(1)))
            .collect();
    }
    // A step or a model run (vLLM's) before the calls inside it, else the busiest.
    let preferred: Vec<(&LatencyRow, u64)> = mine
        .iter()
        .copied()
        .filter(|(l, _)| crate::vllm::probes::is_headline(&l.function))
        .collect();
    let probe = if preferred.is_empty() {
        mine
    } else {
        preferred
    }
    .into_iter()
    .max_by(|(a, _), (b, _)| {
        (a.calls_per_s * a.p50_ns as f64).total_cmp(&(b.calls_per_s * b.p50_ns as f64))
    })
    .map(|(l, age)| {
        let name = l.function.rsplit('.').next().unwrap_or(&l.function);
        let p50 = l.p50_ns as f64 / 1e6;
        let ago = match (age, compact) {
            (0, _) => String::new(),
            (a, true) => format!(" {:.0}s ago", a as f64 / 1e9),
            (a, false) => format!(" ({:.0} s ago: unwatched since)", a as f64 / 1e9),
        };
        if compact {
            format!("{name} p50 {p50:.2}ms{ago}")
        } else if let Some(u) = &l.interval {
            // Watched for part of the window: ± the larger side of each 95% interval.
            let p50_pm = larger_side(p50, u.p50_ms);
            let c = l.calls.max(1) as f64;
            let per_s_pm = larger_side(c, u.calls) * l.calls_per_s / c;
            format!(
                "{name} p50 {p50:.2} ms ±{p50_pm:.2}, {:.0}/s ±{per_s_pm:.0}{ago}",
                l.calls_per_s
            )
        } else {
            format!("{name} p50 {p50:.2} ms, {:.0}/s{ago}", l.calls_per_s)
        }
    });
    let top = p
        .threads
        .iter()
        .max_by(|a, b| a.stats.cpu.total_cmp(&b.stats.cpu).then(b.tid.cmp(&a.tid)))
        .filter(|t| t.stats.cpu > 0.0)
        .and_then(|t| {
            t.top_self
                .first()
                .map(|f| format!("{}: {} {:.0}%", t.name, f.function, f.self_share * 100.0))
        });
    let event_loop = p
        .event_loop
        .as_ref()
        .map(|l| loop_headline(l, snap.wall_ns, compact));
    let top = top.filter(|_| !compact || (event_loop.is_none() && probe.is_none()));
    let parts: Vec<String> = event_loop.into_iter().chain(probe).chain(top).collect();
    (!parts.is_empty()).then(|| parts.join(" · "))
}

/// An event loop's stalls over a window of `wall_ns`: `loop stalled 4.2% (3 over 100 ms,
/// longest 240 ms)`, or `loop: no stall over 100 ms`; `compact`: `loop stalled 4.2%`,
/// `loop: no stall`.
pub(crate) fn loop_headline(
    l: &crate::tui::model::LoopStalls,
    wall_ns: u64,
    compact: bool,
) -> String {
    let ms = |ns: u64| ns as f64 / 1e6;
    let share = l.stalled_ns as f64 * 100.0 / wall_ns.max(1) as f64;
    match (l.stalls, compact) {
        (0, true) => return "loop: no stall".into(),
        (0, false) => return format!("loop: no stall over {:.0} ms", ms(l.threshold_ns)),
        (_, true) => return format!("loop stalled {share:.1}%"),
        _ => {}
    }
    format!(
        "loop stalled {share:.1}% ({} over {:.0} ms, longest {:.0} ms)",
        l.stalls,
        ms(l.threshold_ns),
        ms(l.longest_ns)
    )
}

/// The quiet threads of one process, folded into one line.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    pub threads: usize,
    /// (name, threads of that name), most first, then by name.
    pub names: Vec<(String, usize)>,
    /// Of `threads`, those above the quiet share, folded for room on a short screen (the
    /// busiest of their process stay).
    pub busy: usize,
}

impl Folded {
    /// "44 quiet threads: 29 pt_gloo_runloop, 15 gloo_tcp_loop" (at most `max` names).
    pub fn label(&self, max: usize) -> String {
        let mut parts: Vec<String> = self
            .names
            .iter()
            .take(max)
            .map(|(n, k)| format!("{k} {n}"))
            .collect();
        if self.names.len() > max {
            let rest: usize = self.names[max..].iter().map(|(_, k)| k).sum();
            parts.push(format!("{rest} more"));
        }
        let what = match self.busy {
            0 => "quiet thread",
            _ => "more thread",
        };
        let busy = match self.busy {
            0 => String::new(),
            b => format!(" ({b} busy)"),
        };
        format!(
            "{} {what}{}{busy}: {}",
            self.threads,
            if self.threads == 1 { "" } else { "s" },
            parts.join(", ")
        )
    }
}

/// Split a process's threads (busiest first) into those shown and those folded: the quiet
/// ones fold, but the busiest thread of every process is always shown (the first screen
/// names what each process is doing).
pub fn fold(threads: Vec<&ThreadRow>) -> (Vec<&ThreadRow>, Option<Folded>) {
    fold_to(threads, usize::MAX)
}

/// [`fold`], showing at most `most` threads (at least one): the busy ones past it fold too.
pub(crate) fn fold_to(threads: Vec<&ThreadRow>, most: usize) -> (Vec<&ThreadRow>, Option<Folded>) {
    let mut shown = Vec::new();
    let mut quiet: Vec<&ThreadRow> = Vec::new();
    let mut busy = 0;
    for (i, t) in threads.into_iter().enumerate() {
        if i > 0 && is_quiet(&t.stats) {
            quiet.push(t);
        } else if i > 0 && shown.len() >= most {
            busy += 1;
            quiet.push(t);
        } else {
            shown.push(t);
        }
    }
    if quiet.is_empty() {
        return (shown, None);
    }
    let mut by_name: std::collections::BTreeMap<&str, usize> = Default::default();
    for t in &quiet {
        *by_name.entry(t.name.as_str()).or_default() += 1;
    }
    let mut names: Vec<(String, usize)> = by_name
        .into_iter()
        .map(|(n, k)| (n.to_string(), k))
        .collect();
    names.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    (
        shown,
        Some(Folded {
            threads: quiet.len(),
            names,
            busy,
        }),
    )
}

/// What the loop must do after a key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Command {
    None,
    Quit,
    /// Save a flamegraph of the window (of the selected thread in its detail view).
    Flame,
    /// Replay speed times this factor.
    Speed(f64),
    /// Replay clock one window forward (true) or back.
    Jump(bool),
}

#[derive(Debug, Clone)]
pub struct Ui {
    pub view: View,
    /// The selected thread's detail is open (over `Threads`).
    pub detail: bool,
    pub sort: SortKey,
    /// The fleet table's sort column (Metrics view, several engines).
    pub fleet_sort: FleetSort,
    pub ascending: bool,
    pub selected: Option<ThreadKey>,
    pub filter: Option<NameFilter>,
    /// A filter being typed after `/`.
    pub input: Option<String>,
    pub help: bool,
    pub paused: bool,
    /// Hide threads that did (almost) nothing in the window (`i`).
    pub hide_idle: bool,
    /// List quiet threads one by one instead of folding them per process (`x`).
    pub expand_quiet: bool,
    /// Rows the Threads table showed at its last draw (0: not drawn yet): when every thread
    /// shown would not fit, each process shows fewer of its busiest, so that the first screen
    /// has every process ([`Ui::rows`]; keys move through what is shown).
    pub table_rows: std::cell::Cell<usize>,
    /// Last message for the status line (saved flamegraph, errors).
    pub status: String,
}

impl Default for Ui {
    fn default() -> Self {
        Ui {
            view: View::Threads,
            detail: false,
            sort: SortKey::Cpu,
            fleet_sort: FleetSort::GenTokens,
            ascending: false,
            selected: None,
            filter: None,
            input: None,
            help: false,
            paused: false,
            hide_idle: false,
            expand_quiet: false,
            table_rows: std::cell::Cell::new(0),
            status: String::new(),
        }
    }
}

/// One line of the thread table.
#[derive(Debug, Clone)]
pub enum Row<'a> {
    Group(&'a Group),
    Process(&'a ProcessRow),
    Thread(&'a ProcessRow, &'a ThreadRow),
    /// A process's quiet threads, folded (`x` lists them).
    Folded(&'a ProcessRow, Folded),
}

impl Ui {
    fn thread_visible(&self, p: &ProcessRow, t: &ThreadRow) -> bool {
        (!self.hide_idle || !is_idle(&t.stats))
            && self
                .filter
                .as_ref()
                .is_none_or(|f| f.matches(&t.name) || f.matches(&p.name))
    }

    fn order(&self, a: (&Stats, &str, i32), b: (&Stats, &str, i32)) -> std::cmp::Ordering {
        let o = match self.sort {
            SortKey::Name => a.1.cmp(b.1).reverse(),
            k => k.value(a.0).total_cmp(&k.value(b.0)),
        };
        // Descending by default (busiest first; names A→Z); ties by id.
        let o = if self.ascending { o } else { o.reverse() };
        o.then(a.2.cmp(&b.2))
    }

    /// The fleet table's rows: engines by the fleet sort column, largest first unless
    /// reversed (names A→Z), engines without the figure last either way; ties by name.
    pub(crate) fn fleet_rows<'a>(&self, snap: &'a Snapshot) -> Vec<&'a EngineMetrics> {
        let mut v: Vec<&EngineMetrics> = snap.engines.iter().collect();
        let dir = |o: std::cmp::Ordering| if self.ascending { o } else { o.reverse() };
        v.sort_by(|a, b| {
            let o = match self.fleet_sort {
                FleetSort::Name => dir(b.engine.cmp(&a.engine)),
                k => match (k.value(a), k.value(b)) {
                    (Some(x), Some(y)) => dir(x.total_cmp(&y)),
                    (x, y) => y.is_some().cmp(&x.is_some()),
                },
            };
            o.then(a.engine.cmp(&b.engine))
        });
        v
    }

    /// The thread table's lines: groups (engines) in order, their processes and threads
    /// sorted by the sort column, only threads the filter keeps (and their processes).
    pub fn rows<'a>(&self, snap: &'a Snapshot) -> Vec<Row<'a>> {
        let rows = self.rows_capped(snap, usize::MAX);
        let room = self.table_rows.get();
        if room == 0 || rows.len() <= room || self.expand_quiet || self.filter.is_some() {
            return rows;
        }
        // The most threads any process shows; fewer until every row fits (one each at least).
        let most = rows
            .iter()
            .fold((0usize, 0usize), |(best, run), r| match r {
                Row::Thread(..) => (best.max(run + 1), run + 1),
                _ => (best, 0),
            })
            .0;
        let mut fewer = rows;
        for k in (1..most).rev() {
            fewer = self.rows_capped(snap, k);
            if fewer.len() <= room {
                break;
            }
        }
        fewer
    }

    /// The rows, each process showing at most `most` threads (besides a filter or `x`).
    fn rows_capped<'a>(&self, snap: &'a Snapshot, most: usize) -> Vec<Row<'a>> {
        let mut out = Vec::new();
        for g in &snap.groups {
            let mut procs: Vec<(&ProcessRow, Vec<&ThreadRow>)> = g
                .processes
                .iter()
                .map(|p| {
                    let mut ts: Vec<&ThreadRow> = p
                        .threads
                        .iter()
                        .filter(|t| self.thread_visible(p, t))
                        .collect();
                    ts.sort_by(|a, b| {
                        self.order((&a.stats, &a.name, a.tid), (&b.stats, &b.name, b.tid))
                    });
                    (p, ts)
                })
                .filter(|(p, ts)| !ts.is_empty() || (self.filter.is_none() && p.threads.is_empty()))
                .collect();
            if procs.is_empty() {
                continue;
            }
            procs.sort_by(|a, b| {
                self.order(
                    (&a.0.stats, &a.0.name, a.0.pid),
                    (&b.0.stats, &b.0.name, b.0.pid),
                )
            });
            if !g.label.is_empty() {
                out.push(Row::Group(g));
            }
            for (p, ts) in procs {
                out.push(Row::Process(p));
                // Sorted by CPU for the fold (the busiest thread stays), shown in the
                // table's order.
                let (shown, folded) = if self.expand_quiet || self.filter.is_some() {
                    (ts, None)
                } else {
                    let mut by_cpu = ts.clone();
                    by_cpu.sort_by(|a, b| {
                        b.stats.cpu.total_cmp(&a.stats.cpu).then(a.tid.cmp(&b.tid))
                    });
                    let (keep, folded) = fold_to(by_cpu, most);
                    let keep: Vec<&ThreadRow> = ts
                        .into_iter()
                        .filter(|t| keep.iter().any(|k| k.tid == t.tid))
                        .collect();
                    (keep, folded)
                };
                out.extend(shown.into_iter().map(|t| Row::Thread(p, t)));
                if let Some(f) = folded {
                    out.push(Row::Folded(p, f));
                }
            }
        }
        out
    }

    /// Index in `rows` of the selected thread; the first thread when none is selected or the
    /// selected one is not shown.
    pub(crate) fn selected_index(&self, rows: &[Row]) -> Option<usize> {
        let is_thread = |r: &Row| matches!(r, Row::Thread(..));
        self.selected
            .and_then(|k| {
                rows.iter()
                    .position(|r| matches!(r, Row::Thread(_, t) if (t.pid, t.tid) == k))
            })
            .or_else(|| rows.iter().position(is_thread))
    }

    fn move_selection(&mut self, snap: &Snapshot, by: isize) {
        let rows = self.rows(snap);
        let threads: Vec<ThreadKey> = rows
            .iter()
            .filter_map(|r| match r {
                Row::Thread(_, t) => Some((t.pid, t.tid)),
                _ => None,
            })
            .collect();
        if threads.is_empty() {
            return;
        }
        // With nothing selected, the first thread is (it is highlighted).
        let cur = self
            .selected
            .and_then(|k| threads.iter().position(|&t| t == k))
            .unwrap_or(0);
        let next = (cur as isize)
            .saturating_add(by)
            .clamp(0, threads.len() as isize - 1) as usize;
        self.selected = Some(threads[next]);
    }

    /// The thread whose detail is shown: the selected one, or the first shown.
    pub(crate) fn detail_thread<'a>(
        &self,
        snap: &'a Snapshot,
    ) -> Option<(&'a ProcessRow, &'a ThreadRow)> {
        let rows = self.rows(snap);
        let i = self.selected_index(&rows)?;
        match rows.get(i) {
            Some(Row::Thread(p, t)) => Some((p, t)),
            _ => None,
        }
    }

    /// Apply a key; returns what the loop must do.
    pub(crate) fn on_key(&mut self, snap: &Snapshot, key: KeyEvent) -> Command {
        if key.kind == KeyEventKind::Release {
            return Command::None;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            return Command::Quit;
        }
        if let Some(text) = self.input.as_mut() {
            match key.code {
                KeyCode::Enter => {
                    let t = text.trim().to_string();
                    self.filter = (!t.is_empty()).then(|| NameFilter::new(&t));
                    self.input = None;
                    self.status = match &self.filter {
                        Some(f) => format!("filter: {}", f.text),
                        None => "filter cleared".into(),
                    };
                }
                KeyCode::Esc => self.input = None,
                KeyCode::Backspace => {
                    text.pop();
                }
                KeyCode::Char(c) => text.push(c),
                _ => {}
            }
            return Command::None;
        }
        if self.help {
            if matches!(
                key.code,
                KeyCode::Esc | KeyCode::Char('?') | KeyCode::Char('q') | KeyCode::Enter
            ) {
                self.help = false;
            }
            return Command::None;
        }
        match key.code {
            KeyCode::Char('q') => return Command::Quit,
            KeyCode::Esc | KeyCode::Backspace | KeyCode::Left if self.detail => self.detail = false,
            KeyCode::Esc => return Command::Quit,
            KeyCode::Char('?') => self.help = true,
            KeyCode::Tab | KeyCode::BackTab => {
                let by = if key.code == KeyCode::Tab { 1 } else { -1 };
                let i = TABS.iter().position(|&v| v == self.view).unwrap_or(0) as isize;
                self.view = TABS[(i + by).rem_euclid(TABS.len() as isize) as usize];
                self.detail = false;
            }
            KeyCode::Enter | KeyCode::Right
                if self.view == View::Threads && self.detail_thread(snap).is_some() =>
            {
                self.selected = self.detail_thread(snap).map(|(_, t)| (t.pid, t.tid));
                self.detail = true;
            }
            KeyCode::Down | KeyCode::Char('j') => self.move_selection(snap, 1),
            KeyCode::Up | KeyCode::Char('k') => self.move_selection(snap, -1),
            KeyCode::PageDown => self.move_selection(snap, 10),
            KeyCode::PageUp => self.move_selection(snap, -10),
            KeyCode::Home => self.move_selection(snap, isize::MIN / 2),
            KeyCode::End => self.move_selection(snap, isize::MAX / 2),
            KeyCode::Char('s') if self.view == View::Metrics => {
                self.fleet_sort = self.fleet_sort.step(1)
            }
            KeyCode::Char('S') if self.view == View::Metrics => {
                self.fleet_sort = self.fleet_sort.step(-1)
            }
            KeyCode::Char('s') => self.sort = self.sort.step(1),
            KeyCode::Char('S') => self.sort = self.sort.step(-1),
            KeyCode::Char('r') => self.ascending = !self.ascending,
            KeyCode::Char('/') => {
                self.input = Some(
                    self.filter
                        .as_ref()
                        .map(|f| f.text.clone())
                        .unwrap_or_default(),
                )
            }
            KeyCode::Char('p') | KeyCode::Char(' ') => {
                self.paused = !self.paused;
                self.status = if self.paused { "paused" } else { "resumed" }.into();
            }
            KeyCode::Char('x') => {
                self.expand_quiet = !self.expand_quiet;
                self.status = if self.expand_quiet {
                    "listing quiet threads one by one"
                } else {
                    "folding quiet threads (under 0.5% CPU, GIL wait and GC) per process"
                }
                .into();
            }
            KeyCode::Char('i') => {
                self.hide_idle = !self.hide_idle;
                self.status = if self.hide_idle {
                    "hiding idle threads (under 0.1% CPU, GIL wait and GC)"
                } else {
                    "showing every thread"
                }
                .into();
            }
            KeyCode::Char('f') => return Command::Flame,
            KeyCode::Char('+') | KeyCode::Char('=') => return Command::Speed(2.0),
            KeyCode::Char('-') => return Command::Speed(0.5),
            KeyCode::Char(']') => return Command::Jump(true),
            KeyCode::Char('[') => return Command::Jump(false),
            _ => {}
        }
        Command::None
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::metrics::maths;
    use crate::record::synth::*;
    use crate::tui::model::{snapshot, Topology};
    use crate::tui::window::Window;

    pub(crate) fn three_threads() -> Snapshot {
        let mut b = Rec::new()
            .process(10, "/usr/bin/python3.12 serve.py", "")
            .thread(10, 11, "worker-a")
            .thread(10, 12, "worker-b")
            .thread(10, 13, "MainThread");
        let st = b.stack(&["work"], "w.py");
        b.samples((10, 11), 0, 200, MS, st, GIL);
        b.samples((10, 12), 0, 600, MS, st, 0);
        b.samples((10, 13), 0, 100, MS, st, GIL);
        b.gil_wait(10, 13, 0, 500 * MS, 11, st);
        let mut w = Window::new(10 * S, 40, 10 * S);
        w.update(&b.0, S);
        snapshot(&w, &b.0, &Topology::default())
    }

    fn key(c: KeyCode) -> KeyEvent {
        KeyEvent::new(c, KeyModifiers::NONE)
    }

    fn thread_names(ui: &Ui, s: &Snapshot) -> Vec<String> {
        ui.rows(s)
            .iter()
            .filter_map(|r| match r {
                Row::Thread(_, t) => Some(t.name.clone()),
                _ => None,
            })
            .collect()
    }

    /// A vLLM process's line names its step or model run before the busier MessageQueue
    /// calls inside it; without one, the busiest probe; in a window without any, the latest
    /// of an earlier window, with its age.
    #[test]
    fn process_headline_prefers_the_step_and_recalls() {
        use crate::tui::model::{LatencyRow, ProcessRow, Recall, Snapshot};
        let p = ProcessRow {
            pid: 7,
            name: "engine_core".into(),
            ..Default::default()
        };
        let row = |function: &str, per_s: f64, p50_ms: u64| LatencyRow {
            function: function.into(),
            pid: 7,
            calls: 100,
            calls_per_s: per_s,
            p50_ns: p50_ms * 1_000_000,
            ..Default::default()
        };
        let s = 1_000_000_000u64;
        let mut snap = Snapshot {
            now_ns: 10 * s,
            wall_ns: 10 * s,
            latency: vec![
                row("MessageQueue.dequeue", 400.0, 2),
                row("mod.EngineCore.step", 190.0, 2),
            ],
            ..Default::default()
        };
        let mut recall = Recall::default();
        recall.apply(&mut snap);
        assert_eq!(
            process_headline(&p, &snap, false).as_deref(),
            Some("step p50 2.00 ms, 190/s")
        );
        // Watched for part of the window: the estimates' error bars (100 calls: 88-110).
        snap.latency[1].interval = Some(crate::estimate::Uncertainty {
            calls: [88.0, 110.0],
            p50_ms: [1.9, 2.05],
            p90_ms: [2.0, 2.2],
            method: "phases".into(),
            phases: 40,
        });
        assert_eq!(
            process_headline(&p, &snap, false).as_deref(),
            Some("step p50 2.00 ms ±0.10, 190/s ±23")
        );
        snap.latency[1].interval = None;
        snap.latency.pop();
        assert_eq!(
            process_headline(&p, &snap, true).as_deref(),
            Some("dequeue p50 2.00ms")
        );
        // 12 s later, a window with no call of the process: the step as it was, and when.
        let mut later = Snapshot {
            now_ns: 22 * s,
            wall_ns: 10 * s,
            ..Default::default()
        };
        recall.apply(&mut later);
        assert_eq!(
            process_headline(&p, &later, false).as_deref(),
            Some("step p50 2.00 ms, 190/s (12 s ago: unwatched since)")
        );
        assert_eq!(
            process_headline(&p, &later, true).as_deref(),
            Some("step p50 2.00ms 12s ago")
        );
    }

    #[test]
    fn sort_keys_cycle_and_reverse() {
        let s = three_threads();
        let mut ui = Ui::default();
        assert_eq!(
            thread_names(&ui, &s),
            ["worker-b", "worker-a", "MainThread"]
        );
        assert_eq!(ui.on_key(&s, key(KeyCode::Char('s'))), Command::None);
        assert_eq!(ui.sort, SortKey::GilHeld);
        assert_eq!(
            thread_names(&ui, &s),
            ["worker-a", "MainThread", "worker-b"]
        );
        ui.on_key(&s, key(KeyCode::Char('s')));
        assert_eq!(ui.sort, SortKey::GilWait);
        assert_eq!(thread_names(&ui, &s)[0], "MainThread");
        ui.on_key(&s, key(KeyCode::Char('r')));
        assert_eq!(thread_names(&ui, &s)[2], "MainThread");
        for _ in 0..3 {
            ui.on_key(&s, key(KeyCode::Char('s')));
        }
        assert_eq!(ui.sort, SortKey::Name);
        ui.on_key(&s, key(KeyCode::Char('r')));
        assert_eq!(
            thread_names(&ui, &s),
            ["MainThread", "worker-a", "worker-b"]
        );
        ui.on_key(&s, key(KeyCode::Char('S')));
        assert_eq!(ui.sort, SortKey::OffCpu);
    }

    /// The fleet table sorts by the window's TTFT p90 and TPOT mean: slowest engine first,
    /// engines without finished requests last; `r` puts the fastest first.
    #[test]
    fn fleet_sorts_by_ttft_and_tpot() {
        let engine = |name: &str, ttft_p90: Option<f64>, tpot_mean: Option<f64>| EngineMetrics {
            engine: name.into(),
            ttft: maths::LatencyQuantiles {
                p90: ttft_p90,
                ..Default::default()
            },
            tpot: maths::LatencyQuantiles {
                mean: tpot_mean,
                ..Default::default()
            },
            ..Default::default()
        };
        let s = Snapshot {
            engines: vec![
                engine("a", Some(120.0), Some(9.0)),
                engine("b", None, None),
                engine("c", Some(480.0), Some(4.5)),
                engine("d", Some(60.0), Some(30.0)),
            ],
            ..Default::default()
        };
        let names = |ui: &Ui| -> Vec<String> {
            ui.fleet_rows(&s).iter().map(|e| e.engine.clone()).collect()
        };
        let mut ui = Ui {
            view: View::Metrics,
            ..Ui::default()
        };
        while ui.fleet_sort != FleetSort::TtftP90 {
            ui.on_key(&s, key(KeyCode::Char('s')));
        }
        assert_eq!(names(&ui), ["c", "a", "d", "b"]);
        ui.on_key(&s, key(KeyCode::Char('s')));
        assert_eq!(ui.fleet_sort, FleetSort::TpotMean);
        assert_eq!(names(&ui), ["d", "a", "c", "b"]);
        ui.on_key(&s, key(KeyCode::Char('r')));
        assert_eq!(names(&ui), ["c", "a", "d", "b"]);
    }

    #[test]
    fn filter_by_regex_or_text() {
        let s = three_threads();
        let mut ui = Ui::default();
        ui.on_key(&s, key(KeyCode::Char('/')));
        for c in "^worker-[a]".chars() {
            ui.on_key(&s, key(KeyCode::Char(c)));
        }
        assert_eq!(ui.input.as_deref(), Some("^worker-[a]"));
        // Not applied until Enter.
        assert_eq!(thread_names(&ui, &s).len(), 3);
        ui.on_key(&s, key(KeyCode::Enter));
        assert_eq!(thread_names(&ui, &s), ["worker-a"]);
        // Not a valid expression: a substring.
        ui.filter = Some(NameFilter::new("r-b("));
        assert_eq!(thread_names(&ui, &s), Vec::<String>::new());
        ui.filter = Some(NameFilter::new("Main"));
        assert_eq!(thread_names(&ui, &s), ["MainThread"]);
        // The process name matches all its threads.
        ui.filter = Some(NameFilter::new("python3"));
        assert_eq!(thread_names(&ui, &s).len(), 3);
        // `i` hides threads that did nothing; MainThread waited for the GIL, so it stays.
        let mut quiet = three_threads();
        quiet.groups[0].processes[0].threads[1].stats = Stats::default();
        ui.on_key(&quiet, key(KeyCode::Char('i')));
        assert_eq!(thread_names(&ui, &quiet), ["worker-a", "MainThread"]);
        ui.on_key(&quiet, key(KeyCode::Char('i')));
        assert_eq!(thread_names(&ui, &quiet).len(), 3);
        // An empty filter clears it; Esc abandons an edit.
        ui.on_key(&s, key(KeyCode::Char('/')));
        ui.on_key(&s, key(KeyCode::Esc));
        assert!(ui.filter.is_some() && ui.input.is_none());
        ui.on_key(&s, key(KeyCode::Char('/')));
        for _ in 0.."python3".len() {
            ui.on_key(&s, key(KeyCode::Backspace));
        }
        ui.on_key(&s, key(KeyCode::Enter));
        assert!(ui.filter.is_none());
    }

    #[test]
    fn selection_detail_views_and_quit() {
        let s = three_threads();
        let mut ui = Ui::default();
        let rows = ui.rows(&s);
        assert!(
            matches!(rows[ui.selected_index(&rows).unwrap()], Row::Thread(_, t) if t.name == "worker-b")
        );
        ui.on_key(&s, key(KeyCode::Down));
        ui.on_key(&s, key(KeyCode::Down));
        ui.on_key(&s, key(KeyCode::Down));
        assert_eq!(ui.selected, Some((10, 13)));
        ui.on_key(&s, key(KeyCode::Up));
        assert_eq!(ui.selected, Some((10, 11)));
        ui.on_key(&s, key(KeyCode::Enter));
        assert!(ui.detail);
        assert_eq!(ui.detail_thread(&s).map(|(_, t)| t.tid), Some(11));
        // Esc leaves the detail first, then quits.
        assert_eq!(ui.on_key(&s, key(KeyCode::Esc)), Command::None);
        assert!(!ui.detail);
        ui.on_key(&s, key(KeyCode::Tab));
        assert_eq!(ui.view, View::Metrics);
        ui.on_key(&s, key(KeyCode::Tab));
        assert_eq!(ui.view, View::Latency);
        ui.on_key(&s, key(KeyCode::BackTab));
        assert_eq!(ui.view, View::Metrics);
        ui.on_key(&s, key(KeyCode::Char('?')));
        assert!(ui.help);
        // Keys go to the help until it closes.
        assert_eq!(ui.on_key(&s, key(KeyCode::Char('f'))), Command::None);
        ui.on_key(&s, key(KeyCode::Esc));
        assert!(!ui.help);
        ui.on_key(&s, key(KeyCode::Char('p')));
        assert!(ui.paused);
        assert_eq!(ui.on_key(&s, key(KeyCode::Char('f'))), Command::Flame);
        assert_eq!(ui.on_key(&s, key(KeyCode::Char('+'))), Command::Speed(2.0));
        assert_eq!(ui.on_key(&s, key(KeyCode::Char('['))), Command::Jump(false));
        assert_eq!(ui.on_key(&s, key(KeyCode::Char('q'))), Command::Quit);
        assert_eq!(ui.on_key(&s, key(KeyCode::Esc)), Command::Quit);
        let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(ui.on_key(&s, ctrl_c), Command::Quit);
    }
    #[test]
    fn quiet_threads_fold_per_process_and_the_busiest_stays() {
        let t = |tid: i32, name: &str, cpu: f64| ThreadRow {
            pid: 1,
            tid,
            name: name.into(),
            stats: Stats {
                cpu,
                ..Stats::default()
            },
            cpu_history: Vec::new(),
            top_self: Vec::new(),
            top_total: Vec::new(),
            blame: Vec::new(),
            idle: cpu == 0.0,
        };
        let rows = [
            t(1, "MainThread", 0.9),
            t(2, "gloo_tcp_loop", 0.003),
            t(3, "gloo_tcp_loop", 0.0),
            t(4, "pt_gloo_runloop", 0.0),
            t(5, "ZMQbg/IO/0", 0.02),
            t(6, "pt_gloo_runloop", 0.0),
            t(7, "pt_gloo_runloop", 0.0),
        ];
        let (shown, folded) = fold(rows.iter().collect());
        let shown: Vec<i32> = shown.iter().map(|t| t.tid).collect();
        assert_eq!(shown, [1, 5]);
        let f = folded.unwrap();
        assert_eq!(f.threads, 5);
        assert_eq!(
            f.label(6),
            "5 quiet threads: 3 pt_gloo_runloop, 2 gloo_tcp_loop"
        );
        assert_eq!(f.label(1), "5 quiet threads: 3 pt_gloo_runloop, 2 more");
        // A process whose threads are all quiet still shows its busiest.
        let (shown, folded) = fold(vec![&rows[2], &rows[1]]);
        assert_eq!(shown.len(), 1);
        assert_eq!(folded.unwrap().label(6), "1 quiet thread: 1 gloo_tcp_loop");
        // Nothing quiet: nothing folded.
        assert!(fold(vec![&rows[0], &rows[4]]).1.is_none());
    }
}
