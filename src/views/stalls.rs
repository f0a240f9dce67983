//! API-server event-loop stalls and serialization cost.
//!
//! In a vLLM API server (a process with role `api_server`, or an engine's `api_server_pid`)
//! the asyncio event loop runs on the main thread (tid = pid); in any other process, on each
//! thread seen running one ([`loop_threads`]: a plain asyncio server recorded with `--pid`,
//! SGLang, a custom front-end, a vLLM API server recorded by PID). While the loop runs one
//! callback it serves nothing else, so a long stretch of the main thread in Python code is a
//! stall: every request waits. A stall is a run of the main thread's samples
//! - in Python code that is not the loop's own (a stack with a Python frame whose innermost
//!   frame is not in [`LOOP_FILES`]: asyncio's poll in `selectors.py`, or where a uvloop loop
//!   was started, since its poll has no frame of its own),
//! - with no blocked off-CPU interval longer than [`MAX_BLOCK_NS`] between two of them in
//!   which the thread waited in the loop's own code or outside Python (it went idle). A thread
//!   that waits for the GIL (at least half of the interval in its GIL waits), or blocks in
//!   other Python code for at most [`MAX_CALLBACK_BLOCK_NS`] (a page fault, a lock), is still
//!   inside a callback. (Longer blocks in other Python code are taken for idle: a main thread
//!   that runs no loop, or one started from a frame not in [`LOOP_FILES`], waits there. A
//!   blocking call of more than 100 ms in a callback ends the stall there.) A sample whose
//!   stack could not be read at all ([`Seen::Unread`]) shows neither: it joins the run around
//!   it and never starts or ends one.
//! - each close enough to the previous one, not counting time the thread was preempted
//!   (runnable but switched out: the loop still is not serving) or blocked inside a callback:
//!   within two sampling periods ([`GAP_PERIODS`]) when the recording has no exact off-CPU
//!   intervals for the thread (memory backend, `--no-offcpu`), where a gap is the only sign of
//!   a wait. With them (BPF backend) time between two samples that the thread did not spend
//!   off CPU it spent on CPU, in the callback, however long: no gap ends a run, unless the
//!   recording lost events (`bpf_ringbuf_full_lost`), when a switch into the idle wait may be
//!   missing and a gap of more than [`EXACT_MAX_GAP_NS`] does. (On CPU without a sample is
//!   common: a thread that runs in short slices between preemptions is sampled at random
//!   points of its CPU time, so the CPU time between two samples is about exponential with a
//!   mean of one period and exceeds two periods in ~13% of gaps; and a virtual CPU that the
//!   host deschedules takes no samples while the thread on it still runs as far as the guest
//!   knows: 25-60 ms without a sample, no switch and other threads sampled meanwhile on the
//!   other CPU, seen in most runs here, and once 100.5 ms, which a fixed 100 ms limit took for
//!   the end of a stall, splitting one 919.5 ms stall into 609 + 210 ms. A limit of two
//!   periods split every long stall of a contended API server into pieces shorter than the
//!   threshold.)
//!
//! lasting longer than the threshold (`--stall-ms`). Its duration runs from the first
//! sample's time to the last sample's time plus its period; with exact off-CPU intervals, from
//! the thread's wake-up after the idle wait before the first sample (or, where it then waited
//! for the GIL in the poll, from when it took the GIL back) to its switch into the idle wait
//! after the last one, each where it lies within [`EXACT_MAX_GAP_NS`] of that sample (less
//! time off CPU without going idle): the CPU time at a stall's ends goes unsampled as well
//! (seen for 90 ms), but so may time in the poll after the callback (119 ms seen).
//!
//! Serialization: samples with a frame in JSON/pickle/msgpack/pydantic encoding or decoding
//! anywhere on the stack ([`is_serialization_frame`]), as a share of the API server's CPU.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::{frame_label, secs, Selection};
use crate::record::{Frame, OffCpu, Recording, Sample};

/// A blocked off-CPU interval longer than this between two samples ends a run.
pub(crate) const MAX_BLOCK_NS: u64 = 2_000_000;
// An aggregating writer keeps such intervals of event-loop threads raw.
const _: () = assert!(crate::record::profile::LOOP_RAW_MIN_OFFCPU_NS <= MAX_BLOCK_NS);
/// Blocked in Python code that is not the loop's for at most this long: still in the callback.
pub(crate) const MAX_CALLBACK_BLOCK_NS: u64 = 100_000_000;
/// Without exact off-CPU intervals: the most sampling periods between two samples of a run
/// (less time preempted or waiting for the GIL).
pub(crate) const GAP_PERIODS: u64 = 2;
/// With exact off-CPU intervals (BPF backend) in a recording that lost events: the most time
/// between two samples of a run (less time preempted or waiting for the GIL; at least
/// [`GAP_PERIODS`] periods), a guard against a lost switch into the idle wait. Without lost
/// events there is no limit.
pub(crate) const EXACT_MAX_GAP_NS: u64 = 100_000_000;
/// The recording's counter of events the kernel could not hand over (ring buffer full).
const LOST_EVENTS_COUNTER: &str = "bpf_ringbuf_full_lost";
/// Frames kept of a stall's dominant stack.
pub(crate) const STACK_FRAMES: usize = 20;
/// Serializing functions listed per API server.
pub(crate) const SERIALIZATION_TOP: usize = 5;

/// Files whose every frame is (de)serialization.
const SERIALIZATION_FILES: &[&str] = &[
    "json/encoder.py",
    "json/decoder.py",
    "json/__init__.py",
    "/pickle.py",
    "/copyreg.py",
    "/_compat_pickle.py",
    "fastapi/encoders.py",
    // vLLM's msgpack encoder/decoder for the API server <-> EngineCore messages.
    "vllm/v1/serial_utils.py",
];
/// Path parts of serialization packages.
const SERIALIZATION_PACKAGES: &[&str] =
    &["/msgspec/", "/orjson/", "/ujson/", "/cbor2/", "/msgpack/"];
/// Functions (last part of the qualified name) that are (de)serialization wherever they are.
const SERIALIZATION_FUNCTIONS: &[&str] = &[
    "dumps",
    "loads",
    "model_dump_json",
    "model_dump",
    "model_validate_json",
    "jsonable_encoder",
    "serialize_response",
];

/// Whether a frame is JSON/pickle/msgpack/pydantic encoding or decoding: a function named
/// `dumps`, `loads`, `model_dump_json`, `model_dump`, `model_validate_json`,
/// `jsonable_encoder`, `serialize_response` or `*JSONResponse.render`, or any function in
/// `json/encoder.py`, `json/decoder.py`, `json/__init__.py`, `pickle.py`, `copyreg.py`,
/// `fastapi/encoders.py`, `vllm/v1/serial_utils.py`, or under `msgspec/`, `orjson/`,
/// `ujson/`, `cbor2/`, `msgpack/`. (C encoders such as `orjson.dumps` have no frame of their
/// own; their Python caller's frame is what matches.)
pub(crate) fn is_serialization_frame(f: &Frame) -> bool {
    let file = f.file.replace('\\', "/");
    if SERIALIZATION_FILES.iter().any(|s| file.ends_with(s)) {
        return true;
    }
    if SERIALIZATION_PACKAGES.iter().any(|p| file.contains(p)) {
        return true;
    }
    let last = f.function.rsplit('.').next().unwrap_or(&f.function);
    SERIALIZATION_FUNCTIONS.contains(&last)
        || (last == "render" && f.function.contains("JSONResponse"))
}

