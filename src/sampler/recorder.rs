//! The recording loop: one loop for every [`Source`]. Each tick the source writes what the
//! targets did; then the loop does the duties every source shares, in one place:
//!
//! * thread sync (every 100 ms): new, renamed and gone threads of each target, to the source
//!   and to the recording;
//! * exits: processes that ended are drained and forgotten; the recording stops when none is
//!   left, unless engines are followed (`--vllm`: an engine may start more);
//! * engine metrics: what the scraper sent, written as it comes;
//! * rediscovery (every 2 s, `--vllm`): engine processes that started are attached;
//! * asyncio tasks: what each target's task reader (src/sampler/tasks.rs, a thread per target)
//!   sent, written as it comes (record 18);
//! * flush (every 200 ms) and rotation (the agent).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::engines::EngineSession;
use super::output::Rotator;
use super::source::Source;
use super::target::{Target, Targets};
use super::{Pipeline, RecordOptions};
use crate::cpython::PythonProcess;
use crate::record::{ProcessInfo, ThreadInfo};
use crate::sys::monotonic_ns;

const THREADS_EVERY: Duration = Duration::from_millis(100);
/// How long a target that exec'd is given to start its new interpreter: a Python's start-up,
/// with its imports, on a loaded machine.
const EXEC_START_MAX: Duration = Duration::from_secs(10);
const FLUSH_EVERY: Duration = Duration::from_millis(200);
/// The warm-up before the window ([`Recorder::warm_up`]): at least this long, so that every
/// busy thread has been read a few times and sampled.
const WARM_MIN: Duration = Duration::from_millis(300);
/// It ends once no probe or thread watch has been added for this long.
const WARM_QUIET: Duration = Duration::from_millis(200);
/// And at this at the most: a probe found later carries its own start (coverage).
const WARM_MAX: Duration = Duration::from_millis(1500);

/// One turn of the recording loop: `period` drawn uniform within a quarter of it either
/// way. A fixed turn keeps step with a target paced by a timer (a 5 ms step loop against a
/// 20 ms turn): the memory source's stacks, and the warm-up's walks that find probed
/// functions, would then always meet it at the same point of its step.
fn turn(period: Duration, rng: &mut u64) -> Duration {
    let u = crate::sys::unit_random(rng);
    period.mul_f64(0.75 + 0.5 * u)
}

pub struct Recorder<'a> {
    pub opts: &'a RecordOptions,
    pub targets: Targets,
    pub pipe: Pipeline,
    pub source: Box<dyn Source>,
    pub engines: Option<EngineSession>,
    pub rotator: Option<Rotator>,
    /// Counters of targets that exited and were dropped, so that totals never go back.
    exited_unresolved_frames: u64,
    exited_code_rereads: u64,
    /// Targets attached again after they exec'd (counter `targets_reattached_after_exec`).
    exec_reattaches: u64,
    /// Targets that exec'd a new program, waiting for its interpreter to start, and since when.
    exec_pending: Vec<(i32, Instant)>,
    /// Whether the recording loop runs as a real-time thread ([`crate::sys::realtime_this_thread`];
    /// counter `recorder_realtime`).
    realtime: bool,
    /// Times the loop became real-time again after a busy spell (`recorder_realtime_regained`).
    realtime_regained: u64,
    /// Whether the loop may run real-time at all (it could when it began).
    can_realtime: bool,
    /// `--measure-cost`'s arm holds the loop at normal priority (its `realtime` part off).
    realtime_off: bool,
    /// The running asyncio tasks of the targets.
    tasks: super::tasks::TaskReaders,
    /// When the window began ([`Self::begin_window`]): `--duration` counts from here.
    window_start: Option<Instant>,
    /// `--measure-cost`: the measurement under way.
    pub cost: Option<super::cost::CostRun>,
    /// A single file's counters as last written while recording, and when (a rotating
    /// recording's [`Rotator`] keeps its own).
    live_counters: super::output::LiveCounters,
}

impl<'a> Recorder<'a> {
    pub fn new(
        opts: &'a RecordOptions,
        targets: Targets,
        pipe: Pipeline,
        source: Box<dyn Source>,
        rotator: Option<Rotator>,
    ) -> Self {
        Recorder {
            opts,
            targets,
            pipe,
            source,
            engines: None,
            rotator,
            exited_unresolved_frames: 0,
            exited_code_rereads: 0,
            exec_reattaches: 0,
            exec_pending: Vec::new(),
            realtime: false,
            realtime_regained: 0,
            can_realtime: false,
            realtime_off: false,
            tasks: super::tasks::TaskReaders::default(),
            window_start: None,
            cost: None,
            live_counters: super::output::LiveCounters::new(),
        }
    }

