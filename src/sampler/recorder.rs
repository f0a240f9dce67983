//! The recording loop: one loop for every [`Source`]. Each tick the source writes what the
//! targets did; then the loop does the duties every source shares, in one place:
//!
//! * thread sync (every 100 ms): new, renamed and gone threads of each target, to the source
//!   and to the recording;
//! * exits: processes that ended are drained and forgotten; the recording stops when none is
//!   left, unless engines are followed (`--vllm`: an engine may start more);
//! * engine metrics: what the scraper sent, written as it comes;
//! * rediscovery (every 2 s, `--vllm`): engine processes that started are attached;
//! * asyncio tasks (every 20 ms): the task each event-loop thread runs, read from the target's
//!   memory (src/cpython/asyncio.rs), written when it changes (record 18): a loop stall is one
//!   task step, so a stall of at least a few reads' length is named by the task that ran;
//! * flush (every 200 ms) and rotation (the agent).

use std::collections::{BTreeMap, HashMap};
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
const FLUSH_EVERY: Duration = Duration::from_millis(200);
/// How often the running asyncio task of each thread is read: a few reads per thread, and a
/// stack walk of the threads that run one (a loop stall over 100 ms is read five times).
pub const TASKS_EVERY: Duration = Duration::from_millis(20);

/// What the recorder knows of one target's asyncio tasks.
#[derive(Default)]
struct TaskWatch {
    reader: crate::cpython::asyncio::AsyncioTasks,
    /// Names of the chains' frames (its own: the sources' symbolizer attributes new code to
    /// the thread being resolved).
    sym: crate::cpython::symbols::Symbolizer,
    /// The task last written per thread.
    last: std::collections::HashMap<i32, crate::cpython::asyncio::RunningTask>,
    /// Reads done (one per target per [`TASKS_EVERY`]) and the time they took, ns.
    reads: u64,
    read_ns: u64,
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
    /// Per target pid.
    tasks: HashMap<i32, TaskWatch>,
    /// Task-read counters of targets that exited (errors, reads, ns).
    exited_task_reads: [u64; 3],
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
            tasks: std::collections::HashMap::new(),
            exited_task_reads: [0; 3],
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
        self.sync_threads()?;
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
        // Scripts and tests that need the whole of some activity recorded start it after
        // this line.
        self.say(|| "sampling started".into());
        Ok(())
    }

    /// Record until stopped, the duration ends, or every target has exited; returns why.
    pub fn run(&mut self) -> anyhow::Result<String> {
        let deadline = self.opts.duration.map(|d| Instant::now() + d);
        let period = self.source.period();
        let mut next = Instant::now();
        let mut last_threads = Instant::now();
        let mut last_flush = Instant::now();
        let mut last_tasks = Instant::now();
        loop {
            if self.opts.stop.is_stopped() {
                return Ok("stopped by signal".into());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok("duration reached".into());
            }
            next += period;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            } else {
                next = now;
            }
            self.source.collect(&mut self.targets, &mut self.pipe)?;
            if last_threads.elapsed() >= THREADS_EVERY {
                last_threads = Instant::now();
                self.sync_threads()?;
                self.drop_exited_targets()?;
                if self.targets.is_empty() && self.engines.is_none() {
                    return Ok("all targets exited".into());
                }
            }
            if last_tasks.elapsed() >= TASKS_EVERY {
                last_tasks = Instant::now();
                self.sync_tasks()?;
            }
            if let Some(e) = self.engines.as_mut() {
                e.poll_metrics(&mut self.pipe)?;
            }
            self.attach_new_engine_processes()?;
            if last_flush.elapsed() >= FLUSH_EVERY {
                last_flush = Instant::now();
                self.pipe.writer.flush()?;
                self.rotate_if_due()?;
            }
        }
    }

    /// Push thread changes of every target to the source and the recording.
    fn sync_threads(&mut self) -> anyhow::Result<()> {
        let now = monotonic_ns().saturating_sub(self.pipe.start_ns);
        for t in self.targets.iter_mut() {
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

    /// Read the running asyncio task of every thread and write the changes.
    fn sync_tasks(&mut self) -> anyhow::Result<()> {
        for t in self.targets.iter_mut() {
            let w = self.tasks.entry(t.pid).or_default();
            let t0 = Instant::now();
            let mut tstates: Vec<(i32, u64)> =
                t.threads.iter().map(|(&tid, &(ts, _))| (tid, ts)).collect();
            tstates.sort_unstable();
            let addrs: Vec<u64> = tstates.iter().map(|&(_, ts)| ts).collect();
            let running = t.proc.running_tasks(&mut w.reader, &addrs);
            let now = monotonic_ns().saturating_sub(self.pipe.start_ns);
            for (tid, ts) in tstates {
                let task = running.get(&ts).and_then(|&task| {
                    t.proc
                        .describe_running_task(&mut w.reader, &mut w.sym, ts, task)
                });
                if task.as_ref() == w.last.get(&tid) {
                    continue;
                }
                match &task {
                    Some(k) => w.last.insert(tid, k.clone()),
                    None => w.last.remove(&tid),
                };
                self.pipe.writer.task_change(&crate::record::TaskChange {
                    t_ns: now,
                    pid: t.pid,
                    tid,
                    task,
                })?;
            }
            // Threads gone.
            w.last.retain(|tid, _| t.threads.contains_key(tid));
            w.reads += 1;
            w.read_ns += t0.elapsed().as_nanos() as u64;
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
        if exited.is_empty() {
            return Ok(());
        }
        self.drop_exited(&exited, self.opts.quiet)
    }

    /// Forget processes that exited: their last events are written first, then the source's
    /// state and their caches (code objects, ELF tables) go, so that a long recording with
    /// processes coming and going stays the same size in memory.
    fn drop_exited(&mut self, exited: &[i32], quiet: bool) -> anyhow::Result<()> {
        self.source
            .remove_targets(&mut self.targets, exited, &mut self.pipe)?;
        for t in self.targets.remove(exited) {
            if let Some(w) = self.tasks.remove(&t.pid) {
                for (total, v) in
                    self.exited_task_reads
                        .iter_mut()
                        .zip([w.reader.errors, w.reads, w.read_ns])
                {
                    *total += v;
                }
            }
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
                Ok(p) => self.add_target(Target::new(p), role)?,
                Err(err) => self.say(|| format!("new engine process {pid}: {err}")),
            }
        }
        Ok(())
    }

    fn add_target(&mut self, t: Target, role: String) -> anyhow::Result<()> {
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
        let now = monotonic_ns().saturating_sub(self.pipe.start_ns);
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
            Ok(()) => self.say(|| format!("attached to new engine process {pid}")),
            // It exited right after attaching (workers come and go): forget it; not a reason
            // to stop recording.
            Err(e) => {
                self.say(|| format!("new engine process {pid} skipped: {e:#}"));
                self.drop_exited(&[pid], true)?;
            }
        }
        Ok(())
    }

    fn rotate_if_due(&mut self) -> anyhow::Result<()> {
        let task_counters = task_counters(&self.tasks, self.exited_task_reads);
        let Some(r) = self.rotator.as_mut() else {
            return Ok(());
        };
        let (source, targets, engines) = (&self.source, &self.targets, &self.engines);
        let exited = (self.exited_unresolved_frames, self.exited_code_rereads);
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
            task_counters(&self.tasks, self.exited_task_reads)
                .iter()
                .map(|(k, v)| (k.to_string(), *v)),
        );
        c
    }

    /// Stop the source and the scraper, write what they have left and close the intervals
    /// still open at `end_ns`.
    pub fn finish(&mut self, end_ns: u64) -> anyhow::Result<()> {
        self.source.finish(&mut self.targets, &mut self.pipe)?;
        if let Some(e) = self.engines.as_mut() {
            e.finish(&mut self.pipe)?;
        }
        self.pipe.close(end_ns)
    }
}

/// Of the targets attached and `exited`: failed reads of running asyncio tasks (implausible objects,
/// unreadable addresses), the reads done (one per target every [`TASKS_EVERY`]) and the time
/// they took, µs.
fn task_counters(tasks: &HashMap<i32, TaskWatch>, exited: [u64; 3]) -> [(&'static str, u64); 3] {
    let sum = |f: fn(&TaskWatch) -> u64| tasks.values().map(f).sum::<u64>();
    [
        (
            "asyncio_task_read_errors",
            exited[0] + sum(|w| w.reader.errors),
        ),
        ("asyncio_task_reads", exited[1] + sum(|w| w.reads)),
        (
            "asyncio_task_read_us",
            (exited[2] + sum(|w| w.read_ns)) / 1000,
        ),
    ]
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
    if let Some(e) = engines {
        out.insert("metric_points".into(), e.metric_points);
        out.insert("scrape_errors".into(), e.scrape_errors);
    }
    if let Some(r) = rotator {
        r.counters(&mut out);
    }
    out
}
