//! Findings: what costs the recorded processes their time, ranked, each with the figures that
//! prove it and where in the report to look (issue 23).
//!
//! Every finding is computed from the report's own tables (which come from
//! [`crate::accounting`]) and the recording's events, so its figures are the tables' figures.
//! Its `score` is the share of the affected thread's (or process's) wall time that it
//! explains, 0..1; findings are ranked by it. A finding is made only where its evidence holds:
//! a share above its kind's threshold *and* enough events behind it (waits, pauses, samples)
//! that the share is not one sample's or one pause's accident. No finding is better than a
//! wrong one.
//!
//! Kinds:
//! - `gil_contention`: a thread waits for the GIL [`GIL_MIN_SHARE`] or more of the recording,
//!   over at least [`GIL_MIN_WAITS`] waits; names the thread that held it most when the waits
//!   began and what that thread ran, and, for each probed function on the waiting thread, how
//!   much of its calls' time was GIL wait. Scored by that share, except a thread of an engine
//!   process off its step loop (where the step anatomy names the loop's threads) that keeps
//!   up, idle more than [`KEEPS_UP_IDLE`]: its waits delay what it hands on, not the steps, so
//!   it is context, at [`MIN_SCORE`] (an output thread behind the busy loop, the writer
//!   behind the worker's main thread).
//! - `gc_pressure`: a process's collections take [`GC_MIN_SHARE`] or more of the recording,
//!   over at least [`GC_MIN_PAUSES`] pauses; by generation (count, mean and max pause), the
//!   thread that collected most, and the function the collections interrupted most (the
//!   innermost Python frame of the samples taken during them).
//! - `serialization`: pickle/JSON/msgpack encoding or decoding
//!   ([`super::stalls::is_serialization_frame`], or a native frame of `_pickle`, `_json`,
//!   msgpack, orjson, ujson, cbor2) takes [`SERIAL_MIN_SHARE`] or more of a
//!   thread's CPU over at least [`SERIAL_MIN_SAMPLES`] samples, and at least [`MIN_SCORE`] of
//!   the recording; named after the Python function
//!   that calls it (the caller of the outermost serializing frame), with the time per call where
//!   that function is probed.
//! - `busy_spin`: a thread that wanted a CPU [`SPIN_MIN_CPU_SHARE`] or more of the recording
//!   (on CPU, or preempted: runnable but switched out, which a spinning thread on a busy
//!   machine is for much of its time), at least [`SPIN_MIN_POLL_SHARE`] of its CPU in a
//!   polling loop (a function named like `acquire_read`, `sched_yield`, `spin`, `busy_wait`,
//!   `poll`): a core burnt waiting, scored by the CPU it burnt.
//! - `per_request_growth`: a probed function's median time on CPU per call (its duration
//!   less the thread's GIL waits and time off CPU inside it), per interval between its
//!   engine's scrapes, grows with the running requests they read (least squares over at least
//!   [`GROWTH_MIN_POINTS`] intervals of at least half the median interval's calls: the
//!   scrapes, not the report's 10 s windows, so that a sweep of concurrencies or a ramp inside
//!   one window is seen; not a vLLM step or `execute_model`, whose
//!   work grows with the batch by design and with what is inside them,
//!   correlation at least [`GROWTH_MIN_R`], a rise over the range seen of at least
//!   [`GROWTH_MIN_RISE`] of its mean): the slope in ms per running request, scored by the
//!   share of the thread's time the per-request part takes (calls/s × slope × mean running).
//! - `step_anatomy`: where an engine's steps go, from exact probes on both sides of its
//!   MessageQueue ([`super::anatomy`]): the EngineCore's `step` split into dispatch
//!   (`enqueue`), waiting for the workers (`dequeue`) and scheduling and output, each worker's
//!   `execute_model` into running, GIL wait, GC and off CPU, over at least
//!   [`super::anatomy::MIN_STEPS`] steps watched whole; the critical path named; context for
//!   the other kinds, listed at [`MIN_SCORE`] (its share of a step not running on the critical
//!   path in its evidence).
//! - `event_loop_stall`: the API-server stall detector's stalls (`views::stalls`), their total
//!   over the recording.
//! - the fleet's situations (`views::fleet`: `kv_memory_wall`, `queue_while_others_idle`,
//!   `ttft_outlier`), scored by the share of the recording they lasted.
//! - `vcpu_steal`: the hypervisor took [`STEAL_MIN_SHARE`] or more of a thread's time while it
//!   was on its vCPU (the report's stolen off-CPU time: no switch, its runtime stood still);
//!   the thread that lost most, and how many others lost as much. The machine's condition, not
//!   the program's: context, at [`MIN_SCORE`], saying that time-based figures carry it.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::anatomy::{merged, overlap, StepAnatomy};
use super::report::Report;
use super::stalls::is_serialization_frame;
use super::Selection;
use crate::record::{flags, Recording};

/// A thread waiting for the GIL this share of the recording or more.
pub(crate) const GIL_MIN_SHARE: f64 = 0.05;
/// ...over at least this many waits.
pub(crate) const GIL_MIN_WAITS: u64 = 10;
/// A process collecting garbage this share of the recording or more. Below it, collections
/// are what allocating Python code pays in the ordinary way: the bundled engine with its gen-2
/// churn fixed still spends 2.4-2.8% of its EngineCore's time in (mostly young) collections,
/// by its own `gc.callbacks` and by this recording alike, and nothing there is to fix; the
/// seed's problem took 10.7%, the bundled slow engine's 10-17%.
pub(crate) const GC_MIN_SHARE: f64 = 0.05;
/// ...over at least this many pauses.
pub(crate) const GC_MIN_PAUSES: u64 = 3;
/// Serialization this share of a thread's CPU or more.
pub(crate) const SERIAL_MIN_SHARE: f64 = 0.05;
/// ...over at least this many samples.
pub(crate) const SERIAL_MIN_SAMPLES: u64 = 10;
/// A thread on CPU or preempted (runnable) this share of the recording or more...
pub(crate) const SPIN_MIN_CPU_SHARE: f64 = 0.5;
/// ...this share of it in a polling loop or more...
pub(crate) const SPIN_MIN_POLL_SHARE: f64 = 0.5;
/// ...over at least this many samples.
pub(crate) const SPIN_MIN_SAMPLES: u64 = 20;
/// Serialization and per-request growth explain at least this share of the thread's time
/// (below it, the finding would rank under every real one and read as noise).
pub const MIN_SCORE: f64 = 0.01;
/// A thread of an engine process off its step loop idle more than this share of the
/// recording keeps up with its work: its GIL waits are latency, not throughput.
pub(crate) const KEEPS_UP_IDLE: f64 = 0.1;
/// A thread losing this share of the recording or more to the hypervisor's steal.
pub(crate) const STEAL_MIN_SHARE: f64 = 0.05;
/// Findings listed first in Markdown and on `top`'s line.
pub const TOP: usize = 5;

/// A probe's median time on CPU per call, per interval between its engine's scrapes,
/// regressed on the running requests those scrapes read: at least this many intervals (of
/// [`GROWTH_MIN_CALLS`] calls each)...
pub(crate) const GROWTH_MIN_POINTS: usize = 6;
pub(crate) const GROWTH_MIN_CALLS: u64 = 3;
/// ...a correlation of at least this...
pub(crate) const GROWTH_MIN_R: f64 = 0.7;
/// ...and growth over the running range of at least this share of the mean latency.
pub(crate) const GROWTH_MIN_RISE: f64 = 0.2;

/// A thread asleep on a lock another thread released, this share of the recording or more.
pub(crate) const LOCK_MIN_SHARE: f64 = 0.05;
/// ... over at least this many waits.
pub(crate) const LOCK_MIN_WAITS: u64 = 10;

/// Function names (last part of the qualified name, or a part of it) that poll.
const POLLING: &[&str] = &[
    "acquire_read",
    "acquire_write",
    "sched_yield",
    "spin",
    "busy_wait",
    "poll",
];

/// One finding.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Finding {
    /// `gil_contention`, `gc_pressure`, `serialization`, `busy_spin`, `per_request_growth`,
    /// `step_anatomy`, `event_loop_stall`, or a fleet situation's kind.
    pub kind: String,
    /// Share of the affected thread's or process's wall time it explains, 0..1.
    pub score: f64,
    /// The affected process (0 for a fleet situation without one).
    pub pid: i32,
    /// The affected thread, where the finding is about one.
    pub tid: Option<i32>,
    pub thread: String,
    /// The function it is about (the holder's, the serializing caller's, the polling one's).
    pub function: String,
    /// One line: what is wrong, with its main figures.
    pub verdict: String,
    /// The figures used, by name.
    pub evidence: BTreeMap<String, Value>,
    /// The report's section that proves it (its Markdown heading).
    pub see: String,
}