    fn say(&self, msg: impl FnOnce() -> String) {
        if !self.opts.quiet {
            eprintln!("enginescope: {}", msg());
        }
    }

    /// Start the source on the targets attached so far. A discovered engine process that
    /// cannot be set up (it exited while we attached) is skipped; a `--pid` target is an error.
    pub fn start(&mut self) -> anyhow::Result<()> {
        // Threads first, then targets: once a target is configured its threads' events count.
        {
            let _s = crate::sys::steps::step("threads");
            self.sync_threads()?;
        }
        let failed = self.source.start(&mut self.targets, &mut self.pipe)?;
        let mut skipped = Vec::new();
        for (pid, e) in failed {
            if self.engines.is_none() {
                return Err(e);
            }
            self.say(|| format!("engine process {pid} skipped: {e:#}"));
            skipped.push(pid);
        }
        if !skipped.is_empty() {
            self.drop_exited(&skipped, true)?;
        }
        Ok(())
    }

    /// Before the window: the loop's duties (drain, threads, exits) with nothing written,
    /// while every thread's stack is read from memory so that the probes are found and set
    /// on the threads that run them. Ends once no probe or thread has been added for
    /// [`WARM_QUIET`] (after at least [`WARM_MIN`]), at [`WARM_MAX`] at the most, or when
    /// stopped. Without probes there is nothing to wait for.
    pub(crate) fn warm_up(&mut self) -> anyhow::Result<()> {
        if self.opts.probes.is_empty() || self.source.name() != "bpf" {
            return Ok(());
        }
        let _s = crate::sys::steps::step("warm_up");
        let started = Instant::now();
        let mut placed = self
            .source
            .look_for_probes(&mut self.targets, &mut self.pipe)?;
        let mut changed = Instant::now();
        let mut last_threads = Instant::now();
        let period = self.source.period();
        let mut rng = crate::sys::random_seed();
        loop {
            let e = started.elapsed();
            if self.opts.stop.is_stopped()
                || e >= WARM_MAX
                || (e >= WARM_MIN && changed.elapsed() >= WARM_QUIET)
            {
                break;
            }
            std::thread::sleep(turn(period, &mut rng));
            self.source.collect(&mut self.targets, &mut self.pipe)?;
            if last_threads.elapsed() >= THREADS_EVERY {
                last_threads = Instant::now();
                self.sync_threads()?;
                self.drop_exited_targets()?;
            }
            let now = self
                .source
                .look_for_probes(&mut self.targets, &mut self.pipe)?;
            if now != placed {
                placed = now;
                changed = Instant::now();
            }
        }
        Ok(())
    }

    /// The window begins at `start_ns` (absolute): from here on what happens is written, the
    /// task readers and the metrics scraper start, and `--duration` counts.
    pub(crate) fn begin_window(&mut self, start_ns: u64) -> anyhow::Result<()> {
        self.pipe.begin_window(start_ns);
        let ago = Duration::from_nanos(monotonic_ns().saturating_sub(start_ns));
        let now = Instant::now();
        self.window_start = Some(now.checked_sub(ago).unwrap_or(now));
        for t in self.targets.iter() {
            self.tasks.watch(t.pid, start_ns);
        }
        // Scripts and tests that need the whole of some activity recorded start it after
        // this line.
        self.say(|| "sampling started".into());
        Ok(())
    }

