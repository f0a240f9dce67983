//! `enginescope top`: a live terminal dashboard of where target processes spend their time.
//!
//! ```text
//! record thread ──(sampler::record)──> recording file ──(source::Follow, every 250 ms)──┐
//! --replay FILE ──(source::Replay, paced by event time)──────────────────────────────────┤
//!                                                                                        ▼
//!        window::Window (sliding-window sums, updated from new events only)
//!                 │ model::snapshot            (pure)
//!                 ▼
//!        model::Snapshot ──render::view──> frame (ratatui)   ·   plain::lines (stdout not a tty)
//! ```
//!
//! Every piece of state is owned by the UI thread: the recorder runs on a thread of its own and
//! talks to the dashboard only through the file it writes (the same file `record -o` would),
//! and a flamegraph is drawn on a short-lived thread from a copy of the window's samples.
//! Keys change [`app::Ui`]; [`render::view`] draws from the state alone.

pub mod app;
pub mod model;
pub mod plain;
pub mod render;
pub mod source;
pub mod terminal;
pub mod window;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use crossterm::event::{self, Event};

use crate::record::{EndInfo, Recording};
use crate::sampler::{RecordOptions, RecordSummary};
pub use model::Topology;

/// How often new events are taken in (and the screen redrawn when nothing else happens).
pub(crate) const TICK: Duration = Duration::from_millis(250);
/// How often plain-text mode prints.
pub(crate) const PLAIN_EVERY: Duration = Duration::from_secs(2);
/// Live mode shows the window up to this long ago: what the recorder has surely written by
/// then (it drains every 20 ms and flushes every 200 ms; the file is read every 250 ms).
pub(crate) const LIVE_LAG_NS: u64 = 500_000_000;
/// Buckets per window: the window's edge moves in steps of window/40.
pub(crate) const BUCKETS: u64 = 40;
/// Events and metric points are kept for at least this long (metric sparklines, flamegraphs
/// of the window); older ones are dropped from memory.
pub(crate) const KEEP_NS: u64 = 60_000_000_000;

/// `top` (and `demo` on a terminal): the dashboard over a recorder with any options,
/// e.g. `vllm: true`, which finds the engines and writes their roles, engines and metrics
/// into the recording the dashboard follows. `ropts.output` is replaced when it exists and
/// removed at the end when `temporary`.
pub(crate) fn run_record(
    mut ropts: RecordOptions,
    temporary: bool,
    window: Duration,
) -> anyhow::Result<()> {
    terminal::catch_stop_signals(ropts.stop.clone())?;
    let path = ropts.output.clone();
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("replacing {}", path.display())),
    }
    ropts.quiet = true;
    let label = if ropts.vllm {
        "live vLLM engines".to_string()
    } else {
        let pids: Vec<String> = ropts.pids.iter().map(|p| p.to_string()).collect();
        format!("live pid {}", pids.join(","))
    };
    run_with(ropts, temporary, window, label)
}

fn run_with(
    ropts: RecordOptions,
    temporary: bool,
    window: Duration,
    label: String,
) -> anyhow::Result<()> {
    let path = ropts.output.clone();
    let stop = ropts.stop.clone();
    let begun = ropts.window_begun.clone();
    let handle = std::thread::Builder::new()
        .name("es-recorder".into())
        .spawn(move || crate::sampler::record(&ropts))
        .context("starting the recorder thread")?;
    let mut recorder = Recorder {
        handle: Some(handle),
        outcome: None,
        stop,
    };
    let result = (|| {
        let Some(follow) = wait_for_recording(&path, &begun, &mut recorder)? else {
            return Ok(());
        };
        let feed = Feed::Live {
            follow: Box::new(follow),
        };
        drive(feed, &mut recorder, window, label)
    })();
    recorder.stop.stop();
    let finished = recorder.finish();
    if temporary {
        let _ = std::fs::remove_file(&path);
    } else if path.exists() {
        eprintln!("enginescope: recording kept in {}", path.display());
    }
    result?;
    finished.map(|_| ())
}