/// Every finding of a report, highest score first.
pub fn findings(rec: &Recording, sel: &Selection, r: &Report) -> Vec<Finding> {
    let mut out = Vec::new();
    let dur_ns = rec.duration_ns().max(1);
    let anatomies = super::anatomy::step_anatomies(rec, sel);
    gil_contention(rec, sel, r, dur_ns, &anatomies, &mut out);
    gc_pressure(rec, sel, r, dur_ns, &mut out);
    serialization(rec, sel, r, &mut out);
    busy_spin(rec, sel, r, &mut out);
    lock_contention(rec, r, &mut out);
    per_request_growth(rec, sel, r, &mut out);
    step_anatomy(rec, r, &anatomies, &mut out);
    vcpu_steal(rec, r, &mut out);
    for s in &r.api_server_stalls.servers {
        let stalled_s = s.stalled_s;
        if s.stalls == 0 || r.duration_s <= 0.0 {
            continue;
        }
        out.push(Finding {
            kind: "event_loop_stall".into(),
            score: (stalled_s / r.duration_s).min(1.0),
            pid: s.pid,
            tid: Some(s.pid),
            thread: rec.thread_name(s.pid, s.pid).to_string(),
            function: String::new(),
            verdict: format!(
                "the API server's event loop (pid {}) stalled {} times for {:.3} s in all ({:.1}% of the recording), the longest {:.1} ms",
                s.pid,
                s.stalls,
                stalled_s,
                stalled_s / r.duration_s * 100.0,
                s.longest_ms
            ),
            evidence: [
                ("stalls".to_string(), json!(s.stalls)),
                ("stalled_s".to_string(), json!(stalled_s)),
                ("longest_ms".to_string(), json!(s.longest_ms)),
            ]
            .into_iter()
            .collect(),
            see: "API-server stalls".into(),
        });
    }
    for f in &r.fleet_findings {
        let lasted = (f.end_s - f.start_s).max(0.0);
        out.push(Finding {
            kind: f.kind.clone(),
            score: if r.duration_s > 0.0 {
                (lasted / r.duration_s).min(1.0)
            } else {
                0.0
            },
            pid: 0,
            tid: None,
            thread: String::new(),
            function: String::new(),
            verdict: format!("{}: {}", f.engine, f.detail),
            evidence: [
                ("engine".to_string(), json!(f.engine)),
                ("start_s".to_string(), json!(f.start_s)),
                ("end_s".to_string(), json!(f.end_s)),
            ]
            .into_iter()
            .collect(),
            see: "Fleet findings".into(),
        });
    }
    rank(&mut out);
    out
}

/// Highest score first; ties by kind, then process and thread (a stable order to print).
pub fn rank(findings: &mut [Finding]) {
    findings.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(a.kind.cmp(&b.kind))
            .then((a.pid, a.tid).cmp(&(b.pid, b.tid)))
    });
}

/// `MainThread (tid 7) of engine_core (pid 7)`: a thread as a finding names it, with its
/// process's role (or executable) so that two engines' main threads read apart.
fn who(rec: &Recording, name: &str, pid: i32, tid: i32) -> String {
    thread_label(name, tid, super::process_name(rec, pid), pid)
}

/// The words a finding names a thread with (the report's and `top`'s alike).
pub(crate) fn thread_label(name: &str, tid: i32, process: &str, pid: i32) -> String {
    format!("{name} (tid {tid}) of {process} (pid {pid})")
}

