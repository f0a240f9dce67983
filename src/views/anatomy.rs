//! Step anatomy: where a vLLM engine's step goes, from exact probes on both sides of its
//! MessageQueue (`record --vllm`'s defaults).
//!
//! On the EngineCore's thread, each `EngineCore.step` (or `step_with_batch_queue`) is split
//! into its `MessageQueue.enqueue` calls (dispatching the step to the workers), its
//! `MessageQueue.dequeue` calls (waiting for their output) and the rest (scheduling and
//! output handling, which the defaults do not probe apart). On each worker's thread, each
//! `Worker.execute_model` is split into GIL wait (exact futex waits), GC (exact pauses, on
//! CPU), other time off CPU (blocked not on the GIL, and preempted) and the rest, running.
//!
//! Only calls watched whole count, with the thread's nested probes watched over them too
//! (under the probe budget a thread is watched in phases, and its probes may take turns for
//! its debug registers): a step whose `dequeue` went unwatched would read as all scheduling.
//! The figures are means per call over the calls that count, which the anatomy says.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::Selection;
use crate::record::Recording;

/// Fewest EngineCore steps (counted as above) an anatomy is given for.
pub(crate) const MIN_STEPS: u64 = 20;

/// One side's figures: mean ms per call of each part.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Side {
    pub pid: i32,
    pub tid: i32,
    /// The probed function (`EngineCore.step`, `Worker.execute_model`).
    pub function: String,
    /// Calls that count (watched whole, with the nested probes).
    pub calls: u64,
    /// Mean call, ms.
    pub mean_ms: f64,
    /// Mean ms per call of each part, in the order the anatomy lists them.
    pub parts: Vec<(String, f64)>,
}

impl Side {
    /// A part's share of the mean call, 0..1.
    pub fn share(&self, part: &str) -> f64 {
        self.parts
            .iter()
            .find(|(p, _)| p == part)
            .map_or(0.0, |(_, ms)| ms / self.mean_ms.max(1e-9))
    }
}

/// An engine's step: the EngineCore's side and each worker's.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub(crate) struct StepAnatomy {
    pub engine_core: Side,
    pub workers: Vec<Side>,
}

/// Parts of the EngineCore's step.
pub(crate) const DISPATCH: &str = "dispatch (enqueue)";
pub(crate) const WAIT_WORKERS: &str = "waiting for the workers (dequeue)";
pub(crate) const SCHEDULING: &str = "scheduling and output";
/// Parts of a worker's `execute_model`.
pub const RUNNING: &str = "running";
pub(crate) const GIL_WAIT: &str = "GIL wait";
pub const GC: &str = "GC";
pub(crate) const OFF_CPU: &str = "off CPU";

/// One thread's probed calls: (probe, start, end), sorted by start.
type Calls = Vec<(u32, u64, u64)>;

/// Sum of the overlaps of sorted, disjoint `intervals` with `[a, b)`.
pub(crate) fn overlap(intervals: &[(u64, u64)], a: u64, b: u64) -> u64 {
    let mut i = intervals.partition_point(|&(_, e)| e <= a);
    let mut sum = 0;
    while let Some(&(s, e)) = intervals.get(i) {
        if s >= b {
            break;
        }
        sum += e.min(b).saturating_sub(s.max(a));
        i += 1;
    }
    sum
}