/// Whether a process is an API server: its role says so (`api_server`, `APIServer`,
/// `api-server`, any case, or one of several numbered: `api_server_1`), or an engine names it
/// as its API server.
pub fn is_api_server(rec: &Recording, pid: i32) -> bool {
    let role_says = rec
        .processes
        .iter()
        .rev()
        .find(|p| p.pid == pid)
        .is_some_and(|p| {
            let r: String = p
                .role
                .chars()
                .filter(|c| c.is_ascii_alphanumeric())
                .collect::<String>()
                .to_ascii_lowercase();
            r.strip_prefix("apiserver")
                .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
        });
    role_says || rec.engines.iter().any(|e| e.is_api_server(pid))
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SerializingFunction {
    pub function: String,
    pub file: String,
    /// On-CPU time in samples where this is the innermost serialization frame, s.
    pub cpu_s: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ApiServerRow {
    pub pid: i32,
    /// The event loop's thread (the main thread, tid = pid).
    pub main_tid: i32,
    /// On-CPU time of the process's selected threads, s.
    pub cpu_s: f64,
    pub main_thread_cpu_s: f64,
    /// Part of `cpu_s` in samples with a serialization frame on the stack, s.
    pub serialization_s: f64,
    /// `serialization_s` over `cpu_s`, 0..1.
    pub serialization_share: f64,
    /// Where that time went: innermost serialization frame's function, most first.
    pub serialization_top: Vec<SerializingFunction>,
    /// Stalls of the main thread.
    pub stalls: u64,
    /// Their summed duration, s.
    pub stalled_s: f64,
    /// The longest, ms (0 when none).
    pub longest_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Stall {
    pub pid: i32,
    pub tid: i32,
    /// s since the recording's start.
    pub start_s: f64,
    pub duration_ms: f64,
    pub samples: u64,
    /// Sample weights, ms (the stall minus time preempted or waiting for the GIL).
    pub cpu_ms: f64,
    /// Time the loop's thread waited for the GIL inside the stall (other threads ran Python
    /// while the callback could not), ms.
    #[serde(default)]
    pub gil_wait_ms: f64,
    /// Time it was blocked inside the stall otherwise, in Python code that is not the loop's
    /// (a lock, a page fault, a blocking call in the callback), ms.
    #[serde(default)]
    pub blocked_ms: f64,
    /// Share of the stall's samples with a serialization frame, 0..1.
    pub serialization_share: f64,
    /// The most frequent stack in the stall, innermost frame first (`function (file:line)`),
    /// at most [`STACK_FRAMES`].
    pub dominant_stack: Vec<String>,
    /// Share of the stall's samples on that stack, 0..1.
    pub dominant_share: f64,
    /// The asyncio task that ran during the stall (a stall is one task step, or callbacks
    /// outside any task): the one the recorder saw running longest within it (record 18).
    /// Absent when it saw none there, and in recordings without task reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<crate::cpython::asyncio::RunningTask>,
    /// Share of the stall the recorder saw that task running, 0..1 (its reads are
    /// [`TASKS_EVERY`](crate::sampler::tasks::TASKS_EVERY) apart, so a stall's first read
    /// comes up to that late).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_share: Option<f64>,
}

/// The task a thread ran longest in `[begin, end)` and the share of that time, from its task
/// changes `changes` (sorted by time; each holds until the next, or, where the reader missed
/// reads before the next, until it last saw it).
pub(crate) fn task_during(
    changes: &[&crate::record::TaskChange],
    begin: u64,
    end: u64,
) -> Option<(crate::cpython::asyncio::RunningTask, f64)> {
    if end <= begin {
        return None;
    }
    // The change in force at `begin` is the last one at or before it.
    let first = changes
        .partition_point(|c| c.t_ns <= begin)
        .saturating_sub(1);
    let mut by: Vec<(&crate::cpython::asyncio::RunningTask, u64)> = Vec::new();
    for (i, c) in changes.iter().enumerate().skip(first) {
        if c.t_ns >= end {
            break;
        }
        // Until the next change, or where the reader last saw this state when it missed reads
        // before the next (unknown in between: not counted).
        let until = changes
            .get(i + 1)
            .map_or(u64::MAX, |n| n.prev_seen_ns.unwrap_or(n.t_ns).max(c.t_ns));
        let ov = until.min(end).saturating_sub(c.t_ns.max(begin));
        let Some(task) = &c.task else { continue };
        if ov == 0 {
            continue;
        }
        match by.iter_mut().find(|(t, _)| *t == task) {
            Some(e) => e.1 += ov,
            None => by.push((task, ov)),
        }
    }
    // Longest; ties to the first seen.
    let best = by.iter().fold(
        None::<&(&crate::cpython::asyncio::RunningTask, u64)>,
        |b, e| match b {
            Some(x) if x.1 >= e.1 => Some(x),
            _ => Some(e),
        },
    )?;
    Some((best.0.clone(), best.1 as f64 / (end - begin) as f64))
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ApiServerStalls {
    /// `--stall-ms`.
    pub threshold_ms: f64,
    /// Selected API-server processes.
    pub servers: Vec<ApiServerRow>,
    /// Every stall, longest first (ties by start).
    pub stalls: Vec<Stall>,
}

/// Files of the event loop itself, where its thread waits between callbacks: asyncio's poll
/// (`selectors.py`), and where a loop was started (`asyncio/runners.py`: `asyncio.run`,
/// `asyncio.Runner`; `uvloop/__init__.py`: `uvloop.run`, as `vllm serve` does), the
/// innermost Python frame of a uvloop loop, whose poll and dispatch are compiled code.
const LOOP_FILES: &[&str] = &["selectors.py", "asyncio/runners.py", "uvloop/__init__.py"];

/// What a loop thread's sample shows of its loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Running Python code that is not the loop's own: a callback.
    Busy,
    /// In the loop's poll, or outside Python ([`is_idle_stack`]).
    Idle,
    /// Its stack could not be read (flagged partial, no frame): anything. It joins the run
    /// around it (the thread was on CPU) but neither starts nor ends one: a walk that failed
    /// on its first read (the thread state unreadable for an instant, seen mid-run on busy
    /// threads) had split a 340.7 ms stall into 272.7 ms and an unreported rest.
    Unread,
}

/// What sample `s` shows of its thread's loop (`idle`: [`is_idle_stack`] of a stack).
fn seen(rec: &Recording, s: &Sample, idle: &mut dyn FnMut(u32) -> bool) -> Seen {
    if unread(rec, s) {
        Seen::Unread
    } else if idle(s.stack) {
        Seen::Idle
    } else {
        Seen::Busy
    }
}

/// Whether a sample's stack could not be read at all (flagged partial, no frame).
fn unread(rec: &Recording, s: &Sample) -> bool {
    s.flags & crate::record::flags::PARTIAL != 0 && rec.stack_frames(s.stack).next().is_none()
}

/// Whether a stack is the event loop idling or outside Python: no Python frame, or the
/// innermost frame in one of [`LOOP_FILES`].
fn is_idle_stack(rec: &Recording, stack: u32) -> bool {
    match rec.stack_frames(stack).next() {
        None => true,
        Some(f) => {
            let file = f.file.replace('\\', "/");
            LOOP_FILES.iter().any(|s| file.ends_with(s))
        }
    }
}

/// Files and functions of an asyncio event loop's own run: a thread with one on its stack runs
/// a loop (`BaseEventLoop.run_forever`/`_run_once`; uvloop's `run`, whose dispatch is compiled).
const LOOP_RUN_FRAMES: &[(&str, &str)] = &[
    ("asyncio/base_events.py", "run_forever"),
    ("asyncio/base_events.py", "_run_once"),
    ("uvloop/__init__.py", "run"),
];

/// `(pid, tid)` of the selected threads seen running an asyncio event loop (any sample or
/// off-CPU interval with a frame of [`LOOP_RUN_FRAMES`]).
pub(crate) fn loop_threads(
    rec: &Recording,
    sel: &Selection,
) -> std::collections::BTreeSet<(i32, i32)> {
    let mut of_stack: HashMap<u32, bool> = HashMap::new();
    let mut is_loop = |stack: u32| {
        *of_stack.entry(stack).or_insert_with(|| {
            rec.stack_frames(stack).any(|f| {
                let file = f.file.replace('\\', "/");
                let last = f.function.rsplit('.').next().unwrap_or(&f.function);
                LOOP_RUN_FRAMES
                    .iter()
                    .any(|(fl, func)| file.ends_with(fl) && last == *func)
            })
        })
    };
    let mut out = std::collections::BTreeSet::new();
    for s in sel.samples(rec) {
        if !out.contains(&(s.pid, s.tid)) && is_loop(s.stack) {
            out.insert((s.pid, s.tid));
        }
    }
    for o in sel.offcpu(rec) {
        if !out.contains(&(o.pid, o.tid)) && is_loop(o.stack) {
            out.insert((o.pid, o.tid));
        }
    }
    out
}

/// Why the loop's thread was off CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Off {
    /// Blocked in the loop's poll, or without a Python frame: idle.
    Blocked,
    /// Runnable but switched out.
    Preempted,
    /// Blocked waiting for the GIL inside a callback.
    Gil,
    /// Blocked waiting for the GIL in the loop's own poll (the poll returned and must take the
    /// GIL back): between two callbacks it is part of the stall, but right after the idle
    /// wait the loop has not begun a callback yet, so a stall begins after it.
    PollGil,
    /// Blocked elsewhere in Python code (a page fault, a lock, a blocking call in a
    /// callback): the callback is still running.
    InCallback,
}

/// One thread's off-CPU intervals as `(start, dur, why)`, sorted: [`Off::Gil`] when at least
/// half of a blocked interval lies in the thread's GIL waits (`gil`: `(start, dur)`, any order,
/// may overlap; [`Off::PollGil`] where it blocked in the loop's own code), [`Off::InCallback`] when it blocked for at most [`MAX_CALLBACK_BLOCK_NS`] in
/// Python code that is not the loop's (`idle_stack` false for its stack), [`Off::Blocked`]
/// otherwise. Only the last is the loop
/// going idle: a preempted thread, one waiting for the GIL and one blocked inside a callback
/// are all still in the callback.
fn classify_offcpu(
    off: &[&OffCpu],
    gil: &[(u64, u64)],
    idle_stack: &mut dyn FnMut(u32) -> bool,
) -> Vec<(u64, u64, Off)> {
    // The GIL waits' union, sorted.
    let mut g: Vec<(u64, u64)> = gil.iter().map(|&(s, d)| (s, s.saturating_add(d))).collect();
    g.sort_unstable();
    let mut union: Vec<(u64, u64)> = Vec::with_capacity(g.len());
    for (s, e) in g {
        match union.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => union.push((s, e)),
        }
    }
    let mut out: Vec<(u64, u64, Off)> = off
        .iter()
        .map(|o| {
            if o.preempted {
                return (o.start_ns, o.dur_ns, Off::Preempted);
            }
            let (a, b) = (o.start_ns, o.start_ns.saturating_add(o.dur_ns));
            let first = union.partition_point(|u| u.1 <= a);
            let in_gil: u64 = union[first..]
                .iter()
                .take_while(|u| u.0 < b)
                .map(|u| u.1.min(b).saturating_sub(u.0.max(a)))
                .sum();
            let why = if o.dur_ns > 0 && 2 * in_gil >= o.dur_ns {
                if idle_stack(o.stack) {
                    Off::PollGil
                } else {
                    Off::Gil
                }
            } else if o.dur_ns > MAX_CALLBACK_BLOCK_NS || idle_stack(o.stack) {
                Off::Blocked
            } else {
                Off::InCallback
            };
            (o.start_ns, o.dur_ns, why)
        })
        .collect();
    out.sort_unstable();
    out
}

/// Time in `[from, to)` off CPU without going idle (preempted, waiting for the GIL, blocked in
/// a callback).
fn forgiven(off: &[(u64, u64, Off)], from: u64, to: u64) -> u64 {
    // One thread's intervals do not overlap: only the one that starts last before `from` can
    // reach into the range from before it.
    let i = off.partition_point(|o| o.0 < from).saturating_sub(1);
    off[i..]
        .iter()
        .take_while(|o| o.0 < to)
        .filter(|o| o.2 != Off::Blocked)
        .map(|o| {
            o.0.saturating_add(o.1)
                .min(to)
                .saturating_sub(o.0.max(from))
        })
        .sum()
}

/// With exact off-CPU intervals: a run of samples from `first` to `last` (`prev` and `next`
/// the thread's samples around it) began when the thread woke from the last idle wait
/// ([`Off::Blocked`]), or took the GIL back in the poll after it ([`Off::PollGil`]), that
/// ended in `(prev, first]`, and ended when it went into the first
/// one that began in `[last, next)`, each if the time between it and the sample, less time
/// off CPU without going idle, is at most `max_gap_ns`. `None` where there is no such wait.
fn extent(
    off: &[(u64, u64, Off)],
    prev: u64,
    first: u64,
    last: u64,
    next: u64,
    max_gap_ns: u64,
) -> (Option<u64>, Option<u64>) {
    // `off` is sorted by start, and one thread's intervals do not overlap: ends are sorted too.
    let before = off.partition_point(|o| o.0 < first);
    let woke = off[..before]
        .iter()
        .rev()
        .map(|o| (o.0.saturating_add(o.1), o.2))
        .take_while(|&(e, _)| e > prev)
        .find(|&(e, why)| (why == Off::Blocked || why == Off::PollGil) && e <= first)
        .map(|(e, _)| e)
        .filter(|&e| first - e - forgiven(off, e, first).min(first - e) <= max_gap_ns);
    let after = off.partition_point(|o| o.0 < last);
    let slept = off[after..]
        .iter()
        .take_while(|o| o.0 < next)
        .find(|o| o.2 == Off::Blocked)
        .map(|o| o.0)
        .filter(|&s| s - last - forgiven(off, last, s).min(s - last) <= max_gap_ns);
    (woke, slept)
}

/// Runs of busy samples (indices into `samples`, sorted by time) joined as the module
/// describes. `off`: the thread's off-CPU intervals sorted by start ([`classify_offcpu`]);
/// time preempted, waiting for the GIL or blocked inside a callback is taken off the gaps and
/// never ends a run; a gap of
/// more than `max_gap_ns` (or [`GAP_PERIODS`] of the previous sample's period, if longer)
/// does.
fn runs(
    samples: &[&Sample],
    off: &[(u64, u64, Off)],
    seen: &[Seen],
    period_ns: u64,
    max_gap_ns: u64,
) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    // A run ends at its last busy sample: unread ones after it are dropped.
    let close = |cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>| {
        while cur.last().is_some_and(|&j| seen[j] == Seen::Unread) {
            cur.pop();
        }
        if !cur.is_empty() {
            out.push(std::mem::take(cur));
        }
    };
    let mut k = 0; // first off-CPU interval that may end after the previous sample
    for (i, s) in samples.iter().enumerate() {
        match seen[i] {
            Seen::Idle => {
                close(&mut cur, &mut out);
                continue;
            }
            Seen::Unread if cur.is_empty() => continue,
            _ => {}
        }
        if let Some(&p) = cur.last() {
            let prev = samples[p];
            let (a, b) = (prev.t_ns, s.t_ns);
            while k < off.len() && off[k].0.saturating_add(off[k].1) <= a {
                k += 1;
            }
            let (mut preempted, mut blocked_long) = (0u64, false);
            for &(start, dur, why) in off[k..].iter().take_while(|o| o.0 < b) {
                let ov = start
                    .saturating_add(dur)
                    .min(b)
                    .saturating_sub(start.max(a));
                if why != Off::Blocked {
                    preempted += ov;
                } else if dur > MAX_BLOCK_NS && ov > 0 {
                    blocked_long = true;
                }
            }
            let period = if prev.weight_ns > 0 {
                u64::from(prev.weight_ns)
            } else {
                period_ns
            };
            let gap = b.saturating_sub(a).saturating_sub(preempted);
            if blocked_long || gap > max_gap_ns.max(GAP_PERIODS.saturating_mul(period)) {
                close(&mut cur, &mut out);
                if seen[i] == Seen::Unread {
                    continue;
                }
            }
        }
        cur.push(i);
    }
    close(&mut cur, &mut out);
    out
}

