//! The running asyncio task of each event-loop thread, read from the target's memory
//! (src/cpython/asyncio.rs) every [`TASKS_EVERY`] by one thread per target, apart from the
//! recording loop: that loop's work (draining and symbolizing samples) can hold it for longer
//! than a loop stall on a loaded machine (a 185 ms stall went without a read when the reads
//! were made by the loop itself, at a load average of 17 on 2 CPUs). The reader runs at nice
//! -20, since at the default priority it too went 1.2 s without a read at a load average of 14;
//! it sleeps between reads of about a millisecond each. Each thread attaches on its own (its
//! own reader state and symbolizer), reads its threads' states every 100 ms, and sends a
//! [`TaskChange`] when a thread's task, coroutine or chain changes; the recording loop writes
//! them (record 18). A loop stall is one task step, so a stall of a few reads' length is named
//! by the task that ran. A target that runs no task for [`IDLE_AFTER`] is read every
//! [`IDLE_EVERY`] until one runs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cpython::asyncio::{AsyncioTasks, RunningTask};
use crate::cpython::symbols::Symbolizer;
use crate::cpython::PythonProcess;
use crate::record::{RecordingWriter, TaskChange};
use crate::sys::monotonic_ns;

/// How often each target's running tasks are read: a few reads per thread, and a stack walk
/// of the threads that run one.
pub(crate) const TASKS_EVERY: Duration = Duration::from_millis(20);
/// A target none of whose threads ran an asyncio task for this long (an engine core, a
/// worker: no event loop; an idle server) is read every [`IDLE_EVERY`] until one runs again:
/// at 20 ms, three vLLM processes took ~3,700 reads of their memory a second.
const IDLE_AFTER: Duration = Duration::from_secs(2);
const IDLE_EVERY: Duration = Duration::from_millis(250);
/// How long stopping waits for the readers to end.
const STOP_WAIT: Duration = Duration::from_millis(100);
/// How often a reader refreshes its target's thread list.
const THREADS_EVERY: Duration = Duration::from_millis(100);
/// Changes a reader may have queued before it waits for the recording loop (bounded memory).
const QUEUE: usize = 4096;

/// Reads done, the time they took (ns) and failed object reads, of one target.
#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    read_ns: AtomicU64,
    errors: AtomicU64,
}

struct Reader {
    rx: mpsc::Receiver<TaskChange>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    handle: Option<std::thread::JoinHandle<()>>,
}

/// One task reader per target.
#[derive(Default)]
pub(crate) struct TaskReaders {
    readers: HashMap<i32, Reader>,
    /// Counters of readers stopped (errors, reads, ns).
    stopped: [u64; 3],
    /// Every reader skips its reads while set (`record --measure-cost`'s off arms).
    paused: Arc<AtomicBool>,
}

impl TaskReaders {
    /// Start reading target `pid` (times as ns since `start_ns`), unless it is read already.
    pub fn watch(&mut self, pid: i32, start_ns: u64) {
        if self.readers.contains_key(&pid) {
            return;
        }
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let (s, c, p) = (stop.clone(), counters.clone(), self.paused.clone());
        // A thread's name holds 15 bytes: "es-task-" and a pid of up to 7 digits (the
        // kernel's largest pid_max) fit, so that the reader of each process can be told.
        let name = format!("es-task-{pid}");
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || read_loop(pid, start_ns, &tx, &s, &p, &c))
            .ok();
        // The new thread names itself when it first runs, which on a loaded machine can be
        // milliseconds later: until then it shows as this one (`es-recorder`). Named from here
        // too, it is one process's reader to whoever looks from the start.
        if let (Some(h), Ok(c)) = (&handle, std::ffi::CString::new(name)) {
            use std::os::unix::thread::JoinHandleExt;
            // SAFETY: the thread is not joined yet (its handle is held), and the name is
            // NUL-terminated and at most 15 bytes.
            unsafe {
                libc::pthread_setname_np(h.as_pthread_t(), c.as_ptr());
            }
        }
        self.readers.insert(
            pid,
            Reader {
                rx,
                stop,
                counters,
                handle,
            },
        );
    }

    /// Pause every reader (no reads of the targets' memory) or let them go on.
    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }

    /// Write the changes the readers sent so far.
    pub fn drain(&mut self, w: &mut RecordingWriter) -> anyhow::Result<()> {
        for r in self.readers.values() {
            while let Ok(c) = r.rx.try_recv() {
                w.task_change(&c)?;
            }
        }
        Ok(())
    }

    /// Stop reading `pids` (exited), writing what their readers sent.
    pub fn stop(&mut self, pids: &[i32], w: &mut RecordingWriter) -> anyhow::Result<()> {
        for pid in pids {
            if let Some(r) = self.readers.get(pid) {
                r.stop.store(true, Ordering::Relaxed);
            }
        }
        // A reader sees `stop` within one period (its last changes are queued by then), unless
        // it is still attaching (reading the binary's tables; seconds on a loaded machine,
        // and it has read nothing yet): that one is left to end on its own.
        let deadline = Instant::now() + STOP_WAIT;
        for pid in pids {
            let Some(mut r) = self.readers.remove(pid) else {
                continue;
            };
            if let Some(h) = r.handle.take() {
                while !h.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(2));
                }
                if h.is_finished() {
                    let _ = h.join();
                }
            }
            while let Ok(c) = r.rx.try_recv() {
                w.task_change(&c)?;
            }
            for (total, v) in self.stopped.iter_mut().zip([
                r.counters.errors.load(Ordering::Relaxed),
                r.counters.reads.load(Ordering::Relaxed),
                r.counters.read_ns.load(Ordering::Relaxed),
            ]) {
                *total += v;
            }
        }
        Ok(())
    }

    /// Stop every reader, writing what they sent.
    pub fn finish(&mut self, w: &mut RecordingWriter) -> anyhow::Result<()> {
        let pids: Vec<i32> = self.readers.keys().copied().collect();
        self.stop(&pids, w)
    }

    /// `asyncio_task_read_errors` (implausible objects, unreadable addresses),
    /// `asyncio_task_reads` (one per target per [`TASKS_EVERY`]) and `asyncio_task_read_us`
    /// (the time they took), of the readers running and stopped.
    pub fn counters(&self) -> [(&'static str, u64); 3] {
        let sum = |f: fn(&Counters) -> &AtomicU64| {
            self.readers
                .values()
                .map(|r| f(&r.counters).load(Ordering::Relaxed))
                .sum::<u64>()
        };
        [
            (
                "asyncio_task_read_errors",
                self.stopped[0] + sum(|c| &c.errors),
            ),
            ("asyncio_task_reads", self.stopped[1] + sum(|c| &c.reads)),
            (
                "asyncio_task_read_us",
                (self.stopped[2] + sum(|c| &c.read_ns)) / 1000,
            ),
        ]
    }
}