/// Sorted `(start, end)` merged where they overlap.
pub(crate) fn merged(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Every engine's step anatomy in the selection: one per EngineCore thread with at least
/// [`MIN_STEPS`] steps that count, with the workers of its engine that have
/// `execute_model` calls.
pub(crate) fn step_anatomies(rec: &Recording, sel: &Selection) -> Vec<StepAnatomy> {
    let end = rec.duration_ns();
    let watched = super::latency::watch_intervals(rec, end);
    let probes_of = |names: &[&str]| -> BTreeSet<u32> {
        rec.probes
            .iter()
            .filter(|p| {
                p.method == "exact"
                    && names
                        .iter()
                        .any(|n| crate::vllm::probes::names(&p.function, n))
            })
            .map(|p| p.id)
            .collect()
    };
    let steps = probes_of(&["EngineCore.step", "EngineCore.step_with_batch_queue"]);
    let enqueue = probes_of(&["MessageQueue.enqueue"]);
    let dequeue = probes_of(&["MessageQueue.dequeue"]);
    let execute = probes_of(&["Worker.execute_model"]);
    if steps.is_empty() || execute.is_empty() {
        return Vec::new();
    }
    // Calls by thread: (probe, start, end), sorted by start.
    let mut calls: BTreeMap<(i32, i32), Calls> = BTreeMap::new();
    for c in sel.calls(rec) {
        calls.entry((c.pid, c.tid)).or_default().push((
            c.probe,
            c.start_ns,
            c.start_ns.saturating_add(c.dur_ns),
        ));
    }
    for v in calls.values_mut() {
        v.sort_unstable_by_key(|&(_, a, _)| a);
    }
    // Whether probe `p` was watched on `tid` over all of [a, b) (no watch edges: throughout).
    let whole = |p: u32, tid: i32, a: u64, b: u64| {
        watched
            .get(&(p, tid))
            .is_none_or(|v| v.iter().any(|&(x, y)| x <= a && b <= y))
    };
    let name_of = |p: u32| {
        rec.probes
            .iter()
            .find(|q| q.id == p)
            .map_or_else(String::new, |q| q.function.clone())
    };
    let mut out = Vec::new();
    for (&(pid, tid), v) in &calls {
        let Some(&(step_probe, _, _)) = v.iter().find(|(p, _, _)| steps.contains(p)) else {
            continue;
        };
        // The thread's MessageQueue probes: each must be watched over a step for it to count.
        let nested: BTreeSet<u32> = v
            .iter()
            .map(|&(p, _, _)| p)
            .filter(|p| enqueue.contains(p) || dequeue.contains(p))
            .collect();
        let (mut n, mut total, mut enq, mut deq) = (0u64, 0u64, 0u64, 0u64);
        for &(p, a, b) in v.iter().filter(|(p, _, _)| *p == step_probe) {
            if !whole(p, tid, a, b) || !nested.iter().all(|&q| whole(q, tid, a, b)) {
                continue;
            }
            n += 1;
            total += b - a;
            let from = v.partition_point(|&(_, s, _)| s < a);
            for &(q, s, e) in &v[from..] {
                if s >= b {
                    break;
                }
                if e <= b {
                    if enqueue.contains(&q) {
                        enq += e - s;
                    } else if dequeue.contains(&q) {
                        deq += e - s;
                    }
                }
            }
        }
        if n < MIN_STEPS || nested.is_empty() {
            continue;
        }
        let ms = |ns: u64| ns as f64 / n as f64 / 1e6;
        let engine_core = Side {
            pid,
            tid,
            function: name_of(step_probe),
            calls: n,
            mean_ms: ms(total),
            parts: vec![
                (DISPATCH.to_string(), ms(enq)),
                (WAIT_WORKERS.to_string(), ms(deq)),
                (SCHEDULING.to_string(), ms(total.saturating_sub(enq + deq))),
            ],
        };
        // The workers of its engine (or, without engine records, of any process).
        let workers_of: Option<BTreeSet<i32>> = rec
            .engines
            .iter()
            .find(|e| e.engine_core_pids.contains(&pid))
            .map(|e| e.worker_pids.iter().copied().collect());
        let mut workers = Vec::new();
        for (&(wpid, wtid), wv) in &calls {
            if workers_of.as_ref().is_some_and(|w| !w.contains(&wpid)) {
                continue;
            }
            if let Some(side) = worker_side(rec, sel, &execute, wpid, wtid, wv, &whole, &name_of) {
                workers.push(side);
            }
        }
        out.push(StepAnatomy {
            engine_core,
            workers,
        });
    }
    out
}

/// A worker thread's `execute_model` split into running, GIL wait, GC and other off-CPU.
#[allow(clippy::too_many_arguments)]
fn worker_side(
    rec: &Recording,
    sel: &Selection,
    execute: &BTreeSet<u32>,
    pid: i32,
    tid: i32,
    calls: &[(u32, u64, u64)],
    whole: &dyn Fn(u32, i32, u64, u64) -> bool,
    name_of: &dyn Fn(u32) -> String,
) -> Option<Side> {
    let probe = calls.iter().find(|(p, _, _)| execute.contains(p))?.0;
    let gil = merged(
        sel.gil_waits(rec)
            .filter(|g| g.pid == pid && g.tid == tid && !g.switch_wait)
            .map(|g| (g.start_ns, g.start_ns.saturating_add(g.dur_ns)))
            .collect(),
    );
    let gc = merged(
        rec.gc_pauses
            .iter()
            .filter(|g| g.pid == pid && g.tid == tid)
            .map(|g| (g.start_ns, g.start_ns.saturating_add(g.dur_ns)))
            .collect(),
    );
    let off = merged(
        sel.offcpu(rec)
            .filter(|o| o.pid == pid && o.tid == tid)
            .map(|o| (o.start_ns, o.start_ns.saturating_add(o.dur_ns)))
            .collect(),
    );
    let (mut n, mut total, mut in_gil, mut in_gc, mut in_off) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for &(p, a, b) in calls.iter().filter(|(p, _, _)| *p == probe) {
        if !whole(p, tid, a, b) {
            continue;
        }
        n += 1;
        total += b - a;
        let g = overlap(&gil, a, b);
        in_gil += g;
        in_gc += overlap(&gc, a, b);
        // A GIL wait blocks the thread: off CPU, counted once, as GIL wait.
        in_off += overlap(&off, a, b).saturating_sub(g);
    }
    if n == 0 {
        return None;
    }
    let ms = |ns: u64| ns as f64 / n as f64 / 1e6;
    Some(Side {
        pid,
        tid,
        function: name_of(probe),
        calls: n,
        mean_ms: ms(total),
        parts: vec![
            (
                RUNNING.to_string(),
                ms(total.saturating_sub(in_gil + in_gc + in_off)),
            ),
            (GIL_WAIT.to_string(), ms(in_gil)),
            (GC.to_string(), ms(in_gc)),
            (OFF_CPU.to_string(), ms(in_off)),
        ],
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::record::{EngineInfo, FunctionCall, GilWait, ProbeInfo};

    const MS: u64 = 1_000_000;

    /// An engine: EngineCore (pid 1) steps of 5 ms every 10 ms, each with a 0.5 ms enqueue
    /// and a 3 ms dequeue; a worker (pid 2) whose execute_model of 3 ms waits 1 ms for the
    /// GIL in each.
    pub(crate) fn engine(steps: u64) -> Recording {
        let mut rec = Recording {
            end: Some(crate::record::EndInfo {
                duration_ns: steps * 10 * MS,
                ..Default::default()
            }),
            ..Default::default()
        };
        for (id, pid, function) in [
            (0, 1, "EngineCore.step"),
            (1, 1, "MessageQueue.enqueue"),
            (2, 1, "MessageQueue.dequeue"),
            (3, 2, "mod.Worker.execute_model"),
        ] {
            rec.probes.push(ProbeInfo {
                id,
                pid,
                function: function.into(),
                method: "exact".into(),
                ..Default::default()
            });
        }
        for pid in [1, 2] {
            rec.threads.push(crate::record::ThreadInfo {
                pid,
                tid: pid,
                name: "MainThread".into(),
                t_ns: 0,
                python_name: None,
            });
        }
        rec.engines.push(EngineInfo {
            id: "engine0".into(),
            engine_core_pids: vec![1],
            worker_pids: vec![2],
            ..Default::default()
        });
        let call = |probe, pid, start_ns, dur_ns| FunctionCall {
            probe,
            pid,
            tid: pid,
            start_ns,
            dur_ns,
        };
        for i in 0..steps {
            let t = i * 10 * MS;
            rec.calls.push(call(0, 1, t, 5 * MS));
            rec.calls.push(call(1, 1, t + MS, MS / 2));
            rec.calls.push(call(2, 1, t + 2 * MS, 3 * MS));
            rec.calls.push(call(3, 2, t + 2 * MS, 3 * MS));
            rec.gil_waits.push(GilWait {
                pid: 2,
                tid: 2,
                start_ns: t + 2 * MS,
                dur_ns: MS,
                holder_tid: 3,
                holder_stack: 0,
                waiter_stack: 0,
                switch_wait: false,
            });
        }
        rec
    }

    #[test]
    fn steps_split_on_both_sides() {
        let rec = engine(30);
        let a = step_anatomies(&rec, &Selection::all(&rec));
        assert_eq!(a.len(), 1);
        let e = &a[0].engine_core;
        assert_eq!((e.pid, e.calls, e.mean_ms), (1, 30, 5.0));
        assert_eq!(
            e.parts,
            vec![
                (DISPATCH.to_string(), 0.5),
                (WAIT_WORKERS.to_string(), 3.0),
                (SCHEDULING.to_string(), 1.5)
            ]
        );
        assert!((e.share(WAIT_WORKERS) - 0.6).abs() < 1e-9);
        let w = &a[0].workers;
        assert_eq!(w.len(), 1);
        assert_eq!((w[0].pid, w[0].calls, w[0].mean_ms), (2, 30, 3.0));
        assert_eq!(w[0].parts[0], (RUNNING.to_string(), 2.0));
        assert_eq!(w[0].parts[1], (GIL_WAIT.to_string(), 1.0));
    }

    /// A step whose dequeue was not watched over it does not count; too few steps, no
    /// anatomy.
    #[test]
    fn only_steps_watched_with_their_nested_calls_count() {
        use crate::record::ProbeWatch;
        let mut rec = engine(30);
        // The dequeue probe watched over the first 20 steps only (the others' dequeues are
        // still in the calls: a recording cut by hand).
        for (t_ns, on) in [(0, true), (200 * MS - 1, false)] {
            rec.probe_watches.push(ProbeWatch {
                t_ns,
                probe: 2,
                tid: 1,
                on,
            });
        }
        let a = step_anatomies(&rec, &Selection::all(&rec));
        assert_eq!(a[0].engine_core.calls, 20);
        let rec = engine(MIN_STEPS - 1);
        assert!(step_anatomies(&rec, &Selection::all(&rec)).is_empty());
    }
}