/// Per stack: the innermost serialization frame, if any (looked up once per stack).
struct Serialization<'a> {
    rec: &'a Recording,
    of: HashMap<u32, Option<&'a Frame>>,
}

impl<'a> Serialization<'a> {
    fn new(rec: &'a Recording) -> Self {
        Serialization {
            rec,
            of: HashMap::new(),
        }
    }

    fn frame(&mut self, stack: u32) -> Option<&'a Frame> {
        let rec = self.rec;
        *self
            .of
            .entry(stack)
            .or_insert_with(|| rec.stack_frames(stack).find(|f| is_serialization_frame(f)))
    }
}

/// Stalls and serialization of the selected API servers.
pub fn api_server_stalls(rec: &Recording, sel: &Selection, threshold_ns: u64) -> ApiServerStalls {
    let period_ns = rec.meta.period().map_or(10_000_000, |p| p.ns());
    let mut out = ApiServerStalls {
        threshold_ms: threshold_ns as f64 / 1e6,
        ..Default::default()
    };
    let mut ser = Serialization::new(rec);
    for (pid, tid) in event_loops(rec, sel) {
        let (mut row, mut main) = cpu_and_serialization(rec, sel, pid, tid, &mut ser);
        if sel.contains(pid, tid) {
            main.sort_by_key(|s| s.t_ns);
            let found = thread_stalls(
                rec,
                sel,
                (pid, tid),
                &main,
                &mut ser,
                threshold_ns,
                period_ns,
            );
            for (st, dur) in found {
                row.stalls += 1;
                row.stalled_s += dur as f64 / 1e9;
                row.longest_ms = row.longest_ms.max(dur as f64 / 1e6);
                out.stalls.push(st);
            }
        }
        out.servers.push(row);
    }
    out.stalls.sort_by(|a, b| {
        b.duration_ms
            .total_cmp(&a.duration_ms)
            .then(a.start_s.total_cmp(&b.start_s))
            .then(a.pid.cmp(&b.pid))
    });
    out
}

