//! One thread that reads each target interpreter's builtin function names
//! ([`crate::cpython::builtins`]) for native frames with no symbol, apart from the thread
//! that drains the ring buffer: the first scan of a large application's `sys.modules` is
//! tens of thousands of reads. Each target is scanned at attach, again after 1, 3, 10 and
//! 30 s (modules imported at start-up), then every minute; a rescan reads only modules
//! whose dict changed. Results wait in a bounded queue for [`super::Native::apply_builtins`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::cpython::builtins::BuiltinScan;
use crate::cpython::memory::ProcessMemory;
use crate::cpython::offsets::Offsets;

/// Delays between a target's scans; the last repeats.
const SCHEDULE: [Duration; 6] = [
    Duration::ZERO,
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(7),
    Duration::from_secs(20),
    Duration::from_secs(60),
];

/// Scans' results waiting for the recorder at most (each a few KB).
const QUEUE: usize = 64;

enum Cmd {
    Watch(i32, Box<Offsets>, u64),
    Forget(i32),
}

/// Names found: (pid, [(address, name; `None`: ambiguous)]).
pub(crate) type Found = (i32, Vec<(u64, Option<String>)>);

#[derive(Default)]
struct Counters {
    scans: AtomicU64,
    scan_ns: AtomicU64,
    scan_max_ns: AtomicU64,
    errors: AtomicU64,
    dropped: AtomicU64,
}

pub(crate) struct BuiltinReader {
    tx: mpsc::Sender<Cmd>,
    rx: mpsc::Receiver<Found>,
    counters: Arc<Counters>,
}

struct Watched {
    mem: ProcessMemory,
    offsets: Offsets,
    interp: u64,
    scan: BuiltinScan,
    next: Instant,
    step: usize,
}

impl BuiltinReader {
    /// Start the thread (`None` if it cannot be started: frames with no symbol stay so).
    pub fn spawn() -> Option<Self> {
        let (tx, cmds) = mpsc::channel::<Cmd>();
        let (out, rx) = mpsc::sync_channel::<Found>(QUEUE);
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        std::thread::Builder::new()
            .name("es-builtins".into())
            .spawn(move || run(&cmds, &out, &c))
            .ok()?;
        Some(BuiltinReader { tx, rx, counters })
    }

    pub fn watch(&self, pid: i32, o: Offsets, interp: u64) {
        let _ = self.tx.send(Cmd::Watch(pid, Box::new(o), interp));
    }

    pub(crate) fn forget(&self, pid: i32) {
        let _ = self.tx.send(Cmd::Forget(pid));
    }

    /// What the scans found since the last call.
    pub fn take(&self) -> Vec<Found> {
        self.rx.try_iter().collect()
    }

    pub fn counters(&self, c: &mut std::collections::BTreeMap<String, u64>) {
        let k = &self.counters;
        c.insert("native_builtin_scans".into(), k.scans.load(Relaxed));
        c.insert(
            "native_builtin_scan_ms".into(),
            k.scan_ns.load(Relaxed) / 1_000_000,
        );
        c.insert(
            "native_builtin_scan_max_ms".into(),
            k.scan_max_ns.load(Relaxed) / 1_000_000,
        );
        c.insert("native_builtin_scan_errors".into(), k.errors.load(Relaxed));
        c.insert(
            "native_builtin_results_dropped".into(),
            k.dropped.load(Relaxed),
        );
    }
}

/// The thread: scans each watched target when due, until the recorder drops its sender.
fn run(cmds: &mpsc::Receiver<Cmd>, out: &mpsc::SyncSender<Found>, c: &Counters) {
    // Below the recorder's priority: names can wait, samples cannot.
    // SAFETY: a plain syscall on this thread's own id; failure keeps the default priority.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
    let mut watched: HashMap<i32, Watched> = HashMap::new();
    loop {
        let now = Instant::now();
        let wait = watched
            .values()
            .map(|w| w.next.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::from_secs(3600));
        match cmds.recv_timeout(wait) {
            Ok(Cmd::Watch(pid, o, interp)) => {
                if let Ok(mem) = ProcessMemory::open(pid) {
                    watched.entry(pid).or_insert(Watched {
                        mem,
                        offsets: *o,
                        interp,
                        scan: BuiltinScan::default(),
                        next: Instant::now(),
                        step: 0,
                    });
                }
                continue;
            }
            Ok(Cmd::Forget(pid)) => {
                watched.remove(&pid);
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let now = Instant::now();
        let mut gone = Vec::new();
        for (&pid, w) in watched.iter_mut().filter(|(_, w)| w.next <= now) {
            let t0 = Instant::now();
            let before = w.scan.errors;
            let r = w.scan.scan(&w.mem, &w.offsets, w.interp);
            let ns = t0.elapsed().as_nanos() as u64;
            c.scans.fetch_add(1, Relaxed);
            c.scan_ns.fetch_add(ns, Relaxed);
            c.scan_max_ns.fetch_max(ns, Relaxed);
            c.errors.fetch_add(w.scan.errors - before, Relaxed);
            match r {
                Ok(found) if !found.is_empty() => {
                    if out.try_send((pid, found)).is_err() {
                        // Lost: start over, so that the next scan returns them again.
                        c.dropped.fetch_add(1, Relaxed);
                        w.scan = BuiltinScan::default();
                    }
                }
                Ok(_) => {}
                Err(crate::cpython::objects::ObjectError::Read(
                    crate::cpython::memory::ReadError::Gone(_),
                )) => gone.push(pid),
                Err(_) => {
                    c.errors.fetch_add(1, Relaxed);
                }
            }
            w.step = (w.step + 1).min(SCHEDULE.len() - 1);
            w.next = Instant::now() + SCHEDULE[w.step];
        }
        for pid in gone {
            watched.remove(&pid);
        }
    }
}