/// `top --replay FILE`: the same dashboard over a finished recording, paced by event time.
pub(crate) fn run_replay(path: &Path, window: Duration) -> anyhow::Result<()> {
    let stop = crate::sys::StopToken::new();
    terminal::catch_stop_signals(stop.clone())?;
    let rec = crate::record::read_recording(path)?;
    let label = format!(
        "replay {}",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    let feed = Feed::Replay {
        replay: Box::new(source::Replay::new(rec)),
        speed: 1.0,
        last: Instant::now(),
    };
    let mut none = Recorder {
        handle: None,
        outcome: None,
        stop,
    };
    drive(feed, &mut none, window, label)
}

/// The background recorder of live mode.
struct Recorder {
    handle: Option<JoinHandle<anyhow::Result<RecordSummary>>>,
    /// Set once it has finished: Ok(summary) or the error (kept whole: `main` turns an
    /// attach error into advice).
    outcome: Option<anyhow::Result<RecordSummary>>,
    /// Stops it (it then finishes its file).
    stop: crate::sys::StopToken,
}

impl Recorder {
    /// Whether it has finished (collecting its result the first time).
    fn done(&mut self) -> bool {
        if self.handle.as_ref().is_some_and(|h| h.is_finished()) {
            self.join();
        }
        self.outcome.is_some()
    }

    fn join(&mut self) {
        if let Some(h) = self.handle.take() {
            self.outcome = Some(
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the recorder thread panicked"))),
            );
        }
    }

    /// Wait for it to end (after `stop`) and return its result.
    fn finish(&mut self) -> anyhow::Result<Option<RecordSummary>> {
        self.join();
        self.outcome.take().transpose()
    }
}

/// Wait until the recorder has written the recording's header (it has attached and started),
/// or has failed, or a stop signal came. Polls the file: the recorder says nothing else.
fn wait_for_recording(
    path: &Path,
    begun: &std::sync::atomic::AtomicBool,
    recorder: &mut Recorder,
) -> anyhow::Result<Option<source::Follow>> {
    loop {
        if terminal::signalled().is_some() {
            return Ok(None);
        }
        // The header's start is the window's once it has begun.
        if begun.load(std::sync::atomic::Ordering::Acquire) && path.exists() {
            let mut f = source::Follow::open(path)?;
            f.poll()?;
            if f.has_meta() {
                return Ok(Some(f));
            }
        }
        if recorder.done() {
            recorder.finish()?;
            anyhow::bail!("the recorder stopped before it started");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where events come from.
enum Feed {
    Live {
        follow: Box<source::Follow>,
    },
    Replay {
        replay: Box<source::Replay>,
        speed: f64,
        last: Instant,
    },
}

impl Feed {
    fn rec(&self) -> &Recording {
        match self {
            Feed::Live { follow } => follow.recording(),
            Feed::Replay { replay, .. } => &replay.staged,
        }
    }

    fn rec_mut(&mut self) -> &mut Recording {
        match self {
            Feed::Live { follow } => follow.recording_mut(),
            Feed::Replay { replay, .. } => &mut replay.staged,
        }
    }

    /// Take in new events. Returns the time the window ends at, and whether the recording was
    /// rebuilt (a replay jumping back).
    fn step(&mut self, paused: bool, keep_ns: u64) -> anyhow::Result<(u64, bool)> {
        match self {
            Feed::Live { follow } => {
                follow.poll()?;
                let rec = follow.recording();
                let now = match &rec.end {
                    Some(e) => e.duration_ns,
                    None => crate::sys::monotonic_ns()
                        .saturating_sub(rec.meta.start_mono_ns)
                        .saturating_sub(LIVE_LAG_NS),
                };
                Ok((now, false))
            }
            Feed::Replay {
                replay,
                speed,
                last,
            } => {
                let elapsed = last.elapsed();
                *last = Instant::now();
                let mut reset = false;
                if !paused && !replay.at_end() {
                    let dt = (elapsed.as_secs_f64() * *speed * 1e9) as u64;
                    reset = replay.seek(replay.clock_ns().saturating_add(dt), keep_ns);
                }
                Ok((replay.clock_ns(), reset))
            }
        }
    }

    fn header(&self, label: &str) -> render::Header {
        let rec = self.rec();
        render::Header {
            source: label.to_string(),
            backend: rec.meta.backend.clone(),
            rate_hz: rec.meta.rate_hz,
            replay: match self {
                Feed::Replay { replay, speed, .. } => Some((*speed, replay.len_ns)),
                Feed::Live { .. } => None,
            },
            frame_ms: 0.0,
            update_ms: 0.0,
        }
    }
}

/// Take in new events, move the window, trim what no view needs any more.
fn update(
    feed: &mut Feed,
    w: &mut window::Window,
    paused: bool,
    last_trim: &mut Instant,
) -> anyhow::Result<()> {
    let keep = KEEP_NS.max(w.bucket_ns * w.len_buckets);
    let (now, reset) = feed.step(paused, keep)?;
    if reset {
        w.reset();
    }
    w.update(feed.rec(), now);
    if last_trim.elapsed() >= Duration::from_secs(5) {
        *last_trim = Instant::now();
        w.trim(feed.rec_mut(), keep);
    }
    Ok(())
}

fn drive(
    mut feed: Feed,
    recorder: &mut Recorder,
    window: Duration,
    label: String,
) -> anyhow::Result<()> {
    let window_ns = (window.as_nanos() as u64).max(BUCKETS);
    let mut w = window::Window::new(window_ns, BUCKETS, KEEP_NS);
    if std::io::stdout().is_terminal() {
        tui_loop(&mut feed, recorder, &mut w, &label)
    } else {
        plain_loop(&mut feed, recorder, &mut w)
    }
}

/// Stdout is not a terminal: print plain lines every 2 s (a replay runs unpaced, one block
/// per 2 s of recording) until the recording ends or a stop signal comes.
fn plain_loop(
    feed: &mut Feed,
    recorder: &mut Recorder,
    w: &mut window::Window,
) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    let mut recall = model::Recall::default();
    let mut print = |w: &window::Window, rec: &Recording| -> bool {
        let mut snap = model::snapshot(w, rec, &Topology::default());
        recall.apply(&mut snap);
        let mut text = plain::lines(&snap).join("\n");
        text.push('\n');
        // A closed pipe (`| head`) ends the run quietly.
        out.write_all(text.as_bytes())
            .and_then(|_| out.flush())
            .is_ok()
    };
    let mut last_trim = Instant::now();
    if let Feed::Replay { replay, .. } = feed {
        let step = PLAIN_EVERY.as_nanos() as u64;
        let mut t = 0;
        loop {
            t = (t + step).min(replay.len_ns);
            if replay.seek(t, KEEP_NS) {
                w.reset();
            }
            w.update(&replay.staged, t);
            if !print(w, &replay.staged) || replay.at_end() || terminal::signalled().is_some() {
                return Ok(());
            }
        }
    }
    let mut next_print = Instant::now() + PLAIN_EVERY;
    loop {
        std::thread::sleep(TICK);
        update(feed, w, false, &mut last_trim)?;
        let stop = terminal::signalled().is_some() || recorder.done();
        if stop || Instant::now() >= next_print {
            next_print += PLAIN_EVERY;
            if stop {
                // Let the recorder finish its file, and show what it wrote last.
                recorder.stop.stop();
                recorder.join();
                update(feed, w, false, &mut last_trim)?;
            }
            if !print(w, feed.rec()) || stop {
                return Ok(());
            }
        }
    }
}

/// A flamegraph being drawn on its own thread: (what, where it went or why not).
type FlameResult = (String, Result<PathBuf, String>);

/// A copy of the samples of the window shown (paused: the one on screen) and of the threads
/// shown, for a flamegraph.
fn flame_recording(rec: &Recording, app: &render::App) -> (Recording, String) {
    let ui = &app.ui;
    let keep: std::collections::HashSet<(i32, i32)> = if ui.view == app::View::Threads && ui.detail
    {
        ui.detail_thread(&app.snap)
            .map(|(_, t)| (t.pid, t.tid))
            .into_iter()
            .collect()
    } else {
        ui.rows(&app.snap)
            .iter()
            .filter_map(|r| match r {
                app::Row::Thread(_, t) => Some((t.pid, t.tid)),
                _ => None,
            })
            .collect()
    };
    let (start, end) = (app.snap.window_start_ns, app.snap.now_ns);
    let sub = Recording {
        meta: rec.meta.clone(),
        processes: rec.processes.clone(),
        threads: rec
            .threads
            .iter()
            .filter(|t| keep.contains(&(t.pid, t.tid)))
            .cloned()
            .collect(),
        frames: rec.frames.clone(),
        stacks: rec.stacks.clone(),
        samples: rec
            .samples
            .iter()
            .filter(|s| s.t_ns >= start && s.t_ns <= end && keep.contains(&(s.pid, s.tid)))
            .copied()
            .collect(),
        end: Some(EndInfo {
            duration_ns: end,
            reason: "enginescope top".into(),
        }),
        ..Recording::default()
    };
    let what = format!(
        "flamegraph of {:.1} s to {:.1} s ({} samples, {} threads)",
        start as f64 / 1e9,
        end as f64 / 1e9,
        sub.samples.len(),
        keep.len()
    );
    (sub, what)
}

/// `enginescope-top-<unix seconds>[-N].svg` in the current directory.
fn flame_path() -> anyhow::Result<PathBuf> {
    let dir = std::env::current_dir().context("finding the current directory")?;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut p = dir.join(format!("enginescope-top-{secs}.svg"));
    let mut n = 2;
    while p.exists() {
        p = dir.join(format!("enginescope-top-{secs}-{n}.svg"));
        n += 1;
    }
    Ok(p)
}

fn start_flame(sub: Recording, what: String, tx: mpsc::Sender<FlameResult>) {
    let _ = std::thread::Builder::new()
        .name("es-flame".into())
        .spawn(move || {
            let r = (|| -> anyhow::Result<PathBuf> {
                anyhow::ensure!(!sub.samples.is_empty(), "no samples in the window");
                let sel = crate::views::Filter::all().select(&sub);
                let svg = crate::views::flame::render_kind(
                    &sub,
                    &sel,
                    crate::views::flame::FlameKind::OnCpu,
                )?;
                let path = flame_path()?;
                std::fs::write(&path, svg)
                    .with_context(|| format!("writing {}", path.display()))?;
                Ok(path)
            })();
            let _ = tx.send((what, r.map_err(|e| format!("{e:#}"))));
        });
}

fn tui_loop(
    feed: &mut Feed,
    recorder: &mut Recorder,
    w: &mut window::Window,
    label: &str,
) -> anyhow::Result<()> {
    let (mut term, _guard) = terminal::enter()?;
    let mut app = render::App {
        header: feed.header(label),
        ..render::App::default()
    };
    let (flame_tx, flame_rx) = mpsc::channel::<FlameResult>();
    let mut recall = model::Recall::default();
    let mut next_tick = Instant::now();
    let mut last_trim = Instant::now();
    let mut dirty = true;
    let mut recorder_noted = false;
    let mut more_events = false;
    loop {
        if terminal::signalled().is_some() {
            return Ok(());
        }
        if Instant::now() >= next_tick {
            next_tick = Instant::now() + TICK;
            let t0 = Instant::now();
            update(feed, w, app.ui.paused, &mut last_trim)?;
            if !app.ui.paused {
                app.snap = model::snapshot(w, feed.rec(), &Topology::default());
                recall.apply(&mut app.snap);
            }
            let frame_ms = app.header.frame_ms;
            app.header = feed.header(label);
            app.header.frame_ms = frame_ms;
            app.header.update_ms = t0.elapsed().as_secs_f64() * 1e3;
            dirty = true;
        }
        if !recorder_noted && recorder.done() {
            recorder_noted = true;
            app.ui.status = match &recorder.outcome {
                Some(Err(e)) => format!("recorder stopped: {e:#}"),
                _ => "recorder finished".into(),
            };
            dirty = true;
        }
        while let Ok((what, r)) = flame_rx.try_recv() {
            app.ui.status = match r {
                Ok(p) => format!("{what} saved to {}", p.display()),
                Err(e) => format!("flamegraph not saved: {e}"),
            };
            dirty = true;
        }
        if dirty {
            let t0 = Instant::now();
            term.draw(|f| render::view(f, &app))
                .context("drawing the dashboard")?;
            app.header.frame_ms = t0.elapsed().as_secs_f64() * 1e3;
            dirty = false;
        }
        let timeout = next_tick
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(100));
        // After an event crossterm may hold more, parsed from the same read: ask it first.
        let wait = if more_events {
            Duration::ZERO
        } else {
            match terminal::wait_input(timeout) {
                Some(terminal::Input::HungUp) => return Ok(()),
                Some(terminal::Input::Idle) => continue,
                Some(terminal::Input::Ready) => Duration::ZERO,
                None => timeout,
            }
        };
        more_events = event::poll(wait).context("reading the terminal")?;
        if !more_events {
            continue;
        }
        match event::read().context("reading the terminal")? {
            Event::Key(k) => {
                dirty = true;
                match app.ui.on_key(&app.snap, k) {
                    app::Command::None => {}
                    app::Command::Quit => return Ok(()),
                    app::Command::Flame => {
                        let (sub, what) = flame_recording(feed.rec(), &app);
                        app.ui.status = format!("drawing {what}…");
                        start_flame(sub, what, flame_tx.clone());
                    }
                    app::Command::Speed(x) => match feed {
                        Feed::Replay { speed, .. } => {
                            *speed = (*speed * x).clamp(0.125, 64.0);
                            app.ui.status = format!("replay speed {}x", speed);
                            next_tick = Instant::now();
                        }
                        Feed::Live { .. } => app.ui.status = "speed: only when replaying".into(),
                    },
                    app::Command::Jump(forward) => match feed {
                        Feed::Replay { replay, .. } => {
                            let win = w.bucket_ns * w.len_buckets;
                            let t = if forward {
                                replay.clock_ns().saturating_add(win)
                            } else {
                                replay.clock_ns().saturating_sub(win)
                            };
                            let keep = KEEP_NS.max(win);
                            if replay.seek(t, keep) {
                                w.reset();
                            }
                            app.ui.status =
                                format!("jumped to {:.1} s", replay.clock_ns() as f64 / 1e9);
                            next_tick = Instant::now();
                        }
                        Feed::Live { .. } => app.ui.status = "jump: only when replaying".into(),
                    },
                }
                if matches!(
                    k.code,
                    event::KeyCode::Char('p') | event::KeyCode::Char(' ')
                ) {
                    // Resuming shows the present at once.
                    next_tick = Instant::now();
                }
            }
            Event::Resize(..) => dirty = true,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::synth::*;
    use ratatui::backend::TestBackend;

    fn thread_cpu_ms() -> f64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec we pass.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
    }

    /// The per-tick work (take in 250 ms of events, compute the snapshot, draw) of a busy live
    /// session: 8 threads on CPU all the time at 1 kHz each, 64 distinct 30-frame stacks, GIL
    /// waits, for 60 s. It must stay far below the 100 ms frame budget, and must not grow
    /// with the recording's length (the last ticks cost what the first ones did).
    #[test]
    fn per_tick_work_is_bounded() {
        let mut b = Rec::new().process(1, "python3 engine.py", "");
        let mut stacks = Vec::new();
        for i in 0..64 {
            let names: Vec<String> = (0..30).map(|d| format!("f{i}_{d}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            stacks.push(b.stack(&names, &format!("/srv/m{}.py", i % 8)));
        }
        for tid in 2..10 {
            b = b.thread(1, tid, &format!("worker-{tid}"));
        }
        let full = b.0;
        let mut live = Recording {
            frames: full.frames.clone(),
            stacks: full.stacks.clone(),
            threads: full.threads.clone(),
            processes: full.processes.clone(),
            ..Recording::default()
        };
        let mut w = window::Window::new(10 * S, BUCKETS, KEEP_NS);
        let mut term = ratatui::Terminal::new(TestBackend::new(200, 50)).expect("terminal");
        let mut app = render::App::default();
        let (mut cpu, mut wall) = (Vec::new(), Vec::new());
        let tick = 250 * MS;
        let mut t = 0;
        let mut n = 0u64;
        while t < 60 * S {
            // 250 ms of events from 8 threads.
            for ms in 0..250 {
                for tid in 2..10 {
                    n += 1;
                    live.samples.push(crate::record::Sample {
                        t_ns: t + ms * MS,
                        pid: 1,
                        tid,
                        stack: stacks[(n % 64) as usize],
                        flags: GIL,
                        weight_ns: MS as u32,
                    });
                }
            }
            live.gil_waits.push(crate::record::GilWait {
                pid: 1,
                tid: 2,
                start_ns: t,
                dur_ns: 5 * MS,
                holder_tid: 3,
                holder_stack: stacks[0],
                waiter_stack: 0,
                switch_wait: false,
            });
            t += tick;
            let (c0, t0) = (thread_cpu_ms(), Instant::now());
            w.update(&live, t);
            app.snap = model::snapshot(&w, &live, &Topology::default());
            term.draw(|f| render::view(f, &app)).expect("draw");
            cpu.push(thread_cpu_ms() - c0);
            wall.push(t0.elapsed().as_secs_f64() * 1e3);
            if t % (5 * S) == 0 {
                w.trim(&mut live, KEEP_NS);
            }
        }
        let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let n = cpu.len();
        let (first, last) = (mean(&cpu[40..80]), mean(&cpu[n - 40..]));
        eprintln!(
            "per tick (2000 samples in, snapshot, draw 200x50), {n} ticks: CPU time mean {:.1} ms \
             (10-20 s {first:.1} ms, last 10 s {last:.1} ms), max {:.1} ms; wall mean {:.1} ms, \
             max {:.1} ms",
            mean(&cpu),
            max(&cpu),
            mean(&wall),
            max(&wall)
        );
        let t = app.snap.thread((1, 2)).expect("worker");
        assert!((t.stats.cpu - 1.0).abs() < 1e-9, "{}", t.stats.cpu);
        assert!(live.samples.len() <= 61 * 8000, "old samples are trimmed");
        // CPU time, not wall time: other processes on a busy machine delay a tick without
        // making it more work. A debug build; release is several times faster.
        assert!(max(&cpu) < 100.0, "a tick took {:.1} ms of CPU", max(&cpu));
        assert!(
            last < first * 2.0 + 5.0,
            "tick cost grows with the recording: {first:.1} -> {last:.1} ms"
        );
    }
}