/// One generation's pauses as a GC finding lists them: `gen 2: 19 × 46.25 ms (max 72.04)`.
pub(crate) fn generation_pauses(generation: i8, pauses: u64, total_ns: u64, max_ns: u64) -> String {
    let name = if generation < 0 {
        "generation unknown".to_string()
    } else {
        format!("gen {generation}")
    };
    format!(
        "{name}: {pauses} × {:.2} ms (max {:.2})",
        total_ns as f64 / pauses.max(1) as f64 / 1e6,
        max_ns as f64 / 1e6
    )
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// For each exact probe with calls on (pid, tid): (probe's function, calls, mean call ms, mean
/// GIL wait inside a call ms). The thread's waits do not overlap one another.
fn gil_in_calls(
    rec: &Recording,
    sel: &Selection,
    pid: i32,
    tid: i32,
) -> Vec<(String, u64, f64, f64)> {
    let mut waits: Vec<(u64, u64)> = sel
        .gil_waits(rec)
        .filter(|g| g.pid == pid && g.tid == tid && !g.switch_wait)
        .map(|g| (g.start_ns, g.start_ns.saturating_add(g.dur_ns)))
        .collect();
    waits.sort_unstable();
    let mut by_probe: BTreeMap<u32, (u64, u64, u64)> = BTreeMap::new();
    // Exact probes only: a sampled probe's calls are stitched from samples, lower bounds
    // whose edges are a sampling period off.
    let exact = |p: u32| {
        rec.probes
            .iter()
            .rev()
            .find(|q| q.id == p)
            .is_some_and(|q| q.method == "exact")
    };
    for c in sel
        .calls(rec)
        .filter(|c| c.pid == pid && c.tid == tid && exact(c.probe))
    {
        let (a, b) = (c.start_ns, c.start_ns.saturating_add(c.dur_ns));
        // The first wait that ends after the call begins.
        let mut i = waits.partition_point(|w| w.1 <= a);
        let mut inside = 0u64;
        while let Some(&(ws, we)) = waits.get(i) {
            if ws >= b {
                break;
            }
            inside += we.min(b).saturating_sub(ws.max(a));
            i += 1;
        }
        let e = by_probe.entry(c.probe).or_default();
        e.0 += 1;
        e.1 += c.dur_ns;
        e.2 += inside;
    }
    by_probe
        .into_iter()
        .filter(|(_, (n, _, _))| *n > 0)
        .map(|(p, (n, total, inside))| {
            let name = rec
                .probes
                .iter()
                .find(|q| q.id == p)
                .map_or_else(|| format!("probe {p}"), |q| q.function.clone());
            (
                name,
                n,
                total as f64 / n as f64 / 1e6,
                inside as f64 / n as f64 / 1e6,
            )
        })
        .collect()
}

fn gil_contention(
    rec: &Recording,
    sel: &Selection,
    r: &Report,
    dur_ns: u64,
    anatomies: &[StepAnatomy],
    out: &mut Vec<Finding>,
) {
    let dur_s = dur_ns as f64 / 1e9;
    // The threads that run an engine's step (its EngineCore's and its workers'), where the
    // step anatomy found them, and their processes.
    let step_threads: Vec<(i32, i32)> = anatomies
        .iter()
        .flat_map(|a| std::iter::once(&a.engine_core).chain(&a.workers))
        .map(|s| (s.pid, s.tid))
        .collect();
    for t in &r.threads {
        let share = t.gil_wait_s / dur_s;
        if share < GIL_MIN_SHARE || t.gil_waits < GIL_MIN_WAITS {
            continue;
        }
        let idle = (1.0 - (t.cpu_s + t.gil_wait_s) / dur_s).max(0.0);
        let keeps_up = keeps_up_off_step(&step_threads, t.pid, t.tid, idle);
        let score = if keeps_up { MIN_SCORE } else { share };
        // The holder that made it wait most (a thread, not the GIL being free or itself).
        let holder = r
            .gil_blocking_pairs
            .iter()
            .filter(|p| p.waiter_pid == t.pid && p.waiter_tid == t.tid)
            .filter(|p| p.holder_tid != 0 && p.holder_tid != t.tid)
            .max_by(|a, b| a.wait_s.total_cmp(&b.wait_s));
        let mut evidence: BTreeMap<String, Value> = [
            ("gil_wait_s".to_string(), json!(t.gil_wait_s)),
            ("waits".to_string(), json!(t.gil_waits)),
            ("share_of_recording".to_string(), json!(share)),
        ]
        .into_iter()
        .collect();
        let mut verdict = format!(
            "{} waits for the GIL {} of the recording ({:.3} s, {} waits)",
            who(rec, &t.name, t.pid, t.tid),
            pct(share),
            t.gil_wait_s,
            t.gil_waits
        );
        let mut function = String::new();
        if let Some(h) = holder {
            let top = h.holder_top.first();
            function = top.map(|f| f.function.clone()).unwrap_or_default();
            verdict.push_str(&format!(
                ", {} of it behind {} (tid {})",
                pct(h.share_of_wait),
                h.holder_name,
                h.holder_tid
            ));
            if let Some(f) = top {
                verdict.push_str(&format!(" running {} ({:.3} s)", f.function, f.wait_s));
            }
            evidence.insert("holder_tid".into(), json!(h.holder_tid));
            evidence.insert("holder".into(), json!(h.holder_name));
            evidence.insert("holder_share_of_wait".into(), json!(h.share_of_wait));
            evidence.insert(
                "holder_functions".into(),
                json!(h
                    .holder_top
                    .iter()
                    .map(|f| json!({"function": f.function, "wait_s": f.wait_s}))
                    .collect::<Vec<_>>()),
            );
        }
        let calls = gil_in_calls(rec, sel, t.pid, t.tid);
        if let Some((name, n, mean, wait)) = calls
            .iter()
            .max_by(|a, b| (a.3 * a.1 as f64).total_cmp(&(b.3 * b.1 as f64)))
            .filter(|c| c.3 > 0.0)
        {
            verdict.push_str(&format!(
                "; {name}: {mean:.2} ms per call, of which {wait:.2} ms GIL wait ({n} calls)"
            ));
        }
        if !calls.is_empty() {
            evidence.insert(
                "probed_calls".into(),
                json!(calls
                    .iter()
                    .map(|(f, n, mean, wait)| json!({"function": f, "calls": n, "mean_ms": mean, "gil_wait_mean_ms": wait}))
                    .collect::<Vec<_>>()),
            );
        }
        if keeps_up {
            verdict.push_str(&format!(
                "; off the engine's step loop and idle {} of the recording, it keeps up: this delays what it hands on, not the engine's steps",
                pct(idle)
            ));
            evidence.insert("off_step_loop".into(), json!(true));
            evidence.insert("idle_share".into(), json!(idle));
        }
        out.push(Finding {
            kind: "gil_contention".into(),
            score: score.min(1.0),
            pid: t.pid,
            tid: Some(t.tid),
            thread: t.name.clone(),
            function,
            verdict,
            evidence,
            see: "Who blocks whom".into(),
        });
    }
}

fn gc_pressure(rec: &Recording, sel: &Selection, r: &Report, dur_ns: u64, out: &mut Vec<Finding>) {
    // Per process: pauses by generation (count, total, max), by thread.
    #[derive(Default)]
    struct Acc {
        total: u64,
        n: u64,
        gens: BTreeMap<i8, (u64, u64, u64)>,
        threads: HashMap<i32, u64>,
    }
    let mut per: BTreeMap<i32, Acc> = BTreeMap::new();
    for g in sel.gc_pauses(rec) {
        let a = per.entry(g.pid).or_default();
        a.total += g.dur_ns;
        a.n += 1;
        let e = a.gens.entry(g.generation).or_default();
        e.0 += 1;
        e.1 += g.dur_ns;
        e.2 = e.2.max(g.dur_ns);
        *a.threads.entry(g.tid).or_default() += g.dur_ns;
    }
    for (pid, a) in per {
        let share = a.total as f64 / dur_ns as f64;
        if share < GC_MIN_SHARE || a.n < GC_MIN_PAUSES {
            continue;
        }
        // The function the collections interrupted most: the innermost Python frame of the
        // samples taken during a collection in this process.
        let mut interrupted: HashMap<&str, u64> = HashMap::new();
        for s in sel.samples(rec) {
            if s.pid != pid || s.flags & flags::GC == 0 {
                continue;
            }
            // Native and kernel frames (the collector's own) are passed over.
            let python = rec.python_frames(s.stack).find(|f| !f.function.is_empty());
            if let Some(f) = python {
                *interrupted.entry(f.function.as_str()).or_default() += u64::from(s.weight_ns);
            }
        }
        let function = interrupted
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(f, _)| f.to_string())
            .unwrap_or_default();
        let tid = a
            .threads
            .iter()
            .max_by(|x, y| x.1.cmp(y.1).then(y.0.cmp(x.0)))
            .map(|(t, _)| *t);
        let gens: Vec<String> = a
            .gens
            .iter()
            .rev()
            .map(|(&g, &(n, total, max))| generation_pauses(g, n, total, max))
            .collect();
        let process = r
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .map(|p| {
                if p.role.is_empty() {
                    p.name.clone()
                } else {
                    p.role.clone()
                }
            })
            .unwrap_or_default();
        let mut verdict = format!(
            "{process} (pid {pid}) collects garbage {} of the recording ({:.3} s in {} pauses; {})",
            pct(share),
            a.total as f64 / 1e9,
            a.n,
            gens.join(", ")
        );
        if !function.is_empty() {
            verdict.push_str(&format!("; most often interrupting {function}"));
        }
        out.push(Finding {
            kind: "gc_pressure".into(),
            score: share.min(1.0),
            pid,
            tid,
            thread: tid.map(|t| rec.thread_name(pid, t).to_string()).unwrap_or_default(),
            function,
            verdict,
            evidence: [
                ("gc_s".to_string(), json!(a.total as f64 / 1e9)),
                ("pauses".to_string(), json!(a.n)),
                ("share_of_recording".to_string(), json!(share)),
                (
                    "by_generation".to_string(),
                    json!(a
                        .gens
                        .iter()
                        .map(|(g, (n, total, max))| (g.to_string(), json!({"pauses": n, "total_s": *total as f64 / 1e9, "max_ms": *max as f64 / 1e6})))
                        .collect::<BTreeMap<_, _>>()),
                ),
            ]
            .into_iter()
            .collect(),
            see: "GC".into(),
        });
    }
}

/// Whether a thread of an engine process off its step loop (`step_threads`: the threads that
/// run the engine's steps) keeps up: idle (neither on CPU nor waiting for the GIL) more than
/// [`KEEPS_UP_IDLE`] of the time. Its GIL waits then delay what it hands on (latency), not the
/// engine's steps: context, listed after the causes at the least score. One that cannot keep
/// up limits throughput: full score. The report and `top`'s window both judge by it.
pub(crate) fn keeps_up_off_step(
    step_threads: &[(i32, i32)],
    pid: i32,
    tid: i32,
    idle: f64,
) -> bool {
    let off_step =
        step_threads.iter().any(|&(p, _)| p == pid) && !step_threads.contains(&(pid, tid));
    off_step && idle > KEEPS_UP_IDLE
}

/// Native modules whose every frame is (de)serialization (the C halves of pickle, json and
/// the msgpack and JSON packages).
const SERIALIZING_MODULES: &[&str] = &[
    "_pickle", "_json", "_msgpack", "msgpack", "orjson", "ujson", "_cbor2",
];

/// A frame that encodes or decodes: a Python frame as the API-server stall detector has it
/// ([`is_serialization_frame`]), or a native frame of a serializing module (`[_pickle]
/// save_list`).
fn is_serializing(rec: &Recording, id: u32) -> bool {
    if let Some(n) = rec.frame_native.get(&id) {
        let module = crate::native::short_module_name(&n.module);
        return SERIALIZING_MODULES.iter().any(|m| module.starts_with(m));
    }
    rec.frames
        .get(id as usize)
        .is_some_and(is_serialization_frame)
}