/// The loop threads: an API server's main thread, and any thread seen running an asyncio
/// event loop (a plain asyncio server, SGLang, a custom front-end, a vLLM API server
/// recorded by PID); sorted.
fn event_loops(rec: &Recording, sel: &Selection) -> Vec<(i32, i32)> {
    let looping = loop_threads(rec, sel);
    let mut loops: Vec<(i32, i32)> = sel
        .pids()
        .into_iter()
        .filter(|&p| is_api_server(rec, p))
        .map(|p| (p, p))
        .collect();
    loops.extend(
        looping
            .iter()
            .filter(|&&(p, t)| !(is_api_server(rec, p) && t == p)),
    );
    loops.sort_unstable();
    loops.dedup();
    loops
}

/// The process's CPU and serialization figures (its row without stalls), and the loop
/// thread's samples.
fn cpu_and_serialization<'a>(
    rec: &'a Recording,
    sel: &'a Selection,
    pid: i32,
    tid: i32,
    ser: &mut Serialization<'a>,
) -> (ApiServerRow, Vec<&'a Sample>) {
    let mut row = ApiServerRow {
        pid,
        main_tid: tid,
        ..Default::default()
    };
    let (mut cpu, mut main_cpu, mut ser_ns) = (0u64, 0u64, 0u64);
    let mut by_fn: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    let mut main: Vec<&Sample> = Vec::new();
    for s in sel.samples(rec).filter(|s| s.pid == pid) {
        let w = u64::from(s.weight_ns);
        cpu += w;
        if let Some(f) = ser.frame(s.stack) {
            ser_ns += w;
            *by_fn
                .entry((f.function.as_str(), f.file.as_str()))
                .or_default() += w;
        }
        if s.tid == tid {
            main_cpu += w;
            main.push(s);
        }
    }
    row.cpu_s = secs(cpu);
    row.main_thread_cpu_s = secs(main_cpu);
    row.serialization_s = secs(ser_ns);
    row.serialization_share = if cpu == 0 {
        0.0
    } else {
        ser_ns as f64 / cpu as f64
    };
    let mut top: Vec<((&str, &str), u64)> = by_fn.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    row.serialization_top = top
        .into_iter()
        .take(SERIALIZATION_TOP)
        .map(|((function, file), ns)| SerializingFunction {
            function: function.to_string(),
            file: file.to_string(),
            cpu_s: secs(ns),
        })
        .collect();
    (row, main)
}