    /// Record until stopped, the duration ends, or every target has exited; returns why.
    pub fn run(&mut self) -> anyhow::Result<String> {
        // The thread is a normal one again however run() returns (it may go on: top, demo).
        struct Normal;
        impl Drop for Normal {
            fn drop(&mut self) {
                crate::sys::normal_this_thread();
            }
        }
        match crate::sys::realtime_this_thread() {
            Ok(()) => self.realtime = true,
            Err(e) => self.say(|| {
                format!("the recording loop runs at normal priority ({e}): on a busy machine it may fall behind and lose events")
            }),
        }
        // Allowed at all (a container may refuse it): then regained after a busy spell.
        self.can_realtime = self.realtime;
        let _normal = self.can_realtime.then_some(Normal);
        let mut quiet_seconds = 0u32;
        let mut cpu_mark = crate::sys::thread_cpu_ns();
        if let Some(plan) = self.opts.cost.clone() {
            let urls = self
                .engines
                .as_ref()
                .map(|e| e.metrics_urls())
                .unwrap_or_default();
            let run = super::cost::CostRun::new(plan, urls, self.pipe.start_ns)?;
            let total = run.total();
            self.say(|| {
                format!(
                    "measuring what this recording costs: {:.0} s of slices, its parts switched off and on",
                    total.as_secs_f64()
                )
            });
            self.cost = Some(run);
        }
        let since = self.window_start.unwrap_or_else(Instant::now);
        let deadline = self.opts.duration.map(|d| since + d);
        let period = self.source.period();
        let mut rng = crate::sys::random_seed();
        let mut next = Instant::now();
        // Real-time only while the loop mostly sleeps: a loop that cannot keep up would take
        // its CPU from the target's threads, so past half of a second busy it runs as a
        // normal thread again (and loses what it cannot drain, as one would).
        let (mut busy, mut busy_since) = (Duration::ZERO, Instant::now());
        let mut last_threads = Instant::now();
        let mut last_flush = Instant::now();
        loop {
            if self.opts.stop.is_stopped() {
                return Ok("stopped by signal".into());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok("duration reached".into());
            }
            next += turn(period, &mut rng);
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            } else {
                next = now;
            }
            let work = Instant::now();
            if work.duration_since(busy_since) >= Duration::from_secs(1) {
                if self.realtime && busy > Duration::from_millis(500) {
                    crate::sys::normal_this_thread();
                    self.realtime = false;
                    quiet_seconds = 0;
                    self.say(|| {
                        format!("the recording loop was busy {busy:?} of the last second: back to normal priority")
                    });
                } else if !self.realtime && self.can_realtime && !self.realtime_off {
                    // Its CPU time, not its wall time: at normal priority on a busy machine
                    // the wall time of its work is mostly waiting to run.
                    let cpu = crate::sys::thread_cpu_ns();
                    let busy = Duration::from_nanos(cpu.saturating_sub(cpu_mark));
                    // Busy spells come at the start (new code objects, symbol tables): once
                    // the loop is light again it is real-time again, so that what it does on
                    // time (register turns, --probe-budget's phases) is not put off until the
                    // target idles, which would tie what is watched to the target's load.
                    quiet_seconds = if busy < Duration::from_millis(100) {
                        quiet_seconds + 1
                    } else {
                        0
                    };
                    if quiet_seconds >= 3 && crate::sys::realtime_this_thread().is_ok() {
                        self.realtime = true;
                        self.realtime_regained += 1;
                        quiet_seconds = 0;
                        self.say(|| {
                            "the recording loop was busy under 10% for 3 s: real-time priority again"
                                .to_string()
                        });
                    }
                }
                (busy, busy_since) = (Duration::ZERO, work);
                cpu_mark = crate::sys::thread_cpu_ns();
            }
            self.source.collect(&mut self.targets, &mut self.pipe)?;
            if let Some(done) = self.cost_tick()? {
                return Ok(done);
            }
            if last_threads.elapsed() >= THREADS_EVERY {
                last_threads = Instant::now();
                self.sync_threads()?;
                self.drop_exited_targets()?;
                // Engines followed by --vllm may start again; --pid targets with their own
                // --metrics-url are all there is.
                if self.targets.is_empty()
                    && self.exec_pending.is_empty()
                    && (self.engines.is_none() || !self.opts.vllm)
                {
                    return Ok("all targets exited".into());
                }
            }
            self.tasks.drain(&mut self.pipe.writer)?;
            if let Some(e) = self.engines.as_mut() {
                e.poll_metrics(&mut self.pipe)?;
            }
            self.attach_new_engine_processes()?;
            if last_flush.elapsed() >= FLUSH_EVERY {
                last_flush = Instant::now();
                let mono = monotonic_ns();
                let now = mono.saturating_sub(self.pipe.start_ns);
                // The agent's profile endpoint may ask for the interval to end now.
                let cut = self.rotator.as_ref().is_some_and(|r| {
                    r.policy
                        .cut_interval
                        .swap(false, std::sync::atomic::Ordering::SeqCst)
                });
                if cut || self.pipe.writer.profile_due(now) {
                    // Open intervals count in each aggregation interval they span.
                    self.pipe.split_open_at(mono)?;
                }
                if cut {
                    self.pipe.writer.profile_cut(now)?;
                } else {
                    self.pipe.writer.profile_tick(now)?;
                }
                self.pipe.writer.flush()?;
                self.rotate_if_due()?;
            }
            busy += work.elapsed();
        }
    }

    /// `--measure-cost`: at a slice's edge, switch the parts of the next slice off (the rest
    /// on); Some(reason) once every slice is measured (everything on again).
    fn cost_tick(&mut self) -> anyhow::Result<Option<String>> {
        let Some(run) = self.cost.as_mut() else {
            return Ok(None);
        };
        let (mask, done) = match run.tick(Instant::now()) {
            super::cost::Tick::Wait => return Ok(None),
            super::cost::Tick::Apply(mask) => (mask, false),
            super::cost::Tick::Done => (0, true),
        };
        let switches_off = mask & crate::bpf::abi::OFF_SWITCH != 0;
        let edge = monotonic_ns();
        if !switches_off {
            // Before the kernel side sends switches again: none of them is dropped.
            self.pipe.resume_switches();
        }
        self.source.set_off(mask, &self.targets)?;
        if switches_off && !self.pipe.switches_paused() {
            // What the kernel handed over before the edge, then the edge itself.
            self.source.collect(&mut self.targets, &mut self.pipe)?;
            self.pipe.pause_switches(edge)?;
        }
        self.tasks.pause(mask & super::cost::OFF_TASKS != 0);
        self.hold_normal_priority(mask & super::cost::OFF_REALTIME != 0);
        let realtime = crate::sys::is_realtime_this_thread();
        if let Some(run) = self.cost.as_mut() {
            run.note_loop_realtime(realtime);
        }
        Ok(done.then(|| "cost measured".to_string()))
    }

    /// `--measure-cost`'s `realtime` part: its off arm runs the loop as a normal thread (as
    /// `ENGINESCOPE_NO_REALTIME=1` would), its on arm real-time again where the loop may be.
    fn hold_normal_priority(&mut self, normal: bool) {
        self.realtime_off = normal;
        if normal && self.realtime {
            crate::sys::normal_this_thread();
            self.realtime = false;
        } else if !normal
            && !self.realtime
            && self.can_realtime
            && crate::sys::realtime_this_thread().is_ok()
        {
            self.realtime = true;
        }
    }

    /// Push thread changes of every target to the source and the recording.
    fn sync_threads(&mut self) -> anyhow::Result<()> {
        let now = self.pipe.rel(monotonic_ns());
        for t in self.targets.iter_mut() {
            if !self.pipe.pre_window {
                self.tasks.watch(t.pid, self.pipe.start_ns);
            }
            let (changed, gone) = t.refresh_threads();
            let tstates: Vec<(i32, u64)> = changed.iter().map(|&(tid, ts, _)| (tid, ts)).collect();
            self.source.threads_changed(t.pid, &tstates, &gone)?;
            let native = std::mem::take(&mut t.native_changes);
            let names: Vec<(i32, String, Option<String>)> = changed
                .into_iter()
                .map(|(tid, _, name)| (tid, name, t.python_names.get(&tid).cloned()))
                .chain(native.into_iter().map(|(tid, name)| (tid, name, None)))
                .collect();
            for (tid, name, python_name) in names {
                self.pipe.writer.thread(&ThreadInfo {
                    pid: t.pid,
                    tid,
                    name,
                    t_ns: now,
                    python_name,
                })?;
            }
        }
        Ok(())
    }

    fn drop_exited_targets(&mut self) -> anyhow::Result<()> {
        let exited: Vec<i32> = self
            .targets
            .iter()
            .filter(|t| !crate::procinfo::is_running(t.pid))
            .map(|t| t.pid)
            .collect();
        if !exited.is_empty() {
            self.drop_exited(&exited, self.opts.quiet)?;
        }
        self.attach_again_after_exec()
    }

    /// Targets that exec'd a new program (same pid, new image): what was read of the old
    /// interpreter no longer holds, so each is dropped as if it had exited, and attached again
    /// once the new program is a Python whose interpreter has started
    /// ([`PythonProcess::initialized`]): the exec is seen within a turn of the
    /// loop, before the new interpreter exists. A program that is not a Python, or not started
    /// within [`EXEC_START_MAX`], is said and left.
    fn attach_again_after_exec(&mut self) -> anyhow::Result<()> {
        let execd: Vec<i32> = self
            .targets
            .iter()
            .filter(|t| {
                t.image.is_some()
                    && crate::procinfo::image_id(t.pid)
                        .is_some_and(|i| Some(&i) != t.image.as_ref())
            })
            .map(|t| t.pid)
            .collect();
        for pid in execd {
            self.drop_exited(&[pid], true)?;
            self.exec_pending.push((pid, Instant::now()));
        }
        let mut waiting = Vec::new();
        for (pid, since) in std::mem::take(&mut self.exec_pending) {
            if !crate::procinfo::is_running(pid) {
                self.say(|| format!("process {pid} exec'd a new program and exited"));
                continue;
            }
            let attached = PythonProcess::attach(pid)
                .map_err(anyhow::Error::from)
                .and_then(|p| p.initialized().map(|()| p).map_err(anyhow::Error::from));
            match attached {
                Ok(p) => {
                    self.exec_reattaches += 1;
                    self.add_target(Target::new(p), String::new(), "exec'd process")?;
                }
                Err(_) if since.elapsed() < EXEC_START_MAX => waiting.push((pid, since)),
                Err(err) => self.say(|| {
                    format!(
                        "process {pid} exec'd a new program and is no longer recorded \
                         (after {:.1} s): {err:#}",
                        since.elapsed().as_secs_f64()
                    )
                }),
            }
        }
        self.exec_pending = waiting;
        Ok(())
    }

    /// Forget processes that exited: their last events are written first, then the source's
    /// state and their caches (code objects, ELF tables) go, so that a long recording with
    /// processes coming and going stays the same size in memory.
    fn drop_exited(&mut self, exited: &[i32], quiet: bool) -> anyhow::Result<()> {
        self.source
            .remove_targets(&mut self.targets, exited, &mut self.pipe)?;
        self.tasks.stop(exited, &mut self.pipe.writer)?;
        for t in self.targets.remove(exited) {
            self.exited_unresolved_frames += t.sym.unresolved_frames;
            self.exited_code_rereads += t.sym.code_rereads;
            if !quiet {
                eprintln!("enginescope: process {} exited", t.pid);
            }
        }
        Ok(())
    }

    /// `--vllm`: attach the engine processes that rediscovery found.
    fn attach_new_engine_processes(&mut self) -> anyhow::Result<()> {
        let Some(e) = self.engines.as_mut() else {
            return Ok(());
        };
        for (pid, role) in e.rediscover_due(&mut self.pipe, self.opts)? {
            if self.targets.contains(pid) {
                continue;
            }
            match PythonProcess::attach(pid) {
                Ok(p) => self.add_target(Target::new(p), role, "new engine process")?,
                Err(err) => self.say(|| format!("new engine process {pid}: {err}")),
            }
        }
        Ok(())
    }

    /// Record target `t` from now on (`what`: how it is named in what the recorder says).
    fn add_target(&mut self, t: Target, role: String, what: &str) -> anyhow::Result<()> {
        let pid = t.pid;
        self.pipe.writer.process(&ProcessInfo {
            pid,
            cmdline: t.cmdline.clone(),
            python_version: t.proc.version.to_string(),
            role,
        })?;
        let t = self.targets.push(t);
        let (changed, gone) = t.refresh_threads();
        let tstates: Vec<(i32, u64)> = changed.iter().map(|&(tid, ts, _)| (tid, ts)).collect();
        let setup = self
            .source
            .threads_changed(pid, &tstates, &gone)
            .and_then(|()| self.source.add_target(t));
        let now = self.pipe.rel(monotonic_ns());
        let native = std::mem::take(&mut t.native_changes);
        let names: Vec<(i32, String, Option<String>)> = changed
            .into_iter()
            .map(|(tid, _, name)| (tid, name, t.python_names.get(&tid).cloned()))
            .chain(native.into_iter().map(|(tid, name)| (tid, name, None)))
            .collect();
        for (tid, name, python_name) in names {
            self.pipe.writer.thread(&ThreadInfo {
                pid,
                tid,
                name,
                t_ns: now,
                python_name,
            })?;
        }
        match setup {
            Ok(()) => self.say(|| format!("attached to {what} {pid}")),
            // It exited right after attaching (workers come and go): forget it; not a reason
            // to stop recording.
            Err(e) => {
                self.say(|| format!("{what} {pid} skipped: {e:#}"));
                self.drop_exited(&[pid], true)?;
            }
        }
        Ok(())
    }

    fn rotate_if_due(&mut self) -> anyhow::Result<()> {
        let task_counters = self.tasks.counters();
        let Some(r) = self.rotator.as_mut() else {
            // One file: its counters too are written while it is recorded (what changed,
            // every few seconds), for a reader that follows it: top's cost in its header,
            // lost events.
            if self.live_counters.due() {
                let c = self.counters();
                self.live_counters.write(&mut self.pipe.writer, c)?;
            }
            return Ok(());
        };
        let (source, targets, engines) = (&self.source, &self.targets, &self.engines);
        let exited = (self.exited_unresolved_frames, self.exited_code_rereads);
        let (realtime, regained) = (self.realtime, self.realtime_regained);
        r.periodic(&mut self.pipe, &|p, r| {
            let mut c = counters(
                source.as_ref(),
                targets,
                engines.as_ref(),
                exited,
                p,
                Some(r),
            );
            c.extend(task_counters.iter().map(|(k, v)| (k.to_string(), *v)));
            c.insert("recorder_realtime".into(), u64::from(realtime));
            c.insert("recorder_realtime_regained".into(), regained);
            c
        })
    }

    /// The recording's failure-path and health counters now (docs/recording-format.md,
    /// record 8).
    pub fn counters(&self) -> BTreeMap<String, u64> {
        let mut c = counters(
            self.source.as_ref(),
            &self.targets,
            self.engines.as_ref(),
            (self.exited_unresolved_frames, self.exited_code_rereads),
            &self.pipe,
            self.rotator.as_ref(),
        );
        c.extend(
            self.tasks
                .counters()
                .iter()
                .map(|(k, v)| (k.to_string(), *v)),
        );
        c.insert("targets_reattached_after_exec".into(), self.exec_reattaches);
        c.insert("recorder_realtime".into(), u64::from(self.realtime));
        c.insert("recorder_realtime_regained".into(), self.realtime_regained);
        c
    }

    /// Stop the source and the scraper, write what they have left and close the intervals
    /// still open at `end_ns`.
    pub fn finish(&mut self, end_ns: u64) -> anyhow::Result<()> {
        use crate::sys::steps::step;
        {
            let _s = step("finish_source");
            self.source.finish(&mut self.targets, &mut self.pipe)?;
        }
        {
            let _s = step("finish_tasks");
            self.tasks.finish(&mut self.pipe.writer)?;
        }
        if let Some(e) = self.engines.as_mut() {
            let _s = step("finish_scraper");
            e.finish(&mut self.pipe)?;
        }
        self.pipe.close(end_ns)
    }
}

