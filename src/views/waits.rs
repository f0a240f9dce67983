//! Waits on other threads: time a thread spent asleep until another thread of its process woke
//! it (a lock released, a condition notified, a semaphore raised), by who woke it and what each
//! side was running. From the recording's off-CPU intervals and its wake-ups (record 26: the
//! kernel's `sched_waking` inside the waker's futex call, with the waker's Python stack).
//!
//! Each blocked (not preempted) off-CPU interval of a selected thread is matched with the last
//! wake-up of that thread inside it: the interval's stack says where the thread waited (its
//! innermost Python frame: the function that took the lock, or `Condition.wait` for a queue),
//! the wake-up's stack what the waker was running when it let the thread go (the function that
//! held the lock, on its way out of it). What the waker did *while* the thread waited (its
//! samples and its own off-CPU intervals over those waits, by innermost function) says what it
//! held the lock across: a slow call.
//!
//! A wait is an **event wait** when the waiting frame is the standard library's way of waiting
//! for work (`threading`'s `Condition.wait`, `Event.wait`, `Semaphore.acquire`, `Thread.join`,
//! `queue`'s `get`/`put`, `concurrent.futures`): a consumer waiting for its producer is idle,
//! not held back. Any other is a **lock wait**: the thread was in its own code when it blocked
//! on a primitive that another thread released (a `with lock:`, whose `acquire` is C).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::Selection;
use crate::record::{OffCpu, Recording, Sample, Wake};

/// The report's section (Markdown heading).
pub(crate) const HEADING: &str = "Waits on other threads";

/// Functions kept per row in `waker_during[]`.
pub(crate) const DURING_TOP: usize = 3;

/// One (waiting thread, where it waited, waking thread, what the waker ran) pair.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct WaitRow {
    pub pid: i32,
    pub tid: i32,
    pub thread: String,
    /// The waiting thread's innermost Python function when it blocked.
    pub function: String,
    pub file: String,
    /// `lock` or `event` (see the module's doc).
    pub kind: String,
    pub waker_tid: i32,
    pub waker: String,
    /// The waker's innermost Python function when it woke the thread, outside `threading.py`
    /// and `queue.py` (the code that released the lock or notified).
    pub waker_function: String,
    pub waker_file: String,
    pub waits: u64,
    /// Time asleep in those waits (switch-out to switch-in), s.
    pub wait_s: f64,
    pub max_wait_ms: f64,
    /// Share of the recording the thread spent in those waits.
    pub share: f64,
    /// What the waker did during those waits, by innermost Python function (on and off CPU),
    /// most first.
    pub waker_during: Vec<DuringRow>,
    /// Share of those waits in which the waker was itself off CPU (asleep or preempted).
    pub waker_offcpu_share: f64,
}

/// What a waker ran during the waits it ended.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DuringRow {
    pub function: String,
    pub file: String,
    /// true: off CPU in it (a blocking call); false: on CPU.
    pub off_cpu: bool,
    pub s: f64,
}

/// Whether a waiting frame is the standard library waiting for an event or for work.
pub(crate) fn is_event_wait(function: &str, file: &str) -> bool {
    let base = file.rsplit('/').next().unwrap_or(file);
    let last = function.rsplit('.').next().unwrap_or(function);
    let stdlib_wait = matches!(base, "threading.py" | "queue.py")
        && matches!(
            last,
            "wait" | "wait_for" | "acquire" | "join" | "get" | "put" | "_wait_for_tstate_lock"
        );
    stdlib_wait || file.contains("concurrent/futures/")
}

/// A file of the standard library's locks, conditions and queues (`threading.py`, `queue.py`):
/// a waker's frames there are how it woke the thread, not what it was doing.
pub(crate) fn is_wait_machinery(file: &str) -> bool {
    matches!(
        file.rsplit('/').next().unwrap_or(file),
        "threading.py" | "queue.py"
    )
}