/// The stalls of one loop thread, from its samples `main` (in time order), each with its
/// duration in ns.
fn thread_stalls<'a>(
    rec: &'a Recording,
    sel: &Selection,
    (pid, tid): (i32, i32),
    main: &[&'a Sample],
    ser: &mut Serialization<'a>,
    threshold_ns: u64,
    period_ns: u64,
) -> Vec<(Stall, u64)> {
    let off_raw: Vec<&OffCpu> = sel
        .offcpu(rec)
        .filter(|o| o.pid == pid && o.tid == tid)
        .collect();
    let gil: Vec<(u64, u64)> = sel
        .gil_waits(rec)
        .filter(|g| g.pid == pid && g.tid == tid)
        .map(|g| (g.start_ns, g.dur_ns))
        .collect();
    let mut idle_of: HashMap<u32, bool> = HashMap::new();
    let mut idle_stack = |stack: u32| {
        *idle_of
            .entry(stack)
            .or_insert_with(|| is_idle_stack(rec, stack))
    };
    let off = classify_offcpu(&off_raw, &gil, &mut idle_stack);
    let seen: Vec<Seen> = main.iter().map(|s| seen(rec, s, &mut idle_stack)).collect();
    // Exact off-CPU intervals: the BPF backend traced this thread's switches. Every switch is
    // there unless events were lost: then on-CPU time between two samples is the callback's,
    // however long (a descheduled virtual CPU takes no samples).
    let exact = rec.meta.backend == "bpf" && !off.is_empty();
    let max_gap_ns = if !exact {
        0
    } else if rec.counters.get(LOST_EVENTS_COUNTER).copied().unwrap_or(0) > 0 {
        EXACT_MAX_GAP_NS
    } else {
        u64::MAX
    };
    let mut changes: Vec<&crate::record::TaskChange> = rec
        .task_changes
        .iter()
        .filter(|c| c.pid == pid && c.tid == tid)
        .collect();
    changes.sort_by_key(|c| c.t_ns);
    let mut out = Vec::new();
    for run in runs(main, &off, &seen, period_ns, max_gap_ns) {
        let (Some(&first), Some(&last)) = (run.first(), run.last()) else {
            continue;
        };
        let (a, z) = (main[first], main[last]);
        let (mut begin, mut end) = (a.t_ns, z.t_ns + u64::from(z.weight_ns).max(1));
        if exact {
            // Exact switches: from the wake-up after the idle wait before it to the switch
            // into the idle wait after it, if near enough (time on CPU there went unsampled: a
            // descheduled virtual CPU, seen for 90 ms). Unlike between two samples of the run,
            // where the callback runs on both sides, an unsampled stretch at an end may have
            // been spent in the loop's own poll (the callback over, the virtual CPU
            // descheduled before the thread blocked: 119 ms seen after a 1 ms heartbeat), so
            // these keep the limit.
            let prev = first.checked_sub(1).map_or(0, |i| main[i].t_ns);
            let next = main.get(last + 1).map_or(u64::MAX, |s| s.t_ns);
            let (b, e) = extent(&off, prev, a.t_ns, z.t_ns, next, EXACT_MAX_GAP_NS);
            begin = b.unwrap_or(begin);
            end = e.unwrap_or(end);
        }
        let dur = end.saturating_sub(begin);
        if dur <= threshold_ns {
            continue;
        }
        let mut st = stall_of_run(rec, (pid, tid), main, &seen, &run, ser, &off, (begin, end));
        if let Some((task, share)) = task_during(&changes, begin, end) {
            st.task = Some(task);
            st.task_share = Some(share);
        }
        out.push((st, dur));
    }
    out
}