fn serialization(rec: &Recording, sel: &Selection, r: &Report, out: &mut Vec<Finding>) {
    // Per thread: serializing time by the Python function that calls it.
    // (pid, tid) -> (serializing ns, samples, ns by calling function).
    type Serializing = (u64, u64, HashMap<String, u64>);
    let mut per: BTreeMap<(i32, i32), Serializing> = BTreeMap::new();
    for s in sel.samples(rec) {
        let Some(ids) = rec.stacks.get(s.stack as usize) else {
            continue;
        };
        // Innermost first: the outermost serializing frame, then the first Python frame
        // outside it (its caller).
        let Some(outer) = ids.iter().rposition(|&id| is_serializing(rec, id)) else {
            continue;
        };
        let name = |id: u32| rec.frames.get(id as usize).map(|f| f.function.clone());
        let caller = ids[outer + 1..]
            .iter()
            .find(|&&id| rec.frame_kind(id) == 0)
            .and_then(|&id| name(id))
            .or_else(|| name(ids[outer]))
            .unwrap_or_default();
        let e = per.entry((s.pid, s.tid)).or_default();
        e.0 += u64::from(s.weight_ns);
        e.1 += 1;
        *e.2.entry(caller).or_default() += u64::from(s.weight_ns);
    }
    for ((pid, tid), (ns, n, callers)) in per {
        let Some(t) = r.threads.iter().find(|t| t.pid == pid && t.tid == tid) else {
            continue;
        };
        let share = if t.cpu_s > 0.0 {
            ns as f64 / 1e9 / t.cpu_s
        } else {
            0.0
        };
        let score = ns as f64 / 1e9 / r.duration_s.max(1e-9);
        if share < SERIAL_MIN_SHARE || n < SERIAL_MIN_SAMPLES || score < MIN_SCORE {
            continue;
        }
        let (caller, caller_ns) = callers
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(c, v)| (c.clone(), *v))
            .unwrap_or_default();
        let per_s = ns as f64 / 1e9 / r.duration_s.max(1e-9);
        let mut verdict = format!(
            "{} spends {} of its CPU ({:.3} s, {:.1} ms per s) serializing, most under {caller}",
            who(rec, &t.name, pid, tid),
            pct(share),
            ns as f64 / 1e9,
            per_s * 1e3,
        );
        let mut evidence: BTreeMap<String, Value> = [
            ("serialization_s".to_string(), json!(ns as f64 / 1e9)),
            ("samples".to_string(), json!(n)),
            ("share_of_cpu".to_string(), json!(share)),
            ("caller".to_string(), json!(caller)),
            ("caller_s".to_string(), json!(caller_ns as f64 / 1e9)),
        ]
        .into_iter()
        .collect();
        // Per call where the caller is probed on this thread (exact counts only).
        if let Some(l) = r.function_latency.iter().find(|l| {
            l.pid == pid && l.tid == tid && l.function == caller && l.method.starts_with("exact")
        }) {
            if l.calls > 0 {
                let per_call = caller_ns as f64 / 1e6 / l.calls as f64;
                verdict.push_str(&format!(
                    " ({per_call:.3} ms per call of {} calls)",
                    l.calls
                ));
                evidence.insert("per_call_ms".into(), json!(per_call));
                evidence.insert("calls".into(), json!(l.calls));
            }
        }
        out.push(Finding {
            kind: "serialization".into(),
            score: score.min(1.0),
            pid,
            tid: Some(tid),
            thread: t.name.clone(),
            function: caller,
            verdict,
            evidence,
            see: format!("Top functions: {} (tid {tid}, pid {pid})", t.name),
        });
    }
}

/// A function that polls (its name, last part, contains one of the polling words).
pub(crate) fn is_polling(function: &str) -> bool {
    let last = function.rsplit('.').next().unwrap_or(function);
    POLLING.iter().any(|p| last.contains(p))
}

fn busy_spin(rec: &Recording, sel: &Selection, r: &Report, out: &mut Vec<Finding>) {
    if r.duration_s <= 0.0 {
        return;
    }
    // (pid, tid) -> (samples, polling ns by function).
    type Polling<'r> = (u64, HashMap<&'r str, u64>);
    let mut per: BTreeMap<(i32, i32), Polling> = BTreeMap::new();
    for s in sel.samples(rec) {
        let e = per.entry((s.pid, s.tid)).or_default();
        e.0 += 1;
        if let Some(f) = rec.stack_frames(s.stack).find(|f| is_polling(&f.function)) {
            *e.1.entry(f.function.as_str()).or_default() += u64::from(s.weight_ns);
        }
    }
    for t in &r.threads {
        let cpu_share = t.cpu_s / r.duration_s;
        // A thread that spins on a machine with more runnable threads than CPUs gets a share
        // of one: it is runnable all the time, on CPU part of it (a reader spinning in
        // sched_yield beside two busy loops on 2 CPUs: on CPU ~35%, preempted the rest).
        let runnable_share = (t.cpu_s + t.offcpu_preempted_s) / r.duration_s;
        let Some((n, polls)) = per.get(&(t.pid, t.tid)) else {
            continue;
        };
        let poll_ns: u64 = polls.values().sum();
        let poll_share = if t.cpu_s > 0.0 {
            poll_ns as f64 / 1e9 / t.cpu_s
        } else {
            0.0
        };
        if runnable_share < SPIN_MIN_CPU_SHARE
            || poll_share < SPIN_MIN_POLL_SHARE
            || *n < SPIN_MIN_SAMPLES
        {
            continue;
        }
        let function = polls
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(f, _)| f.to_string())
            .unwrap_or_default();
        let burnt = poll_ns as f64 / 1e9 / r.duration_s;
        out.push(Finding {
            kind: "busy_spin".into(),
            score: burnt.min(1.0),
            pid: t.pid,
            tid: Some(t.tid),
            thread: t.name.clone(),
            function: function.clone(),
            verdict: format!(
                "{} is on CPU {} of the recording{}, {} of it polling in {function}: {:.2} of a core spent waiting",
                who(rec, &t.name, t.pid, t.tid),
                pct(cpu_share),
                if t.offcpu_preempted_s > 0.01 * r.duration_s {
                    format!(
                        " and waits for a CPU {} more (preempted)",
                        pct(t.offcpu_preempted_s / r.duration_s)
                    )
                } else {
                    String::new()
                },
                pct(poll_share),
                burnt
            ),
            evidence: [
                ("cpu_share".to_string(), json!(cpu_share)),
                ("runnable_share".to_string(), json!(runnable_share)),
                ("polling_share_of_cpu".to_string(), json!(poll_share)),
                ("cores_polling".to_string(), json!(burnt)),
            ]
            .into_iter()
            .collect(),
            see: format!("Top functions: {} (tid {}, pid {})", t.name, t.tid, t.pid),
        });
    }
}

fn vcpu_steal(rec: &Recording, r: &Report, out: &mut Vec<Finding>) {
    if r.duration_s <= 0.0 {
        return;
    }
    let share = |t: &super::report::ThreadRow| t.offcpu_stolen_s / r.duration_s;
    let mut hit: Vec<&super::report::ThreadRow> = r
        .threads
        .iter()
        .filter(|t| share(t) >= STEAL_MIN_SHARE)
        .collect();
    hit.sort_by(|a, b| {
        b.offcpu_stolen_s
            .total_cmp(&a.offcpu_stolen_s)
            .then((a.pid, a.tid).cmp(&(b.pid, b.tid)))
    });
    let Some(t) = hit.first() else {
        return;
    };
    let others = hit.len() - 1;
    out.push(Finding {
        kind: "vcpu_steal".into(),
        score: MIN_SCORE,
        pid: t.pid,
        tid: Some(t.tid),
        thread: t.name.clone(),
        function: String::new(),
        verdict: format!(
            "the hypervisor took {} of the recording from {} while it was on its vCPU ({:.3} s of steal: runnable, not running){}: time figures on this machine (step latency, throughput, a before/after) carry it; compare runs on one host at one load, or use dedicated vCPUs",
            pct(share(t)),
            who(rec, &t.name, t.pid, t.tid),
            t.offcpu_stolen_s,
            if others > 0 {
                format!(", and {} or more from {others} other thread(s)", pct(STEAL_MIN_SHARE))
            } else {
                String::new()
            }
        ),
        evidence: [
            ("stolen_s".to_string(), json!(t.offcpu_stolen_s)),
            ("stolen_share".to_string(), json!(share(t))),
            ("threads".to_string(), json!(hit.len())),
            (
                "all_threads_stolen_s".to_string(),
                json!(r.totals.offcpu_stolen_s),
            ),
        ]
        .into_iter()
        .collect(),
        see: "Threads".into(),
    });
}

fn lock_contention(rec: &Recording, r: &Report, out: &mut Vec<Finding>) {
    for w in r.waits.iter().filter(|w| w.kind == "lock") {
        if w.share < LOCK_MIN_SHARE || w.waits < LOCK_MIN_WAITS {
            continue;
        }
        let mean_ms = w.wait_s * 1e3 / w.waits as f64;
        let across = w.waker_during.first().map_or(String::new(), |d| {
            format!(
                ", which held it across {} ({} CPU in it {:.3} s of those waits)",
                d.function,
                if d.off_cpu { "off" } else { "on" },
                d.s
            )
        });
        let verdict = format!(
            "{} sleeps on a lock in {} {} of the recording ({} waits, mean {mean_ms:.2} ms, max {:.1} ms), released by {} (tid {}) leaving {}{across}",
            who(rec, &w.thread, w.pid, w.tid),
            w.function,
            pct(w.share),
            w.waits,
            w.max_wait_ms,
            w.waker,
            w.waker_tid,
            w.waker_function,
        );
        let during: Vec<Value> = w
            .waker_during
            .iter()
            .map(|d| json!({"function": d.function, "off_cpu": d.off_cpu, "s": d.s}))
            .collect();
        out.push(Finding {
            kind: "lock_contention".into(),
            score: w.share.min(1.0),
            pid: w.pid,
            tid: Some(w.tid),
            thread: w.thread.clone(),
            function: w.function.clone(),
            verdict,
            evidence: [
                ("wait_s".to_string(), json!(w.wait_s)),
                ("waits".to_string(), json!(w.waits)),
                ("mean_ms".to_string(), json!(mean_ms)),
                ("max_ms".to_string(), json!(w.max_wait_ms)),
                ("waker_tid".to_string(), json!(w.waker_tid)),
                ("waker".to_string(), json!(w.waker)),
                ("waker_function".to_string(), json!(w.waker_function)),
                ("waker_during".to_string(), Value::Array(during)),
                (
                    "waker_offcpu_share".to_string(),
                    json!(w.waker_offcpu_share),
                ),
            ]
            .into_iter()
            .collect(),
            see: super::waits::HEADING.into(),
        });
    }
}