/// The counters of every part: the source's, the symbolizers' (targets alive and exited:
/// unresolved frames, code re-reads), the scraper's and the rotation's.
fn counters(
    source: &dyn Source,
    targets: &Targets,
    engines: Option<&EngineSession>,
    (exited_unresolved, exited_rereads): (u64, u64),
    pipe: &Pipeline,
    rotator: Option<&Rotator>,
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    source.counters(pipe, &mut out);
    out.insert(
        "unresolved_frames".into(),
        exited_unresolved + targets.iter().map(|t| t.sym.unresolved_frames).sum::<u64>(),
    );
    out.insert(
        "code_object_rereads".into(),
        exited_rereads + targets.iter().map(|t| t.sym.code_rereads).sum::<u64>(),
    );
    out.insert(
        "thread_list_read_failures".into(),
        targets.iter().map(|t| t.thread_list_failures).sum::<u64>(),
    );
    out.insert(
        "thread_list_partial_reads".into(),
        targets
            .iter()
            .map(|t| t.thread_list_partial_reads)
            .sum::<u64>(),
    );
    out.insert(
        "threads_kept_unlisted".into(),
        targets.iter().map(|t| t.threads_kept_unlisted).sum::<u64>(),
    );
    if let Some(e) = engines {
        out.insert("metric_points".into(), e.metric_points);
        out.insert("scrape_errors".into(), e.scrape_errors);
    }
    if let Some(r) = rotator {
        r.counters(&mut out);
    }
    out
}