/// The innermost Python frame of a stack: (function, file).
fn innermost(rec: &Recording, stack: u32) -> (String, String) {
    innermost_where(rec, stack, |_| true)
}

/// The innermost Python frame of a stack outside `threading.py` and `queue.py`: the code that
/// released a lock or notified a condition (`Queue.put`'s caller rather than
/// `Condition.notify`).
fn innermost_user(rec: &Recording, stack: u32) -> (String, String) {
    let user = innermost_where(rec, stack, |file| !is_wait_machinery(file));
    if user.1.is_empty() {
        innermost(rec, stack)
    } else {
        user
    }
}

fn innermost_where(rec: &Recording, stack: u32, keep: impl Fn(&str) -> bool) -> (String, String) {
    rec.python_frames(stack)
        .find(|f| keep(&f.file))
        .map(|f| (f.function.clone(), f.file.clone()))
        .unwrap_or_else(|| ("<no Python frame>".into(), String::new()))
}

/// One thread's samples and off-CPU intervals.
#[derive(Default)]
struct ThreadEvents<'r> {
    samples: Vec<&'r Sample>,
    offcpu: Vec<&'r OffCpu>,
}

/// The samples and off-CPU intervals of each of `threads`, in one pass over the recording.
fn events_of<'r>(
    rec: &'r Recording,
    threads: impl IntoIterator<Item = (i32, i32)>,
) -> HashMap<(i32, i32), ThreadEvents<'r>> {
    let mut by: HashMap<(i32, i32), ThreadEvents> = threads
        .into_iter()
        .map(|k| (k, ThreadEvents::default()))
        .collect();
    for s in &rec.samples {
        if let Some(e) = by.get_mut(&(s.pid, s.tid)) {
            e.samples.push(s);
        }
    }
    for o in &rec.offcpu {
        if let Some(e) = by.get_mut(&(o.pid, o.tid)) {
            e.offcpu.push(o);
        }
    }
    by
}

/// What a thread ran over a set of intervals: ns by (function, file, off CPU).
fn activity(
    rec: &Recording,
    ev: &ThreadEvents,
    spans: &[(u64, u64)],
) -> (BTreeMap<(String, String, bool), u64>, u64) {
    let mut by: BTreeMap<(String, String, bool), u64> = BTreeMap::new();
    let mut off_ns = 0u64;
    let inside = |t: u64| {
        let i = spans.partition_point(|&(s, _)| s <= t);
        i > 0 && t < spans[i - 1].1
    };
    for s in &ev.samples {
        if inside(s.t_ns) {
            let (f, file) = innermost(rec, s.stack);
            *by.entry((f, file, false)).or_default() += u64::from(s.weight_ns);
        }
    }
    for o in &ev.offcpu {
        let (a, b) = (o.start_ns, o.start_ns.saturating_add(o.dur_ns));
        let first = spans.partition_point(|&(_, e)| e <= a);
        let mut ov = 0u64;
        for &(s, e) in spans[first..].iter().take_while(|&&(s, _)| s < b) {
            ov += e.min(b).saturating_sub(s.max(a));
        }
        if ov > 0 {
            off_ns += ov;
            let (f, file) = innermost(rec, o.stack);
            *by.entry((f, file, true)).or_default() += ov;
        }
    }
    (by, off_ns)
}