/// One side of a step as a finding lists it: `EngineCore.step on MainThread (tid 7) of
/// engine_core (pid 7): 5.00 ms a call (30 timed whole): dispatch (enqueue) 0.50 ms (10%), ...`.
fn side_line(rec: &Recording, s: &super::anatomy::Side) -> String {
    let parts: Vec<String> = s
        .parts
        .iter()
        .map(|(p, ms)| format!("{p} {ms:.2} ms ({})", pct(ms / s.mean_ms.max(1e-9))))
        .collect();
    format!(
        "{} on {}: {:.2} ms a call ({} timed whole): {}",
        s.function,
        who(rec, rec.thread_name(s.pid, s.tid), s.pid, s.tid),
        s.mean_ms,
        s.calls,
        parts.join(", ")
    )
}

/// Where each step of an engine goes, and which side is its critical path (`step_anatomy`,
/// [`super::anatomy`]). Context for the other findings, not a cause of its own: what the
/// critical path spends not running is the GIL waits, collections and blocks that the
/// other kinds name (scored by the step's share it would have been, it came first in the demo
/// and put the GIL fight behind it second), so it is listed at [`MIN_SCORE`], after them;
/// `evidence.critical_not_running_share` keeps that share.
fn step_anatomy(rec: &Recording, r: &Report, anatomies: &[StepAnatomy], out: &mut Vec<Finding>) {
    use super::anatomy::{RUNNING, WAIT_WORKERS};
    if r.duration_s <= 0.0 {
        return;
    }
    for a in anatomies {
        let e = &a.engine_core;
        let wait = e.share(WAIT_WORKERS);
        let worst = a
            .workers
            .iter()
            .max_by(|x, y| y.share(RUNNING).total_cmp(&x.share(RUNNING)));
        let (critical, not_running) = match worst {
            Some(w) if wait >= 0.5 => (
                format!(
                    "the workers (the EngineCore waits for them {} of a step; {}'s {} runs {} of its time)",
                    pct(wait),
                    who(rec, rec.thread_name(w.pid, w.tid), w.pid, w.tid),
                    w.function,
                    pct(w.share(RUNNING))
                ),
                wait * (1.0 - w.share(RUNNING)),
            ),
            None if wait >= 0.5 => (
                format!(
                    "the workers (the EngineCore waits for them {} of a step; their execute_model was not timed)",
                    pct(wait)
                ),
                0.0,
            ),
            _ => (
                format!(
                    "the EngineCore (it waits for the workers {} of a step)",
                    pct(wait)
                ),
                0.0,
            ),
        };
        let mut lines = vec![side_line(rec, e)];
        lines.extend(a.workers.iter().map(|w| side_line(rec, w)));
        out.push(Finding {
            kind: "step_anatomy".into(),
            score: MIN_SCORE,
            pid: e.pid,
            tid: Some(e.tid),
            thread: rec.thread_name(e.pid, e.tid).to_string(),
            function: e.function.clone(),
            verdict: format!("{}; critical path: {critical}", lines.join("; ")),
            evidence: [
                ("engine_core".to_string(), json!(e)),
                ("workers".to_string(), json!(a.workers)),
                ("waiting_for_workers_share".to_string(), json!(wait)),
                ("critical_not_running_share".to_string(), json!(not_running)),
            ]
            .into_iter()
            .collect(),
            see: "Function latency".into(),
        });
    }
}