impl Drop for TaskReaders {
    fn drop(&mut self) {
        for r in self.readers.values_mut() {
            r.stop.store(true, Ordering::Relaxed);
            if let Some(h) = r.handle.take() {
                let _ = h.join();
            }
        }
    }
}

/// One target's reader: until `stop`, the target exits, or the recording loop is gone.
fn read_loop(
    pid: i32,
    start_ns: u64,
    tx: &mpsc::SyncSender<TaskChange>,
    stop: &AtomicBool,
    paused: &AtomicBool,
    counters: &Counters,
) {
    // Scheduled ahead of ordinary threads when it wakes: at a load average of 14 on 2 CPUs a
    // reader at the default priority went 1.2 s without a read, through a whole stall. It
    // sleeps between reads and each takes about a millisecond, so it takes little from
    // anything else. (Failure, without CAP_SYS_NICE, leaves it at the default.)
    // Attached first, at the default priority: reading the binary's tables is the one long
    // step, and at nice -20 three readers starting together held the recording loop off its
    // CPU for over a second on a loaded machine.
    let Ok(proc) = PythonProcess::attach(pid) else {
        counters.errors.store(1, Ordering::Relaxed);
        return;
    };
    // SAFETY: setpriority(2) on this thread's own id.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, -20);
    }
    let mut reader = AsyncioTasks::default();
    let mut sym = Symbolizer::new();
    let mut last: HashMap<i32, RunningTask> = HashMap::new();
    // When the previous read was made (its states held then).
    let mut prev_read: Option<u64> = None;
    // (host tid, thread state), sorted.
    let mut threads: Vec<(i32, u64)> = Vec::new();
    let mut threads_read: Option<Instant> = None;
    let mut task_cache = crate::procinfo::TaskCache::default();
    let mut next = Instant::now();
    let mut task_seen = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if paused.load(Ordering::Relaxed) {
            std::thread::sleep(TASKS_EVERY);
            next = Instant::now();
            continue;
        }
        let t0 = Instant::now();
        if threads_read.is_none_or(|t| t.elapsed() >= THREADS_EVERY) {
            threads_read = Some(t0);
            let Ok(tasks) = task_cache.tasks(pid) else {
                return; // exited
            };
            // The interpreter's list read again when the OS threads changed, else every
            // second (as the recorder does).
            let list = if task_cache.list_due(&tasks) {
                proc.threads_with_tids(&tasks).ok()
            } else {
                None
            };
            if let Some((list, _)) = list {
                task_cache.list_read(&tasks);
                threads = list
                    .into_iter()
                    .filter_map(|(ts, tid)| Some((tid?, ts)))
                    .collect();
                threads.sort_unstable();
            }
        }
        let tstates: Vec<u64> = threads.iter().map(|&(_, ts)| ts).collect();
        let running = proc.running_tasks(&mut reader, &tstates);
        if !running.is_empty() {
            task_seen = t0;
        }
        let now = monotonic_ns().saturating_sub(start_ns);
        // Threads that ran a task and are gone from the list: none from now on.
        let mut states: Vec<(i32, Option<RunningTask>)> = last
            .keys()
            .filter(|&&tid| threads.binary_search_by_key(&tid, |&(t, _)| t).is_err())
            .map(|&tid| (tid, None))
            .collect();
        for &(tid, ts) in &threads {
            let task = running
                .get(&ts)
                .and_then(|&task| proc.describe_running_task(&mut reader, &mut sym, ts, task));
            states.push((tid, task));
        }
        for (tid, task) in states {
            if task.as_ref() == last.get(&tid) {
                continue;
            }
            let change = TaskChange {
                t_ns: now,
                pid,
                tid,
                task: task.clone(),
                // Only when reads were missed: the previous one over two periods ago.
                prev_seen_ns: prev_read
                    .filter(|&p| now.saturating_sub(p) > 2 * TASKS_EVERY.as_nanos() as u64),
            };
            match tx.try_send(change) {
                Ok(()) => match task {
                    Some(k) => last.insert(tid, k),
                    None => last.remove(&tid),
                },
                // The recording loop is behind: sent again at the next read if still so.
                Err(mpsc::TrySendError::Full(_)) => continue,
                Err(mpsc::TrySendError::Disconnected(_)) => return,
            };
        }
        prev_read = Some(now);
        counters.reads.fetch_add(1, Ordering::Relaxed);
        counters
            .read_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        counters.errors.store(reader.errors, Ordering::Relaxed);
        next += if t0.duration_since(task_seen) >= IDLE_AFTER {
            IDLE_EVERY
        } else {
            TASKS_EVERY
        };
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
}