/// Every waiting pair of the selected threads, most wait first.
pub fn waits(rec: &Recording, sel: &Selection) -> Vec<WaitRow> {
    if rec.wakes.is_empty() {
        return Vec::new();
    }
    let dur_s = rec.duration_ns().max(1) as f64 / 1e9;
    let mut wakes: HashMap<(i32, i32), Vec<&Wake>> = HashMap::new();
    for w in &rec.wakes {
        wakes.entry((w.pid, w.tid)).or_default().push(w);
    }
    for v in wakes.values_mut() {
        v.sort_by_key(|w| w.t_ns);
    }
    // (pid, tid, waiting function, its file, waker tid, waker function, its file)
    type Key = (i32, i32, String, String, i32, String, String);
    #[derive(Default)]
    struct Acc {
        waits: u64,
        ns: u64,
        max_ns: u64,
        spans: Vec<(u64, u64)>,
    }
    let mut acc: BTreeMap<Key, Acc> = BTreeMap::new();
    let mut names: HashMap<u32, (String, String)> = HashMap::new();
    let mut wakers: HashMap<u32, (String, String)> = HashMap::new();
    for o in sel.offcpu(rec).filter(|o| !o.preempted) {
        let Some(ws) = wakes.get(&(o.pid, o.tid)) else {
            continue;
        };
        let end = o.start_ns.saturating_add(o.dur_ns);
        let i = ws.partition_point(|w| w.t_ns <= end);
        let Some(w) = i.checked_sub(1).map(|i| ws[i]) else {
            continue;
        };
        if w.t_ns < o.start_ns {
            continue;
        }
        let (f, file) = names
            .entry(o.stack)
            .or_insert_with(|| innermost(rec, o.stack))
            .clone();
        let (wf, wfile) = wakers
            .entry(w.waker_stack)
            .or_insert_with(|| innermost_user(rec, w.waker_stack))
            .clone();
        let a = acc
            .entry((o.pid, o.tid, f, file, w.waker_tid, wf, wfile))
            .or_default();
        // Within the time range: the wait's time and what the waker ran meanwhile alike.
        let (s, e) = sel.clip_span(o.start_ns, o.dur_ns);
        a.waits += 1;
        a.ns += e - s;
        a.max_ns = a.max_ns.max(e - s);
        a.spans.push((s, e));
    }
    // What each waker ran meanwhile, from its own events only.
    let by_waker = events_of(rec, acc.keys().map(|k| (k.0, k.4)));
    let none = ThreadEvents::default();
    let mut rows: Vec<WaitRow> = acc
        .into_iter()
        .map(
            |((pid, tid, function, file, waker_tid, waker_function, waker_file), a)| {
                let mut spans = a.spans;
                spans.sort_unstable();
                let ev = by_waker.get(&(pid, waker_tid)).unwrap_or(&none);
                let (by, off_ns) = activity(rec, ev, &spans);
                let mut during: Vec<DuringRow> = by
                    .into_iter()
                    .map(|((function, file, off_cpu), ns)| DuringRow {
                        function,
                        file,
                        off_cpu,
                        s: ns as f64 / 1e9,
                    })
                    .collect();
                during.sort_by(|a, b| b.s.total_cmp(&a.s));
                during.truncate(DURING_TOP);
                WaitRow {
                    pid,
                    tid,
                    thread: rec.thread_name(pid, tid).to_string(),
                    kind: if is_event_wait(&function, &file) {
                        "event".into()
                    } else {
                        "lock".into()
                    },
                    function,
                    file,
                    waker_tid,
                    waker: rec.thread_name(pid, waker_tid).to_string(),
                    waker_function,
                    waker_file,
                    waits: a.waits,
                    wait_s: a.ns as f64 / 1e9,
                    max_wait_ms: a.max_ns as f64 / 1e6,
                    share: a.ns as f64 / 1e9 / dur_s,
                    waker_during: during,
                    waker_offcpu_share: if a.ns > 0 {
                        (off_ns as f64 / a.ns as f64).min(1.0)
                    } else {
                        0.0
                    },
                }
            },
        )
        .collect();
    rows.sort_by(|a, b| {
        b.wait_s
            .total_cmp(&a.wait_s)
            .then((a.pid, a.tid, a.waker_tid).cmp(&(b.pid, b.tid, b.waker_tid)))
    });
    rows
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::record::synth::{Rec, MS, S};
    use crate::record::EndInfo;

    /// A 10 s recording: `handler` (tid 2) sleeps `n` times 6 ms on a lock in `record_result`,
    /// each sleep ended by `flusher` (tid 3) leaving `flush_store`, during which the flusher
    /// was off CPU in `write_out`; `consumer` (tid 4) waits in `Condition.wait` for work.
    pub(crate) fn lock_fight(n: u64) -> Recording {
        let mut r = Rec::new()
            .process(1, "python3 app.py", "")
            .thread(1, 2, "handler")
            .thread(1, 3, "flusher")
            .thread(1, 4, "consumer");
        let waiting = r.stack(&["record_result", "handler_loop"], "app.py");
        let releasing = r.stack(&["flush_store", "flusher_loop"], "app.py");
        let writing = r.stack(&["write_out", "flush_store", "flusher_loop"], "app.py");
        let notify = r.stack_in(&[
            ("Condition.notify", "/usr/lib/python3.12/threading.py"),
            ("Queue.put", "/usr/lib/python3.12/queue.py"),
            ("flush_store", "app.py"),
        ]);
        let wait = r.stack(
            &["Condition.wait", "Queue.get"],
            "/usr/lib/python3.12/threading.py",
        );
        for i in 0..n {
            let t = i * 10 * MS;
            // The flusher writes under the lock from t to t + 7 ms; the handler blocks at
            // t + 1 ms and is woken at t + 7 ms.
            r.offcpu_at((1, 3), t, 7 * MS, writing, false);
            r.offcpu_at((1, 2), t + MS, 6 * MS + 50_000, waiting, false);
            r.wake((1, 2), t + 7 * MS, 3, releasing);
            // A preempted interval with a wake inside is no wait.
            r.offcpu_at((1, 3), t + 8 * MS, MS, releasing, true);
            r.wake((1, 3), t + 8 * MS + 10, 2, waiting);
            // The consumer waits for work the flusher hands on.
            r.offcpu_at((1, 4), t, 9 * MS, wait, false);
            r.wake((1, 4), t + 9 * MS - 10, 3, notify);
        }
        r.0.end = Some(EndInfo {
            duration_ns: 10 * S,
            reason: "duration".into(),
        });
        r.0
    }

    #[test]
    fn a_lock_wait_is_named_with_its_waker_and_what_the_waker_held_it_across() {
        let rec = lock_fight(500);
        let rows = waits(&rec, &Selection::all(&rec));
        let lock: Vec<&WaitRow> = rows.iter().filter(|w| w.kind == "lock").collect();
        assert_eq!(lock.len(), 1, "{rows:#?}");
        let w = lock[0];
        assert_eq!((w.tid, w.function.as_str()), (2, "record_result"));
        assert_eq!((w.waker_tid, w.waker_function.as_str()), (3, "flush_store"));
        assert_eq!(w.waits, 500);
        assert!((w.wait_s - 500.0 * 6.05e-3).abs() < 1e-9, "{}", w.wait_s);
        assert!((w.share - w.wait_s / 10.0).abs() < 1e-12);
        // The flusher was off CPU in write_out through every wait but its last 50 µs.
        assert_eq!(w.waker_during[0].function, "write_out");
        assert!(w.waker_during[0].off_cpu);
        assert!((w.waker_during[0].s - 500.0 * 6e-3).abs() < 1e-9);
        // The consumer's wait is for work (threading.py), woken by the code that put it.
        let ev = rows
            .iter()
            .find(|w| w.tid == 4)
            .expect("the consumer's row");
        assert_eq!(ev.kind, "event");
        assert_eq!(ev.waker_function, "flush_store");
        // The preempted intervals with a wake inside are not waits.
        assert!(rows.iter().all(|w| w.tid != 3), "{rows:#?}");
    }

    #[test]
    fn a_time_range_cuts_the_wait_and_what_the_waker_ran_alike() {
        let rec = lock_fight(500);
        // From 4 ms: half of the first wait (1 to 7.05 ms), none of the later ones.
        let sel = Selection::all(&rec).during(4 * MS, 10 * MS);
        let rows = waits(&rec, &sel);
        let w = rows
            .iter()
            .find(|w| w.kind == "lock")
            .expect("the lock row");
        assert_eq!(w.waits, 1);
        assert!((w.wait_s - 3.05e-3).abs() < 1e-12, "{}", w.wait_s);
        // The flusher was off CPU in write_out from 4 to 7 ms of it.
        assert!(
            (w.waker_during[0].s - 3e-3).abs() < 1e-12,
            "{:?}",
            w.waker_during
        );
    }

    #[test]
    fn a_wake_outside_the_interval_ends_nothing() {
        let mut r = Rec::new().thread(1, 2, "a").thread(1, 3, "b");
        let s = r.stack(&["f"], "app.py");
        r.offcpu_at((1, 2), 10 * MS, 5 * MS, s, false);
        // Before the interval began, and after it ended.
        r.wake((1, 2), 9 * MS, 3, s);
        r.wake((1, 2), 16 * MS, 3, s);
        let rec = r.0;
        assert!(waits(&rec, &Selection::all(&rec)).is_empty());
    }

    #[test]
    fn lock_contention_is_a_finding_above_its_share_and_count_only() {
        use crate::views::findings::{LOCK_MIN_SHARE, LOCK_MIN_WAITS};
        use crate::views::report::Report;
        let kinds = |rec: &Recording| -> Vec<(String, f64)> {
            Report::build(rec, &Selection::all(rec))
                .findings
                .iter()
                .map(|f| (f.kind.clone(), f.score))
                .collect()
        };
        // 500 waits of 6.05 ms in 10 s: 30% of the handler's time, the first finding.
        let f = kinds(&lock_fight(500));
        assert_eq!(f[0].0, "lock_contention", "{f:?}");
        assert!((f[0].1 - 0.3025).abs() < 1e-9, "{f:?}");
        // The consumer's waits for work are no finding.
        assert_eq!(f.iter().filter(|k| k.0 == "lock_contention").count(), 1);
        // Below the share: 80 waits are 4.8% of the recording.
        let below = lock_fight(80);
        let rows = waits(&below, &Selection::all(&below));
        let handler = rows.iter().find(|w| w.tid == 2).expect("the handler's row");
        assert!(handler.share < LOCK_MIN_SHARE, "{rows:#?}");
        assert!(kinds(&below).iter().all(|k| k.0 != "lock_contention"));
        // Enough share, too few waits: 9 waits of 60 ms.
        let mut few = lock_fight(0);
        let s = few.stacks.len() as u32;
        few.stacks.push(few.stacks[1].clone());
        for i in 0..(LOCK_MIN_WAITS - 1) {
            let t = i * 100 * MS;
            few.offcpu.push(crate::record::OffCpu {
                pid: 1,
                tid: 2,
                start_ns: t,
                dur_ns: 60 * MS,
                stack: s,
                preempted: false,
                stolen: false,
            });
            few.wakes.push(Wake {
                t_ns: t + 60 * MS,
                pid: 1,
                tid: 2,
                waker_tid: 3,
                waker_stack: 2,
            });
        }
        let rows = waits(&few, &Selection::all(&few));
        assert!(rows[0].share >= LOCK_MIN_SHARE, "{rows:#?}");
        assert!(kinds(&few).iter().all(|k| k.0 != "lock_contention"));
    }

    #[test]
    fn event_waits_are_the_standard_librarys() {
        assert!(is_event_wait(
            "Condition.wait",
            "/usr/lib/python3.12/threading.py"
        ));
        assert!(is_event_wait("Queue.get", "/usr/lib/python3.12/queue.py"));
        assert!(is_event_wait(
            "Thread._wait_for_tstate_lock",
            "threading.py"
        ));
        assert!(!is_event_wait("Condition.__enter__", "threading.py"));
        assert!(!is_event_wait("record_result", "app.py"));
        assert!(!is_event_wait("wait", "app.py"));
        assert!(is_event_wait(
            "Future.result",
            "/usr/lib/python3.12/concurrent/futures/_base.py"
        ));
        assert!(!is_event_wait("Model.result", "/srv/app/_base.py"));
    }
}