/// GitHub's anchor of a Markdown heading: lower case, letters, digits, `-` and `_` kept,
/// spaces turned into `-`, everything else dropped.
pub(crate) fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Points a line is fitted through at most: beyond, an even subsample by index (the pairs of
/// the slope's median grow with its square).
const FIT_MAX_POINTS: usize = 1000;

/// A line through `points`, robust to a few points far off it: (slope, intercept,
/// correlation), the slope the median of the pairwise slopes (Theil-Sen), the intercept the
/// median of y - slope x, the correlation Pearson's; None when x or y is constant.
///
/// Why not least squares: an interval between two scrapes in which the running requests
/// jumped holds calls of both levels, and its median sits at one level while its reading is
/// the mean of the two. A staircase of batch sizes scraped every 0.25 s put one such point at
/// every step, and least squares read the slope 15% off run to run (their side of the line
/// follows the scrapes' phase against the steps); the median of slopes ignores them.
fn fit(points: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    if points.len() < 2 {
        return None;
    }
    let step = points.len().div_ceil(FIT_MAX_POINTS);
    let points: Vec<(f64, f64)> = points.iter().step_by(step).copied().collect();
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 || syy <= 0.0 {
        return None;
    }
    let mut slopes: Vec<f64> = Vec::with_capacity(points.len() * (points.len() - 1) / 2);
    for (i, a) in points.iter().enumerate() {
        for b in &points[i + 1..] {
            if b.0 != a.0 {
                slopes.push((b.1 - a.1) / (b.0 - a.0));
            }
        }
    }
    let slope = super::timeline::median(&slopes)?;
    let rest: Vec<f64> = points.iter().map(|p| p.1 - slope * p.0).collect();
    let intercept = super::timeline::median(&rest)?;
    Some((slope, intercept, sxy / (sxx * syy).sqrt()))
}

/// The intervals between an engine's scrapes of its running requests, each with the mean of
/// its two readings and the median time on CPU of a probe's calls that began in it; only
/// intervals holding [`GROWTH_MIN_CALLS`] calls and at least half the median interval's
/// (an interval cut by the engine stopping is not the steady state the others are).
fn growth_points(running: &[(u64, f64)], mut calls: Vec<(u64, u64)>) -> Vec<(f64, f64)> {
    calls.sort_unstable();
    let mut per: Vec<(f64, Vec<u64>)> = Vec::new();
    let mut i = 0;
    for w in running.windows(2) {
        let (t0, t1) = (w[0].0, w[1].0);
        while i < calls.len() && calls[i].0 < t0 {
            i += 1;
        }
        let mut d = Vec::new();
        while i < calls.len() && calls[i].0 < t1 {
            d.push(calls[i].1);
            i += 1;
        }
        if !d.is_empty() {
            per.push(((w[0].1 + w[1].1) / 2.0, d));
        }
    }
    let mut counts: Vec<usize> = per.iter().map(|p| p.1.len()).collect();
    counts.sort_unstable();
    let enough = counts
        .get(counts.len() / 2)
        .map_or(GROWTH_MIN_CALLS as usize, |&m| {
            (GROWTH_MIN_CALLS as usize).max(m / 2)
        });
    per.into_iter()
        .filter(|(_, d)| d.len() >= enough)
        .map(|(x, mut d)| {
            d.sort_unstable();
            (x, d[(d.len() - 1) / 2] as f64 / 1e6)
        })
        .collect()
}

/// A thread's time off CPU or waiting for the GIL, merged.
fn off_cpu_of(rec: &Recording, sel: &Selection, pid: i32, tid: i32) -> Vec<(u64, u64)> {
    merged(
        sel.offcpu(rec)
            .filter(|o| o.pid == pid && o.tid == tid)
            .map(|o| (o.start_ns, o.start_ns.saturating_add(o.dur_ns)))
            .chain(
                sel.gil_waits(rec)
                    .filter(|g| g.pid == pid && g.tid == tid)
                    .map(|g| (g.start_ns, g.start_ns.saturating_add(g.dur_ns))),
            )
            .collect(),
    )
}

fn per_request_growth(rec: &Recording, sel: &Selection, r: &Report, out: &mut Vec<Finding>) {
    let ix = crate::metrics::MetricIndex::new(rec);
    // Each thread's time off CPU or waiting for the GIL, read once for all its probes.
    let mut waits: HashMap<(i32, i32), Vec<(u64, u64)>> = HashMap::new();
    // One line per probed function and process, whatever its method over time.
    let mut seen = std::collections::BTreeSet::new();
    for p in &rec.probes {
        if !seen.insert((p.pid, p.spec.as_str())) {
            continue;
        }
        // A step or a model run grows with its batch by design (the model's work is per
        // token), and with whatever grows inside it: the calls inside it are the finding.
        if crate::vllm::probes::is_headline(&p.function) {
            continue;
        }
        let Some(engine) = rec
            .engines
            .iter()
            .rev()
            .find(|e| e.pids().contains(&p.pid))
            .map(|e| e.id.as_str())
        else {
            continue;
        };
        let running = ix.gauge(engine, &crate::metrics::names::RUNNING);
        let ids: Vec<u32> = rec
            .probes
            .iter()
            .filter(|q| q.pid == p.pid && q.spec == p.spec)
            .map(|q| q.id)
            .collect();
        // Each call's time on CPU: its duration less the thread's GIL waits and other time
        // off CPU inside it, so that a call that waits (a reader blocked on its queue, behind
        // the GIL) is judged by its own work, not by how long its peer took.
        let calls: Vec<(u64, u64)> = rec
            .calls
            .iter()
            .filter(|c| ids.contains(&c.probe) && sel.contains(c.pid, c.tid))
            .map(|c| {
                let w = waits
                    .entry((c.pid, c.tid))
                    .or_insert_with(|| off_cpu_of(rec, sel, c.pid, c.tid));
                let end = c.start_ns.saturating_add(c.dur_ns);
                (
                    c.start_ns,
                    c.dur_ns.saturating_sub(overlap(w, c.start_ns, end)),
                )
            })
            .collect();
        let points = growth_points(&running, calls);
        if points.len() < GROWTH_MIN_POINTS {
            continue;
        }
        let Some((slope, intercept, corr)) = fit(&points) else {
            continue;
        };
        let lo = points.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let hi = points.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        let mean_y = points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64;
        let mean_x = points.iter().map(|p| p.0).sum::<f64>() / points.len() as f64;
        let rise = slope * (hi - lo);
        if slope <= 0.0 || corr < GROWTH_MIN_R || mean_y <= 0.0 || rise < GROWTH_MIN_RISE * mean_y {
            continue;
        }
        // Calls per second as the latency table estimates them (a budgeted probe's scaled).
        let calls_per_s: f64 = r
            .function_latency
            .iter()
            .filter(|l| l.pid == p.pid && l.function == p.function)
            .map(|l| l.calls_per_s)
            .sum();
        let score = (calls_per_s * slope * mean_x / 1e3).clamp(0.0, 1.0);
        if score < MIN_SCORE {
            continue;
        }
        let (pid, function) = (p.pid, p.function.clone());
        out.push(Finding {
            kind: "per_request_growth".into(),
            score,
            pid,
            tid: None,
            thread: String::new(),
            function: function.clone(),
            verdict: format!(
                "{function} (pid {pid}) runs {:.1} µs more on CPU per running request of {engine} (r {corr:.2} over {} scrape intervals, {lo:.0}-{hi:.0} running): {:.2} ms a call at {lo:.0}, {:.2} ms at {hi:.0}; the per-request part takes {:.1}% of its thread at {mean_x:.0} running",
                slope * 1e3,
                points.len(),
                intercept + slope * lo,
                intercept + slope * hi,
                score * 100.0
            ),
            evidence: [
                ("slope_ms_per_request".to_string(), json!(slope)),
                ("intercept_ms".to_string(), json!(intercept)),
                ("r".to_string(), json!(corr)),
                ("intervals".to_string(), json!(points.len())),
                ("running_min".to_string(), json!(lo)),
                ("running_max".to_string(), json!(hi)),
                ("running_mean".to_string(), json!(mean_x)),
                ("calls_per_s".to_string(), json!(calls_per_s)),
            ]
            .into_iter()
            .collect(),
            see: "Function latency".into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{
        EndInfo, Frame, FunctionCall, GcPause, GilWait, OffCpu, ProbeInfo, Sample, ThreadInfo,
    };

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    fn frame(function: &str, file: &str) -> Frame {
        Frame {
            function: function.into(),
            file: file.into(),
            line: Some(1),
        }
    }

    /// A 10 s recording of pid 1 with threads 1 (main) and 2 (writer); frames: 0 main,
    /// 1 Writer.evict, 2 Worker.execute_model, 3 pickle dumps, 4 MessageQueue.enqueue,
    /// 5 MessageQueue.acquire_read, 6 step; stacks: 0 [evict], 1 [execute_model, main],
    /// 2 [dumps, enqueue, main], 3 [acquire_read, main], 4 [step, main].
    fn base() -> Recording {
        Recording {
            frames: vec![
                frame("main", "m.py"),
                frame("Writer.evict", "w.py"),
                frame("Worker.execute_model", "w.py"),
                frame("dumps", "/usr/lib/python3.12/pickle.py"),
                frame("MessageQueue.enqueue", "shm.py"),
                frame("MessageQueue.acquire_read", "shm.py"),
                frame("step", "m.py"),
            ],
            stacks: vec![vec![1], vec![2, 0], vec![3, 4, 0], vec![5, 0], vec![6, 0]],
            threads: vec![
                ThreadInfo {
                    pid: 1,
                    tid: 1,
                    name: "main".into(),
                    ..ThreadInfo::default()
                },
                ThreadInfo {
                    pid: 1,
                    tid: 2,
                    name: "writer".into(),
                    ..ThreadInfo::default()
                },
            ],
            end: Some(EndInfo {
                duration_ns: 10 * S,
                reason: "duration".into(),
            }),
            ..Recording::default()
        }
    }

    /// `n` samples of 10 ms on (1, tid) with `stack`, from `from` on.
    fn samples(rec: &mut Recording, tid: i32, stack: u32, n: u64, from: u64, flags: u8) {
        for i in 0..n {
            rec.samples.push(Sample {
                t_ns: from + i * 10 * MS,
                pid: 1,
                tid,
                stack,
                flags,
                weight_ns: 10_000_000,
            });
        }
    }

    fn run(rec: &Recording) -> Vec<Finding> {
        Report::build(rec, &Selection::all(rec)).findings
    }

    /// An engine (1 s, its worker waiting for the GIL 10% of it inside execute_model) whose
    /// EngineCore process has two more threads waiting for the GIL 12% of the recording: an
    /// output thread idle the rest of the time (it keeps up: listed at the least score, after
    /// the worker's) and a helper on CPU 84% of it (it cannot keep up: full score).
    #[test]
    fn gil_contention_off_the_step_loop_counts_only_where_the_thread_cannot_keep_up() {
        let mut rec = crate::views::anatomy::tests::engine(100);
        for (tid, name) in [(5, "engine-output"), (6, "helper")] {
            rec.threads.push(ThreadInfo {
                pid: 1,
                tid,
                name: name.into(),
                t_ns: 0,
                python_name: None,
            });
            for i in 0..60u64 {
                rec.gil_waits.push(GilWait {
                    pid: 1,
                    tid,
                    start_ns: i * 16 * MS,
                    dur_ns: 2 * MS,
                    holder_tid: 1,
                    holder_stack: 0,
                    waiter_stack: 0,
                    switch_wait: false,
                });
            }
        }
        rec.stacks.push(vec![]);
        samples(&mut rec, 6, 0, 84, 0, 0);
        let f = run(&rec);
        let score = |tid: i32| {
            f.iter()
                .find(|g| g.kind == "gil_contention" && g.tid == Some(tid))
                .unwrap_or_else(|| panic!("tid {tid}: {f:#?}"))
                .score
        };
        assert!((score(2) - 0.1).abs() < 1e-9, "{f:#?}");
        assert_eq!(score(5), MIN_SCORE, "{f:#?}");
        assert!((score(6) - 0.12).abs() < 1e-9, "{f:#?}");
        let out = f.iter().find(|g| g.tid == Some(5)).unwrap();
        assert_eq!(out.evidence["off_step_loop"], json!(true));
        assert!(out.verdict.contains("it keeps up"), "{}", out.verdict);
    }

    /// An engine's dequeue (100 calls/s) grows 0.02 ms per running request over twelve 10 s
    /// stretches (running 8, 12, ... 52, scraped every second): a finding with that slope; its
    /// step, which grows the same (the dequeue is inside it), is no finding; a few fast calls
    /// after the last scrape (the engine stopping) are in no interval and left out of the fit.
    #[test]
    fn per_request_growth_fits_the_scrape_intervals_and_names_the_inner_call() {
        use crate::record::{EngineInfo, MetricPoint, MetricSeries};
        let mut rec = base();
        rec.end = Some(EndInfo {
            duration_ns: 125 * S,
            reason: "duration".into(),
        });
        rec.engines.push(EngineInfo {
            id: "engine0".into(),
            engine_core_pids: vec![1],
            ..Default::default()
        });
        rec.series.push(MetricSeries {
            id: 0,
            engine: "engine0".into(),
            name: "vllm:num_requests_running".into(),
            kind: "gauge".into(),
            ..Default::default()
        });
        for (id, function) in [(0, "MessageQueue.dequeue"), (1, "EngineCore.step")] {
            rec.probes.push(ProbeInfo {
                id,
                pid: 1,
                spec: function.into(),
                function: function.into(),
                method: "exact".into(),
                ..Default::default()
            });
        }
        for w in 0..12u64 {
            let running = 8 + 4 * w;
            for k in 0..10u64 {
                rec.metrics.push(MetricPoint {
                    t_ns: w * 10 * S + k * S,
                    series: 0,
                    value: running as f64,
                });
            }
            let dur = MS / 2 + running * MS / 50;
            for c in 0..1000u64 {
                let t = w * 10 * S + c * 10 * MS;
                rec.calls.push(FunctionCall {
                    probe: 1,
                    pid: 1,
                    tid: 1,
                    start_ns: t,
                    dur_ns: dur + MS,
                });
                rec.calls.push(FunctionCall {
                    probe: 0,
                    pid: 1,
                    tid: 1,
                    start_ns: t + MS / 2,
                    dur_ns: dur,
                });
            }
        }
        // The last 5 s: the engine stopping, 5 fast calls (running still read 52).
        rec.metrics.push(MetricPoint {
            t_ns: 120 * S,
            series: 0,
            value: 52.0,
        });
        for c in 0..5u64 {
            rec.calls.push(FunctionCall {
                probe: 0,
                pid: 1,
                tid: 1,
                start_ns: 120 * S + c * MS,
                dur_ns: MS / 10,
            });
        }
        let f = run(&rec);
        let g: Vec<&Finding> = f
            .iter()
            .filter(|f| f.kind == "per_request_growth")
            .collect();
        assert_eq!(g.len(), 1, "{f:#?}");
        assert_eq!(g[0].function, "MessageQueue.dequeue");
        let slope = g[0].evidence["slope_ms_per_request"].as_f64().unwrap();
        assert!((slope - 0.02).abs() < 1e-3, "{slope}");
    }

    /// An engine whose EngineCore waits for its worker 60% of each step, the worker running a
    /// third of its execute_model waiting for the GIL: the workers are the critical path,
    /// 0.6 x 1/3 of a step not running there; listed at the least score, after the causes.
    #[test]
    fn step_anatomy_names_the_critical_path() {
        let rec = crate::views::anatomy::tests::engine(30);
        let f = run(&rec);
        let a = f
            .iter()
            .find(|f| f.kind == "step_anatomy")
            .unwrap_or_else(|| panic!("{f:#?}"));
        assert_eq!(a.score, MIN_SCORE);
        let nr = a.evidence["critical_not_running_share"].as_f64().unwrap();
        assert!((nr - 0.2).abs() < 1e-9, "{nr}");
        assert_eq!(
            (a.pid, a.tid, a.function.as_str()),
            (1, Some(1), "EngineCore.step")
        );
        assert!(
            a.verdict
                .contains("waiting for the workers (dequeue) 3.00 ms (60.0%)")
                && a.verdict.contains("GIL wait 1.00 ms (33.3%)")
                && a.verdict.contains("critical path: the workers"),
            "{}",
            a.verdict
        );
        // Without the worker's calls: the EngineCore's side, at the least score.
        let mut rec = rec;
        rec.calls.retain(|c| c.pid == 1);
        let f = run(&rec);
        let a = f.iter().find(|f| f.kind == "step_anatomy").unwrap();
        assert_eq!(a.score, MIN_SCORE);
        assert!(
            a.verdict.contains("execute_model was not timed"),
            "{}",
            a.verdict
        );
    }

    /// The main thread waits `n` times `wait` ms for the GIL held by the writer in `evict`,
    /// inside calls of an exactly probed `execute_model` of 20 ms each.
    fn gil_fight(n: u64, wait: u64) -> Recording {
        let mut rec = base();
        rec.probes.push(ProbeInfo {
            id: 0,
            spec: "Worker.execute_model".into(),
            pid: 1,
            function: "Worker.execute_model".into(),
            file: "w.py".into(),
            method: "exact".into(),
            ..ProbeInfo::default()
        });
        for i in 0..n {
            let start = i * 50 * MS;
            rec.calls.push(FunctionCall {
                probe: 0,
                pid: 1,
                tid: 1,
                start_ns: start,
                dur_ns: 20 * MS,
            });
            rec.gil_waits.push(GilWait {
                pid: 1,
                tid: 1,
                start_ns: start + 5 * MS,
                dur_ns: wait * MS,
                holder_tid: 2,
                holder_stack: 0,
                waiter_stack: 1,
                switch_wait: false,
            });
        }
        samples(&mut rec, 2, 0, 100, 0, flags::GIL);
        samples(&mut rec, 1, 1, 100, 0, flags::GIL);
        rec
    }

    #[test]
    fn gil_contention_names_the_holder_its_function_and_the_wait_inside_probed_calls() {
        // 100 waits of 10 ms: 1 s of 10 s.
        let f = run(&gil_fight(100, 10));
        let g = f
            .iter()
            .find(|f| f.kind == "gil_contention")
            .expect("a finding");
        assert_eq!((g.pid, g.tid), (1, Some(1)));
        assert!((g.score - 0.1).abs() < 1e-9, "{}", g.score);
        assert_eq!(g.function, "Writer.evict");
        assert_eq!(g.evidence["holder_tid"], json!(2));
        let calls = &g.evidence["probed_calls"][0];
        assert_eq!(calls["calls"], json!(100));
        assert!((calls["mean_ms"].as_f64().unwrap() - 20.0).abs() < 1e-9);
        assert!((calls["gil_wait_mean_ms"].as_f64().unwrap() - 10.0).abs() < 1e-9);
        assert!(
            g.verdict
                .contains("20.00 ms per call, of which 10.00 ms GIL wait"),
            "{}",
            g.verdict
        );
        // A wait that runs past the call counts only inside it.
        let f = run(&gil_fight(100, 30));
        let g = f.iter().find(|f| f.kind == "gil_contention").unwrap();
        let calls = &g.evidence["probed_calls"][0];
        assert!((calls["gil_wait_mean_ms"].as_f64().unwrap() - 15.0).abs() < 1e-9);
    }

    #[test]
    fn gil_contention_below_its_thresholds_is_no_finding() {
        // 40 ms of waiting: 0.4% of the recording.
        assert!(run(&gil_fight(4, 10))
            .iter()
            .all(|f| f.kind != "gil_contention"));
        // 6% of the recording, but in 5 waits (below GIL_MIN_WAITS).
        assert!(run(&gil_fight(5, 120))
            .iter()
            .all(|f| f.kind != "gil_contention"));
        // 6% over 12 waits: a finding.
        assert!(run(&gil_fight(12, 50))
            .iter()
            .any(|f| f.kind == "gil_contention"));
    }

    fn gc_storm(pauses: u64, each_ms: u64) -> Recording {
        let mut rec = base();
        for i in 0..pauses {
            rec.gc_pauses.push(GcPause {
                pid: 1,
                tid: 1,
                start_ns: i * 20 * MS,
                dur_ns: each_ms * MS,
                generation: if i % 10 == 9 { 2 } else { 0 },
                collected: 10,
            });
        }
        // Samples during collections interrupt `step`; others run `main`'s execute_model.
        samples(&mut rec, 1, 4, 30, 0, flags::GC);
        samples(&mut rec, 1, 1, 10, 5 * S, 0);
        rec
    }

    #[test]
    fn gc_pressure_by_generation_with_the_function_interrupted() {
        // 300 pauses of 2 ms: 0.6 s of 10 s.
        let f = run(&gc_storm(300, 2));
        let g = f
            .iter()
            .find(|f| f.kind == "gc_pressure")
            .expect("a finding");
        assert!((g.score - 0.06).abs() < 1e-9, "{}", g.score);
        assert_eq!(g.pid, 1);
        assert_eq!(g.function, "step");
        assert_eq!(g.evidence["pauses"], json!(300));
        assert_eq!(g.evidence["by_generation"]["2"]["pauses"], json!(30));
        assert_eq!(g.evidence["by_generation"]["0"]["pauses"], json!(270));
        assert!(g.verdict.contains("gen 2: 30 × 2.00 ms"), "{}", g.verdict);
        // 1% of the recording: none.
        assert!(run(&gc_storm(50, 2))
            .iter()
            .all(|f| f.kind != "gc_pressure"));
        // 3% in two pauses (below GC_MIN_PAUSES): none.
        assert!(run(&gc_storm(2, 150))
            .iter()
            .all(|f| f.kind != "gc_pressure"));
    }

    #[test]
    fn serialization_is_named_after_its_caller_with_the_time_per_probed_call() {
        let mut rec = base();
        rec.probes.push(ProbeInfo {
            id: 0,
            spec: "MessageQueue.enqueue".into(),
            pid: 1,
            function: "MessageQueue.enqueue".into(),
            file: "shm.py".into(),
            method: "exact".into(),
            ..ProbeInfo::default()
        });
        for i in 0..50 {
            rec.calls.push(FunctionCall {
                probe: 0,
                pid: 1,
                tid: 1,
                start_ns: i * 100 * MS,
                dur_ns: 5 * MS,
            });
        }
        // 20 samples (0.2 s) pickling under enqueue, 80 elsewhere: 20% of the thread's CPU.
        samples(&mut rec, 1, 2, 20, 0, 0);
        samples(&mut rec, 1, 4, 80, 3 * S, 0);
        let f = run(&rec);
        let g = f
            .iter()
            .find(|f| f.kind == "serialization")
            .expect("a finding");
        assert_eq!(g.function, "MessageQueue.enqueue");
        assert!((g.evidence["share_of_cpu"].as_f64().unwrap() - 0.2).abs() < 1e-9);
        assert!((g.evidence["per_call_ms"].as_f64().unwrap() - 4.0).abs() < 1e-9);
        assert!((g.score - 0.02).abs() < 1e-9, "{}", g.score);
        // 3 samples of 100: below both thresholds.
        let mut rec = base();
        samples(&mut rec, 1, 2, 3, 0, 0);
        samples(&mut rec, 1, 4, 97, 3 * S, 0);
        assert!(run(&rec).iter().all(|f| f.kind != "serialization"));
    }

    #[test]
    fn busy_spin_needs_a_core_mostly_polling() {
        let mut rec = base();
        // 8 s on CPU, 7 of it in acquire_read.
        samples(&mut rec, 1, 3, 700, 0, 0);
        samples(&mut rec, 1, 4, 100, 7 * S, 0);
        let f = run(&rec);
        let g = f.iter().find(|f| f.kind == "busy_spin").expect("a finding");
        assert_eq!(g.function, "MessageQueue.acquire_read");
        assert!((g.score - 0.7).abs() < 1e-9, "{}", g.score);
        // The same thread on CPU 3 s of 10: not a spinning core.
        let mut rec = base();
        samples(&mut rec, 1, 3, 300, 0, 0);
        assert!(run(&rec).iter().all(|f| f.kind != "busy_spin"));
        // On CPU 8 s, polling 2 of them: no.
        let mut rec = base();
        samples(&mut rec, 1, 3, 200, 0, 0);
        samples(&mut rec, 1, 4, 600, 2 * S, 0);
        assert!(run(&rec).iter().all(|f| f.kind != "busy_spin"));
        // On CPU 3 s of 10, all of it polling, and preempted (runnable, switched out) 5 s
        // more: a spinner on a machine with more runnable threads than CPUs. It burnt 0.3
        // of a core.
        let mut rec = base();
        samples(&mut rec, 1, 3, 300, 0, 0);
        for i in 0..500 {
            rec.offcpu.push(OffCpu {
                pid: 1,
                tid: 1,
                start_ns: 3 * S + i * 10 * MS,
                dur_ns: 10 * MS,
                stack: 3,
                preempted: true,
                stolen: false,
            });
        }
        let f = run(&rec);
        let g = f.iter().find(|f| f.kind == "busy_spin").expect("a finding");
        assert!((g.score - 0.3).abs() < 1e-9, "{}", g.score);
        assert!(
            g.verdict.contains("waits for a CPU 50.0% more"),
            "{}",
            g.verdict
        );
        // Blocked instead of preempted: it waited, it did not spin.
        for o in &mut rec.offcpu {
            o.preempted = false;
        }
        assert!(run(&rec).iter().all(|f| f.kind != "busy_spin"));
    }

    #[test]
    fn steal_is_context_naming_the_thread_that_lost_most() {
        // Thread 1 on CPU 3 s of 10 and 1 s taken from it by the hypervisor; thread 2 0.2 s.
        let mut rec = base();
        samples(&mut rec, 1, 3, 300, 0, 0);
        samples(&mut rec, 2, 0, 100, 0, 0);
        let stolen = |tid: i32, n: u64| {
            (0..n).map(move |i| OffCpu {
                pid: 1,
                tid,
                start_ns: i * 100 * MS,
                dur_ns: 10 * MS,
                stack: 3,
                preempted: true,
                stolen: true,
            })
        };
        rec.offcpu.extend(stolen(1, 100));
        rec.offcpu.extend(stolen(2, 20));
        let f = run(&rec);
        let g = f
            .iter()
            .find(|f| f.kind == "vcpu_steal")
            .expect("a finding");
        assert_eq!((g.tid, g.score), (Some(1), MIN_SCORE));
        assert!(
            g.verdict.contains("took 10.0% of the recording"),
            "{}",
            g.verdict
        );
        assert!(!g.verdict.contains("other thread"), "{}", g.verdict);
        assert!((g.evidence["all_threads_stolen_s"].as_f64().unwrap() - 1.2).abs() < 1e-9);
        // Preempted by another process instead: no steal.
        for o in &mut rec.offcpu {
            o.stolen = false;
        }
        assert!(run(&rec).iter().all(|f| f.kind != "vcpu_steal"));
    }

    #[test]
    fn a_quiet_recording_has_no_finding_and_findings_rank_by_score() {
        let mut rec = base();
        samples(&mut rec, 1, 4, 100, 0, 0);
        samples(&mut rec, 2, 0, 100, 0, 0);
        assert!(run(&rec).is_empty());
        // GIL 10% and GC 6%: GIL first.
        let mut rec = gil_fight(100, 10);
        for i in 0..300 {
            rec.gc_pauses.push(GcPause {
                pid: 1,
                tid: 2,
                start_ns: i * 20 * MS,
                dur_ns: 2 * MS,
                generation: 0,
                collected: 1,
            });
        }
        let found = run(&rec);
        let kinds: Vec<&str> = found.iter().map(|f| f.kind.as_str()).collect();
        assert_eq!(kinds, ["gil_contention", "gc_pressure"]);
    }

    #[test]
    fn fit_recovers_a_line_and_refuses_a_constant() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 2.0 + 0.5 * i as f64)).collect();
        let (slope, intercept, r) = fit(&pts).unwrap();
        assert!((slope - 0.5).abs() < 1e-12 && (intercept - 2.0).abs() < 1e-12);
        assert!((r - 1.0).abs() < 1e-12);
        assert!(fit(&[(1.0, 2.0), (1.0, 3.0)]).is_none());
    }

    /// The staircase's mixed intervals: a point at the mean of two levels whose median is one
    /// level's: the median of slopes stays on the line.
    #[test]
    fn fit_is_not_moved_by_intervals_that_straddle_a_step() {
        let line = |x: f64| 10.0 + 1.1 * x;
        let mut pts = Vec::new();
        for (a, b) in [(8.0, 40.0), (40.0, 16.0), (16.0, 64.0), (64.0, 24.0)] {
            for _ in 0..7 {
                pts.push((b, line(b)));
            }
            // The interval of the step: read (a + b) / 2, most calls at the old level.
            pts.push(((a + b) / 2.0, line(a)));
        }
        let (slope, intercept, r) = fit(&pts).unwrap();
        assert!((slope - 1.1).abs() < 1e-9, "{slope}");
        assert!((intercept - 10.0).abs() < 1e-9, "{intercept}");
        assert!(r > 0.8 && r < 1.0, "{r}");
        // Many points: subsampled, same line.
        let many: Vec<(f64, f64)> = (0..5000)
            .map(|i| ((i % 57) as f64, line((i % 57) as f64)))
            .collect();
        let (s, _, _) = fit(&many).unwrap();
        assert!((s - 1.1).abs() < 1e-9);
    }

    #[test]
    fn anchors_follow_githubs_rule() {
        assert_eq!(anchor("Who blocks whom"), "who-blocks-whom");
        assert_eq!(
            anchor("Top functions: VLLM::Worker (tid 7, pid 7)"),
            "top-functions-vllmworker-tid-7-pid-7"
        );
    }
}