/// One stall: the run of samples `run` (indexes into `main`, and into `seen`, what each
/// sample showed) over `[begin, end)`.
#[allow(clippy::too_many_arguments)]
fn stall_of_run<'a>(
    rec: &'a Recording,
    (pid, tid): (i32, i32),
    main: &[&'a Sample],
    seen: &[Seen],
    run: &[usize],
    ser: &mut Serialization<'a>,
    off: &[(u64, u64, Off)],
    (begin, end): (u64, u64),
) -> Stall {
    let mut stacks: BTreeMap<u32, u64> = BTreeMap::new();
    let (mut w, mut ser_n) = (0u64, 0u64);
    let mut n = 0u64;
    for &i in run {
        let s = main[i];
        w += u64::from(s.weight_ns);
        // An unread sample is the stall's CPU time, but shows nothing of what ran.
        if seen.get(i) == Some(&Seen::Unread) {
            continue;
        }
        n += 1;
        *stacks.entry(s.stack).or_default() += 1;
        if ser.frame(s.stack).is_some() {
            ser_n += 1;
        }
    }
    // Most frequent stack; ties to the lowest id (first interned).
    let (dom, dom_n) = stacks
        .iter()
        .max_by(|x, y| x.1.cmp(y.1).then(y.0.cmp(x.0)))
        .map_or((0, 0), |(&k, &n)| (k, n));
    let n = n.max(1);
    let inside = |why: Off| -> u64 {
        off.iter()
            .filter(|o| o.2 == why && o.0 < end)
            .map(|o| {
                o.0.saturating_add(o.1)
                    .min(end)
                    .saturating_sub(o.0.max(begin))
            })
            .sum()
    };
    Stall {
        pid,
        tid,
        start_s: secs(begin),
        duration_ms: end.saturating_sub(begin) as f64 / 1e6,
        samples: n,
        cpu_ms: w as f64 / 1e6,
        gil_wait_ms: (inside(Off::Gil) + inside(Off::PollGil)) as f64 / 1e6,
        blocked_ms: inside(Off::InCallback) as f64 / 1e6,
        serialization_share: ser_n as f64 / n as f64,
        dominant_stack: rec
            .stack_frames(dom)
            .take(STACK_FRAMES)
            .map(frame_label)
            .collect(),
        dominant_share: dom_n as f64 / n as f64,
        task: None,
        task_share: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `report --from/--to` trims the recording: task changes shift with the samples (they
    /// did not, and stalls were named by the task running `--from` earlier), and the change in
    /// force at `--from` is kept.
    #[test]
    fn trimmed_recordings_keep_task_times() {
        use crate::cpython::asyncio::RunningTask;
        use crate::record::TaskChange;
        let change = |t_ns: u64, name: Option<&str>| TaskChange {
            t_ns,
            pid: 1,
            tid: 1,
            task: name.map(|n| RunningTask {
                name: n.into(),
                coro: "c".into(),
                chain: vec![],
            }),
            prev_seen_ns: None,
        };
        let mut rec = Recording {
            task_changes: vec![
                change(100, Some("a")),
                change(200, None),
                change(300, Some("b")),
                change(400, None),
                change(900, Some("c")),
            ],
            ..Default::default()
        };
        rec.trim(250, 800);
        let got: Vec<(u64, Option<&str>)> = rec
            .task_changes
            .iter()
            .map(|c| (c.t_ns, c.task.as_ref().map(|t| t.name.as_str())))
            .collect();
        assert_eq!(got, vec![(0, None), (50, Some("b")), (150, None)]);
        let refs: Vec<&TaskChange> = rec.task_changes.iter().collect();
        assert_eq!(task_during(&refs, 40, 160).unwrap().0.name, "b");
    }

    #[test]
    fn task_during_a_stall_is_the_longest_running() {
        use crate::cpython::asyncio::RunningTask;
        use crate::record::TaskChange;
        let task = |n: &str| RunningTask {
            name: n.into(),
            coro: "handle_request".into(),
            chain: vec!["handle_request".into()],
        };
        let at = |t_ns: u64, k: Option<&str>| TaskChange {
            t_ns,
            pid: 1,
            tid: 1,
            task: k.map(task),
            prev_seen_ns: None,
        };
        let c = [
            at(0, Some("a")),
            at(100, None),
            at(120, Some("b")),
            at(300, None),
            at(400, Some("a")),
        ];
        let refs: Vec<&TaskChange> = c.iter().collect();
        // b ran 180 of [110, 310): 90%; a 0.
        let (t, share) = task_during(&refs, 110, 310).unwrap();
        assert_eq!(t.name, "b");
        assert!((share - 0.9).abs() < 1e-9, "{share}");
        // Summed per task: b (180) beats a (10 before 100, 50 from 400).
        let (t, _) = task_during(&refs, 90, 450).unwrap();
        assert_eq!(t.name, "b");
        let (t, share) = task_during(&refs, 50, 130).unwrap();
        assert_eq!((t.name.as_str(), share), ("a", 50.0 / 80.0));
        // The last change holds on; nothing running, or no changes: none.
        assert_eq!(task_during(&refs, 1000, 2000).unwrap().1, 1.0);
        assert!(task_during(&refs, 301, 399).is_none());
        assert!(task_during(&[], 0, 10).is_none());
        assert!(task_during(&refs, 10, 10).is_none());
        // A reader held off the CPU: a was last seen at 20, then b at 500. A stall in
        // [100, 400) is unknown, not a's.
        let c = [
            at(0, Some("a")),
            TaskChange {
                prev_seen_ns: Some(20),
                ..at(500, Some("b"))
            },
        ];
        let refs: Vec<&TaskChange> = c.iter().collect();
        assert!(task_during(&refs, 100, 400).is_none());
        assert_eq!(task_during(&refs, 10, 600).unwrap().0.name, "b");
    }

    fn f(function: &str, file: &str) -> Frame {
        Frame {
            function: function.into(),
            file: file.into(),
            line: None,
        }
    }

    #[test]
    fn serialization_frames() {
        assert!(is_serialization_frame(&f(
            "JSONEncoder.encode",
            "/usr/lib/python3.12/json/encoder.py"
        )));
        assert!(is_serialization_frame(&f(
            "dumps",
            "/x/site-packages/foo.py"
        )));
        assert!(is_serialization_frame(&f(
            "BaseModel.model_dump_json",
            "/x/pydantic/main.py"
        )));
        assert!(is_serialization_frame(&f(
            "ORJSONResponse.render",
            "/x/fastapi/responses.py"
        )));
        assert!(is_serialization_frame(&f(
            "MsgpackEncoder.encode",
            "/x/vllm/v1/serial_utils.py"
        )));
        // Tokenizers encode too, but that is not serialization.
        assert!(!is_serialization_frame(&f(
            "PreTrainedTokenizerFast.encode",
            "/x/transformers/tokenization_utils_fast.py"
        )));
        assert!(!is_serialization_frame(&f(
            "Response.render",
            "/x/starlette/responses.py"
        )));
    }

    #[test]
    fn api_servers_by_role_or_engine() {
        use crate::record::{EngineInfo, ProcessInfo};
        let mut rec = Recording::default();
        for (pid, role) in [
            (1, "APIServer"),
            (2, "EngineCore"),
            (4, "api_server"),
            (5, "api_server_1"),
            (6, "api_server_manager"),
        ] {
            rec.processes.push(ProcessInfo {
                pid,
                role: role.into(),
                ..Default::default()
            });
        }
        rec.engines.push(EngineInfo {
            api_server_pid: 3,
            ..Default::default()
        });
        let found: Vec<i32> = (0..8).filter(|&p| is_api_server(&rec, p)).collect();
        assert_eq!(found, [1, 3, 4, 5]);
    }

    #[test]
    fn runs_split_on_gaps_blocks_and_idle() {
        let ms = 1_000_000u64;
        let mk = |t: u64| Sample {
            t_ns: t * ms,
            pid: 1,
            tid: 1,
            stack: 1,
            flags: 0,
            weight_ns: ms as u32,
        };
        // 0..4 ms; a gap of 4 ms (> 2 periods): split; 8, 9, then 20..22 with a 10 ms
        // preemption between 9 and 20 (runnable all along: not a split); 27 after a 5 ms gap.
        let times = [0, 1, 2, 3, 4, 8, 9, 20, 21, 22, 27];
        let s: Vec<Sample> = times.iter().map(|&t| mk(t)).collect();
        let refs: Vec<&Sample> = s.iter().collect();
        let off = [(9 * ms + ms / 2, 10 * ms, Off::Preempted)];
        let idle = vec![Seen::Busy; refs.len()];
        let r = runs(&refs, &off, &idle, ms, 0);
        assert_eq!(r, vec![vec![0, 1, 2, 3, 4], vec![5, 6, 7, 8, 9], vec![10]]);
        // Waiting for the GIL counts like preemption.
        let gil = [(9 * ms + ms / 2, 10 * ms, Off::Gil)];
        assert_eq!(runs(&refs, &gil, &idle, ms, 0), r);
        // Blocked otherwise (3 ms > MAX_BLOCK_NS): a split there too.
        let blocked = [(9 * ms + ms / 2, 3 * ms, Off::Blocked)];
        let r = runs(&refs, &blocked, &idle, ms, 0);
        assert_eq!(
            r,
            vec![vec![0, 1, 2, 3, 4], vec![5, 6], vec![7, 8, 9], vec![10]]
        );
        // With exact off-CPU intervals (a 100 ms gap limit) the 4 and 5 ms gaps on CPU do not
        // end a run; the blocked interval still does, and a gap over the limit does.
        let r = runs(&refs, &blocked, &idle, ms, 100 * ms);
        assert_eq!(r, vec![vec![0, 1, 2, 3, 4, 5, 6], vec![7, 8, 9, 10]]);
        let r = runs(&refs, &off, &idle, ms, 4 * ms);
        assert_eq!(r, vec![vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9], vec![10]]);
        // At 4 ms periods, 8 ms apart is one run unless the thread blocked > 2 ms between.
        let slow: Vec<Sample> = [0, 8, 16]
            .iter()
            .map(|&t| Sample {
                weight_ns: 4 * ms as u32,
                ..mk(t)
            })
            .collect();
        let refs4: Vec<&Sample> = slow.iter().collect();
        let blocked = [(9 * ms, 3 * ms, Off::Blocked)];
        let r = runs(&refs4, &blocked, &[Seen::Busy; 3], 4 * ms, 0);
        assert_eq!(r, vec![vec![0, 1], vec![2]]);
        let short_block = [(9 * ms, ms, Off::Blocked)];
        let r = runs(&refs4, &short_block, &[Seen::Busy; 3], 4 * ms, 0);
        assert_eq!(r, vec![vec![0, 1, 2]]);
        // An idle sample ends a run and belongs to none, whatever the gap limit.
        let mut idle = vec![Seen::Busy; refs.len()];
        idle[2] = Seen::Idle;
        let r = runs(&refs[..5], &[], &idle[..5], ms, 0);
        assert_eq!(r, vec![vec![0, 1], vec![3, 4]]);
        let r = runs(&refs[..5], &[], &idle[..5], ms, 100 * ms);
        assert_eq!(r, vec![vec![0, 1], vec![3, 4]]);
        // An unread sample (no stack) joins the run around it, but neither starts one nor
        // ends one, nor is a run's last sample.
        let mut seen = vec![Seen::Busy; refs.len()];
        seen[2] = Seen::Unread;
        assert_eq!(
            runs(&refs[..5], &[], &seen[..5], ms, 0),
            vec![vec![0, 1, 2, 3, 4]]
        );
        seen[0] = Seen::Unread;
        seen[4] = Seen::Unread;
        assert_eq!(
            runs(&refs[..5], &[], &seen[..5], ms, 0),
            vec![vec![1, 2, 3]]
        );
        seen[3] = Seen::Idle;
        assert_eq!(runs(&refs[..5], &[], &seen[..5], ms, 0), vec![vec![1]]);
        // Unread past a gap: the run before ends, and the unread sample starts none.
        let mut seen = vec![Seen::Busy; refs.len()];
        seen[5] = Seen::Unread;
        assert_eq!(
            runs(&refs[..7], &[], &seen[..7], ms, 0),
            vec![vec![0, 1, 2, 3, 4], vec![6]]
        );
    }

    #[test]
    fn offcpu_in_gil_waits() {
        let o = |start: u64, dur: u64, preempted: bool| OffCpu {
            pid: 1,
            tid: 1,
            start_ns: start,
            dur_ns: dur,
            stack: 0,
            preempted,
            stolen: false,
        };
        let off = [
            o(100, 10, false), // half in GIL waits: Gil
            o(0, 10, true),    // preempted, whatever the GIL
            o(200, 10, false), // 4 of 10 in GIL waits: Blocked
            o(300, 10, false), // 3 + 3 of the same 3 ns (overlapping records): Blocked
            o(400, 10, false), // 2 + 3 in two separate waits: Gil
            o(500, 0, false),  // empty
        ];
        let refs: Vec<&OffCpu> = off.iter().collect();
        let mut all_idle = |_: u32| true;
        let gil = [
            (95, 10),
            (206, 10),
            (300, 3),
            (301, 2),
            (400, 2),
            (407, 3),
            (495, 10),
        ];
        // In a callback's code (no stack is the loop's), GIL waits are Gil; in the loop's
        // poll, PollGil.
        let c = classify_offcpu(&refs, &gil, &mut |_| false);
        assert_eq!(
            c,
            vec![
                (0, 10, Off::Preempted),
                (100, 10, Off::Gil),
                (200, 10, Off::InCallback),
                (300, 10, Off::InCallback),
                (400, 10, Off::Gil),
                (500, 0, Off::InCallback),
            ]
        );
        let c = classify_offcpu(&refs, &gil, &mut all_idle);
        assert_eq!(
            c,
            vec![
                (0, 10, Off::Preempted),
                (100, 10, Off::PollGil),
                (200, 10, Off::Blocked),
                (300, 10, Off::Blocked),
                (400, 10, Off::PollGil),
                (500, 0, Off::Blocked),
            ]
        );
        assert!(classify_offcpu(&refs[2..3], &[], &mut all_idle)
            .iter()
            .all(|x| x.2 == Off::Blocked));
        // Blocked in a callback's code (stack 1), not in the loop's (stack 0).
        let in_cb = [OffCpu {
            stack: 1,
            ..o(200, 10, false)
        }];
        let refs: Vec<&OffCpu> = in_cb.iter().chain(&off[2..3]).collect();
        let c = classify_offcpu(&refs, &[], &mut |stack| stack == 0);
        assert_eq!(c, vec![(200, 10, Off::Blocked), (200, 10, Off::InCallback)]);
        // Longer than MAX_CALLBACK_BLOCK_NS: idle, wherever (a thread waiting in
        // `threading.Event.wait`, not in a loop).
        let long = [OffCpu {
            dur_ns: MAX_CALLBACK_BLOCK_NS + 1,
            ..in_cb[0]
        }];
        let refs: Vec<&OffCpu> = long.iter().collect();
        let c = classify_offcpu(&refs, &[], &mut |stack| stack == 0);
        assert_eq!(c[0].2, Off::Blocked);
    }

    #[test]
    fn loop_frames_are_idle() {
        let rec = Recording {
            frames: vec![
                f("EpollSelector.select", "/usr/lib/python3.12/selectors.py"),
                f("Runner.run", "/usr/lib/python3.11/asyncio/runners.py"),
                f(
                    "run",
                    "/venv/lib/python3.10/site-packages/uvloop/__init__.py",
                ),
                f(
                    "JSONEncoder.iterencode",
                    "/usr/lib/python3.12/json/encoder.py",
                ),
                f("main", "/srv/serve.py"),
            ],
            stacks: vec![
                vec![],
                vec![0, 4],
                vec![1, 4],
                vec![2, 4],
                vec![3, 1, 4],
                vec![4],
            ],
            ..Default::default()
        };
        let idle: Vec<bool> = (0..6).map(|s| is_idle_stack(&rec, s)).collect();
        assert_eq!(idle, [true, true, true, true, false, false]);
    }

    /// An API server's main thread in one 300 ms JSON callback, contended: preempted for
    /// 20 ms, waiting 5 ms for the GIL, and on CPU 12 ms without a sample (a descheduled
    /// virtual CPU); then idle in epoll.
    fn contended_stall(backend: &str) -> Recording {
        use crate::record::{GilWait, ProcessInfo};
        let ms = 1_000_000u64;
        let mut rec = Recording::default();
        rec.meta.backend = backend.into();
        rec.meta.rate_hz = 1000;
        rec.processes.push(ProcessInfo {
            pid: 7,
            role: "api_server".into(),
            ..Default::default()
        });
        rec.frames = vec![
            f(
                "JSONEncoder.iterencode",
                "/usr/lib/python3.12/json/encoder.py",
            ),
            f("JSONResponse.render", "/srv/frontend.py"),
            f("EpollSelector.select", "/usr/lib/python3.12/selectors.py"),
            f(
                "BaseEventLoop._run_once",
                "/usr/lib/python3.12/asyncio/base_events.py",
            ),
        ];
        // 0: empty, 1: in the callback, 2: in the poll.
        rec.stacks = vec![vec![], vec![0, 1, 3], vec![2, 3]];
        let mut t = 1000 * ms;
        let end = t + 300 * ms;
        let mut off = |start: u64, dur: u64, preempted: bool, stack: u32| {
            rec.offcpu.push(OffCpu {
                pid: 7,
                tid: 7,
                start_ns: start,
                dur_ns: dur,
                stack,
                preempted,
                stolen: false,
            })
        };
        off(t - 50 * ms, 50 * ms, false, 2); // idle before
        off(t + 100 * ms, 20 * ms, true, 1); // preempted
        off(t + 150 * ms, 5 * ms, false, 1); // the GIL wait
        off(end, 50 * ms, false, 2); // idle after
        rec.gil_waits.push(GilWait {
            pid: 7,
            tid: 7,
            start_ns: t + 150 * ms,
            dur_ns: 5 * ms,
            holder_tid: 8,
            holder_stack: 0,
            waiter_stack: 1,
            switch_wait: false,
        });
        while t < end {
            let r = t - (end - 300 * ms);
            let quiet = (100 * ms..120 * ms).contains(&r)
                || (150 * ms..155 * ms).contains(&r)
                || (200 * ms..212 * ms).contains(&r);
            if !quiet {
                rec.samples.push(Sample {
                    t_ns: t,
                    pid: 7,
                    tid: 7,
                    stack: 1,
                    flags: 0,
                    weight_ns: ms as u32,
                });
            }
            t += ms;
        }
        rec
    }

    #[test]
    fn stall_extent_from_switches() {
        // No samples in the first 10 and the last 30 ms of the callback (a descheduled
        // virtual CPU takes none): with exact switches the stall still runs from the wake-up
        // to the switch into the poll.
        let ms = 1_000_000u64;
        let quiet = |rec: &mut Recording| {
            rec.samples
                .retain(|s| s.t_ns >= 1010 * ms && s.t_ns < 1270 * ms);
        };
        let mut rec = contended_stall("bpf");
        quiet(&mut rec);
        let st = api_server_stalls(&rec, &Selection::all(&rec), 100_000_000);
        let d: Vec<(f64, f64)> = st
            .stalls
            .iter()
            .map(|s| (s.start_s, s.duration_ms))
            .collect();
        assert_eq!(d, [(1.0, 300.0)]);
        // Samples alone: 1.010 to the last sample's end.
        let mut rec = contended_stall("memory");
        quiet(&mut rec);
        let st = api_server_stalls(&rec, &Selection::all(&rec), 60_000_000);
        let d: Vec<(f64, f64)> = st
            .stalls
            .iter()
            .map(|s| (s.start_s, s.duration_ms))
            .collect();
        assert_eq!(d, [(1.01, 190.0)]);
        // Samples from 1.110 to 1.189 only: the wake-up at 1.000 is 100 ms away once the 20 ms
        // preempted are taken off (theirs), the switch at 1.300 111 ms (not theirs: the
        // callback may have ended long before, the virtual CPU descheduled in the poll).
        let mut rec = contended_stall("bpf");
        rec.samples
            .retain(|s| s.t_ns >= 1110 * ms && s.t_ns < 1190 * ms);
        let st = api_server_stalls(&rec, &Selection::all(&rec), 10_000_000);
        let d: Vec<(f64, f64)> = st
            .stalls
            .iter()
            .map(|s| (s.start_s, s.duration_ms))
            .collect();
        assert_eq!(d, [(1.0, 190.0)]);
    }

    #[test]
    fn gil_wait_in_the_poll_before_a_callback_is_not_the_stall() {
        // Woken from the idle wait at 0.950, the loop waits 50 ms for the GIL in the poll,
        // then the callback runs from 1.000: the stall begins at 1.000.
        use crate::record::GilWait;
        let ms = 1_000_000u64;
        let mut rec = contended_stall("bpf");
        let idle_before = rec
            .offcpu
            .iter_mut()
            .find(|o| o.start_ns == 950 * ms)
            .unwrap();
        idle_before.dur_ns = 0;
        rec.offcpu.push(OffCpu {
            pid: 7,
            tid: 7,
            start_ns: 950 * ms,
            dur_ns: 50 * ms,
            stack: 2,
            preempted: false,
            stolen: false,
        });
        rec.gil_waits.push(GilWait {
            pid: 7,
            tid: 7,
            start_ns: 950 * ms,
            dur_ns: 50 * ms,
            holder_tid: 8,
            holder_stack: 0,
            waiter_stack: 2,
            switch_wait: false,
        });
        let st = api_server_stalls(&rec, &Selection::all(&rec), 100_000_000);
        let d: Vec<(f64, f64, f64)> = st
            .stalls
            .iter()
            .map(|s| (s.start_s, s.duration_ms, s.gil_wait_ms))
            .collect();
        assert_eq!(d, [(1.0, 300.0, 5.0)]);
    }

    #[test]
    fn descheduled_cpu_does_not_split_a_stall() {
        // 135 ms of the callback on CPU without a sample and without a switch (the host
        // descheduled the virtual CPU): with every switch recorded, still one stall.
        let ms = 1_000_000u64;
        let mut rec = contended_stall("bpf");
        rec.samples
            .retain(|s| !(1155 * ms..1290 * ms).contains(&s.t_ns));
        let stalls = |rec: &Recording| -> Vec<(f64, f64)> {
            api_server_stalls(rec, &Selection::all(rec), 100_000_000)
                .stalls
                .iter()
                .map(|s| (s.start_s, s.duration_ms))
                .collect()
        };
        assert_eq!(stalls(&rec), [(1.0, 300.0)]);
        // Events lost: the gap may hide a switch into the idle wait, so more than
        // EXACT_MAX_GAP_NS ends the run: at the last sample before the GIL wait (the 10 ms
        // after the gap are under the threshold).
        rec.counters.insert(LOST_EVENTS_COUNTER.into(), 3);
        assert_eq!(stalls(&rec), [(1.0, 150.0)]);
    }

    #[test]
    fn contended_stall_is_one_with_exact_offcpu() {
        let rec = contended_stall("bpf");
        let st = api_server_stalls(&rec, &Selection::all(&rec), 100_000_000);
        assert_eq!(st.stalls.len(), 1, "{st:?}");
        let s = &st.stalls[0];
        assert_eq!((s.start_s, s.duration_ms), (1.0, 300.0));
        assert_eq!(
            (s.samples, s.gil_wait_ms, s.blocked_ms),
            (300 - 20 - 5 - 12, 5.0, 0.0)
        );
        assert_eq!(s.serialization_share, 1.0);
        assert_eq!(
            s.dominant_stack,
            [
                "JSONEncoder.iterencode (encoder.py)",
                "JSONResponse.render (frontend.py)",
                "BaseEventLoop._run_once (base_events.py)"
            ]
        );
        // Without exact off-CPU intervals (memory backend) the 12 ms gap is taken for a wait:
        // 200 and 88 ms.
        let rec = contended_stall("memory");
        let st = api_server_stalls(&rec, &Selection::all(&rec), 50_000_000);
        let d: Vec<f64> = st.stalls.iter().map(|s| s.duration_ms).collect();
        assert_eq!(d, [200.0, 88.0]);
        // Without the GIL wait record, the 5 ms blocked interval is in the callback's code
        // (say a lock or a page fault): still one stall, the time blocked.
        let mut rec = contended_stall("bpf");
        rec.gil_waits.clear();
        let st = api_server_stalls(&rec, &Selection::all(&rec), 100_000_000);
        assert_eq!(st.stalls.len(), 1, "{st:?}");
        let s = &st.stalls[0];
        assert_eq!(
            (s.duration_ms, s.gil_wait_ms, s.blocked_ms),
            (300.0, 0.0, 5.0)
        );
        // Blocked in the loop's poll for 5 ms: idle, two stalls of 150 and 145 ms.
        if let Some(o) = rec.offcpu.iter_mut().find(|o| o.dur_ns == 5_000_000) {
            o.stack = 2;
        }
        let st = api_server_stalls(&rec, &Selection::all(&rec), 100_000_000);
        let d: Vec<f64> = st.stalls.iter().map(|s| s.duration_ms).collect();
        assert_eq!(d, [150.0, 145.0]);
    }
}
