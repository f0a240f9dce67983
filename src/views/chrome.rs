//! Chrome Trace Event export (Perfetto, chrome://tracing): each thread's timeline of on-CPU
//! and off-CPU time.
//!
//! Per process a `pid`, per thread a `tid` with `process_name`/`thread_name` metadata. On-CPU
//! time becomes complete ("X") events in category `on-cpu`: consecutive samples of a thread
//! with the same stack and flags merge into one event named by the innermost Python frame,
//! with the whole stack in `args`. A sample at `t` with weight `w` covers `[t, t + w)`; a run
//! breaks at a gap longer than 1.5 sampling periods, at a stack change, or where the thread
//! went off CPU, and never extends past the next event of its thread (events on one track
//! must nest). A run right after a switch-in starts at the switch-in ([`span`]). Off-CPU intervals become "X" events in category `off-cpu`, named by the frame
//! the thread blocked in. Timestamps and durations are microseconds since the recording's start.
//!
//! GIL waits and GC pauses go on a second track per thread, `<name> GIL/GC` (tid +
//! [`GIL_GC_TRACK_OFFSET`]), placed right after the thread's own (`thread_sort_index`). They
//! cannot share the thread's track: a GIL wait is timed from the futex call, so it starts a few
//! µs before the switch-out and ends after the switch-in of the off-CPU interval inside it,
//! overlapping the on-CPU runs on both sides; a GC pause spans many runs and any preemption in
//! its middle. "X" events on one track must nest, and Perfetto drops those that only partly
//! overlap. On the GIL/GC track a GIL wait inside a GC pause (a finalizer that let the GIL go)
//! nests under it; an event that would stick out of the one it starts in is clipped to it
//! (`args.clipped_ns`), so the track always nests.

use std::collections::HashMap;

use anyhow::Context;
use serde_json::{json, Value};

use super::gil::{holder_name, HolderFrame, GIL_FREE, RELEASING};
use super::{format_utc, process_name, FrameLabels, Selection, SHAPE_FLAGS};
use crate::record::{flags, GcPause, GilWait, OffCpu, Recording, Sample};

/// Added to a thread's tid to make the tid of its GIL/GC track. Above any Linux tid
/// (`pid_max` <= 2^22), and the sum stays below 2^31.
pub(crate) const GIL_GC_TRACK_OFFSET: i64 = 1_000_000_000;

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// Event name: the innermost Python frame, else the innermost synthetic frame.
fn leaf_name(stack: &[&str], fallback: &str) -> String {
    stack
        .iter()
        .rev()
        .find(|f| !f.starts_with('['))
        .or_else(|| stack.last())
        .map_or_else(|| fallback.to_string(), |s| s.to_string())
}

fn mode(bits: u8) -> &'static str {
    if bits & flags::KERNEL != 0 {
        "kernel"
    } else if bits & flags::NATIVE != 0 {
        "native"
    } else {
        "python"
    }
}

/// One merged stretch of identical samples.
struct Run<'a> {
    first: &'a Sample,
    last: &'a Sample,
    samples: u64,
    gil: u64,
    weight_ns: u64,
}

/// Merge a thread's samples (time-sorted) into runs; `offs` are its off-CPU intervals sorted by
/// start.
fn runs<'a>(samples: &[&'a Sample], offs: &[&OffCpu]) -> Vec<Run<'a>> {
    let off_between = |a: u64, b: u64| {
        // Any off-CPU interval starting in (a, b]?
        let i = offs.partition_point(|o| o.start_ns <= a);
        offs.get(i).is_some_and(|o| o.start_ns <= b)
    };
    let mut out: Vec<Run<'a>> = Vec::new();
    for &s in samples {
        if let Some(r) = out.last_mut() {
            let p = r.last;
            let max_gap = u64::from(p.weight_ns) + u64::from(p.weight_ns) / 2;
            if p.stack == s.stack
                && (p.flags & SHAPE_FLAGS) == (s.flags & SHAPE_FLAGS)
                && s.t_ns.saturating_sub(p.t_ns) <= max_gap
                && !off_between(p.t_ns, s.t_ns)
            {
                r.last = s;
                r.samples += 1;
                r.gil += u64::from(s.flags & flags::GIL != 0);
                r.weight_ns += u64::from(s.weight_ns);
                continue;
            }
        }
        out.push(Run {
            first: s,
            last: s,
            samples: 1,
            gil: u64::from(s.flags & flags::GIL != 0),
            weight_ns: u64::from(s.weight_ns),
        });
    }
    out
}

/// Where a run sits on its thread's timeline. It starts at its first sample, or at the thread's
/// switch-in when that came less than one period before the first sample with no sample in
/// between (the thread was on CPU since then: a short burst sampled once shows its full
/// length). It ends one period after its last sample, but no later than the next run or the
/// next switch-out.
fn span(r: &Run, prev: Option<&Run>, next: Option<&Run>, offs: &[&OffCpu]) -> (u64, u64) {
    let first = r.first.t_ns;
    let period = u64::from(r.first.weight_ns);
    let mut start = first;
    // The last interval that started before the first sample.
    let k = offs.partition_point(|o| o.start_ns < first);
    if let Some(o) = k.checked_sub(1).and_then(|k| offs.get(k)) {
        let switch_in = o.start_ns.saturating_add(o.dur_ns);
        if switch_in <= first
            && first - switch_in < period
            && prev.is_none_or(|p| p.last.t_ns < o.start_ns)
        {
            start = switch_in;
        }
    }
    let mut end = r.last.t_ns.saturating_add(u64::from(r.last.weight_ns));
    if let Some(n) = next {
        end = end.min(n.first.t_ns);
    }
    if let Some(o) = offs.get(k) {
        end = end.min(o.start_ns.max(first));
    }
    (start, end.max(start))
}

/// Events are written one at a time as they are made: a trace has one event per run and per
/// off-CPU interval, and a tree of them all would cost many times the output's size.
struct Events {
    out: Vec<u8>,
    first: bool,
}

impl Events {
    fn push(&mut self, v: &Value) -> anyhow::Result<()> {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        serde_json::to_writer(&mut self.out, v).context("serializing the Chrome trace")
    }
}

/// An event of a thread's GIL/GC track.
enum Slice<'a> {
    Gc(&'a GcPause),
    Gil(&'a GilWait),
}

impl Slice<'_> {
    fn start(&self) -> u64 {
        match self {
            Slice::Gc(g) => g.start_ns,
            Slice::Gil(g) => g.start_ns,
        }
    }
    fn end(&self) -> u64 {
        match self {
            Slice::Gc(g) => g.start_ns.saturating_add(g.dur_ns),
            Slice::Gil(g) => g.start_ns.saturating_add(g.dur_ns),
        }
    }
}

/// Name of a GIL wait's event: `GIL wait (held by worker: Store.put)`, `GIL wait (<gil
/// free>)`, `GIL wait (<releasing>)` when the waiter held it itself, or `GIL switch wait` for
/// the handshake of a thread dropping the GIL.
pub(crate) fn gil_wait_name(rec: &Recording, g: &GilWait) -> String {
    if g.switch_wait {
        return "GIL switch wait".to_string();
    }
    if g.holder_tid == 0 {
        return format!("GIL wait ({GIL_FREE})");
    }
    if g.holder_tid == g.tid {
        return format!("GIL wait ({RELEASING})");
    }
    format!(
        "GIL wait (held by {}: {})",
        holder_name(rec, g),
        HolderFrame::of(rec, g).function()
    )
}

/// `GC gen 2`; `GC gen ?` when the generation is unknown.
pub(crate) fn gc_name(g: &GcPause) -> String {
    if g.generation >= 0 {
        format!("GC gen {}", g.generation)
    } else {
        "GC gen ?".to_string()
    }
}

/// Write a thread's GIL/GC track: GC pauses and GIL waits, properly nested.
fn gil_gc_track(
    ev: &mut Events,
    rec: &Recording,
    labels: &FrameLabels,
    (pid, tid): (i32, i32),
    mut slices: Vec<Slice>,
) -> anyhow::Result<()> {
    // Outer first: by start, then longest, then GC before a GIL wait of the same span.
    slices.sort_by(|a, b| {
        a.start()
            .cmp(&b.start())
            .then(b.end().cmp(&a.end()))
            .then(matches!(b, Slice::Gc(_)).cmp(&matches!(a, Slice::Gc(_))))
    });
    let track = i64::from(tid) + GIL_GC_TRACK_OFFSET;
    // Ends of the events that enclose the current one.
    let mut open: Vec<u64> = Vec::new();
    for sl in &slices {
        let start = sl.start();
        while open.last().is_some_and(|&end| end <= start) {
            open.pop();
        }
        let mut end = sl.end();
        let clipped = match open.last() {
            Some(&outer) if end > outer => {
                let c = end - outer;
                end = outer;
                c
            }
            _ => 0,
        };
        open.push(end);
        let mut v = match sl {
            Slice::Gc(g) => json!({
                "ph": "X", "cat": "gc", "name": gc_name(g),
                "args": {"generation": g.generation, "dur_ns": g.dur_ns},
            }),
            Slice::Gil(g) => json!({
                "ph": "X",
                "cat": if g.switch_wait { "gil-switch-wait" } else { "gil-wait" },
                "name": gil_wait_name(rec, g),
                "args": {
                    "holder_tid": g.holder_tid,
                    "holder_name": holder_name(rec, g),
                    "holder_stack": labels.stack(rec, g.holder_stack, 0),
                    "waiter_stack": labels.stack(rec, g.waiter_stack, 0),
                    "switch_wait": g.switch_wait,
                    "dur_ns": g.dur_ns,
                },
            }),
        };
        v["pid"] = pid.into();
        v["tid"] = track.into();
        v["ts"] = us(start).into();
        v["dur"] = us(end - start).into();
        if clipped > 0 {
            v["args"]["clipped_ns"] = clipped.into();
        }
        ev.push(&v)?;
    }
    Ok(())
}

/// The trace document, serialized.
pub fn render(rec: &Recording, sel: &Selection) -> anyhow::Result<Vec<u8>> {
    let labels = FrameLabels::new(rec);
    let mut samples: HashMap<(i32, i32), Vec<&Sample>> = HashMap::new();
    for s in sel.samples(rec) {
        samples.entry((s.pid, s.tid)).or_default().push(s);
    }
    let mut offcpu: HashMap<(i32, i32), Vec<&OffCpu>> = HashMap::new();
    for o in sel.offcpu(rec) {
        offcpu.entry((o.pid, o.tid)).or_default().push(o);
    }
    let mut slices: HashMap<(i32, i32), Vec<Slice>> = HashMap::new();
    for g in sel.gc_pauses(rec) {
        slices.entry((g.pid, g.tid)).or_default().push(Slice::Gc(g));
    }
    for g in sel.gil_waits(rec) {
        slices
            .entry((g.pid, g.tid))
            .or_default()
            .push(Slice::Gil(g));
    }
    let mut ev = Events {
        out: b"{\"traceEvents\":[".to_vec(),
        first: true,
    };
    for pid in sel.pids() {
        ev.push(&json!({
            "ph": "M", "name": "process_name", "pid": pid, "tid": 0,
            "args": {"name": process_name(rec, pid)},
        }))?;
    }
    for (i, (pid, tid)) in sel.threads().enumerate() {
        let name = rec.thread_name(pid, tid);
        let name = if name.is_empty() { "thread" } else { name };
        ev.push(&json!({
            "ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
            "args": {"name": name},
        }))?;
        ev.push(&json!({
            "ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
            "args": {"sort_index": 2 * i},
        }))?;
        if let Some(sl) = slices.remove(&(pid, tid)) {
            let track = i64::from(tid) + GIL_GC_TRACK_OFFSET;
            ev.push(&json!({
                "ph": "M", "name": "thread_name", "pid": pid, "tid": track,
                "args": {"name": format!("{name} GIL/GC")},
            }))?;
            ev.push(&json!({
                "ph": "M", "name": "thread_sort_index", "pid": pid, "tid": track,
                "args": {"sort_index": 2 * i + 1},
            }))?;
            gil_gc_track(&mut ev, rec, &labels, (pid, tid), sl)?;
        }
        let mut ss = samples.remove(&(pid, tid)).unwrap_or_default();
        ss.sort_by_key(|s| s.t_ns);
        let mut offs = offcpu.remove(&(pid, tid)).unwrap_or_default();
        offs.sort_by_key(|o| o.start_ns);
        let runs = runs(&ss, &offs);
        for (i, r) in runs.iter().enumerate() {
            let (start, end) = span(
                r,
                i.checked_sub(1).and_then(|p| runs.get(p)),
                runs.get(i + 1),
                &offs,
            );
            let bits = r.first.flags & SHAPE_FLAGS;
            let stack = labels.stack(rec, r.first.stack, bits);
            ev.push(&json!({
                "ph": "X", "cat": "on-cpu", "name": leaf_name(&stack, "[no Python frame]"),
                "pid": pid, "tid": tid, "ts": us(start), "dur": us(end - start),
                "args": {
                    "stack": stack,
                    "samples": r.samples,
                    "cpu_ns": r.weight_ns,
                    "gil_samples": r.gil,
                    "mode": mode(bits),
                    "gc": bits & flags::GC != 0,
                },
            }))?;
        }
        for o in offs {
            let stack = labels.stack(rec, o.stack, 0);
            ev.push(&json!({
                "ph": "X", "cat": "off-cpu", "name": leaf_name(&stack, "[off CPU]"),
                "pid": pid, "tid": tid, "ts": us(o.start_ns), "dur": us(o.dur_ns),
                "args": {"stack": stack, "preempted": o.preempted},
            }))?;
        }
    }
    let mut out = ev.out;
    out.extend_from_slice(b"],\"displayTimeUnit\":\"ms\",\"otherData\":");
    let other = json!({
        "exporter": format!("enginescope {}", env!("CARGO_PKG_VERSION")),
        "recorded_at": format_utc(rec.meta.start_unix_s),
        "backend": rec.meta.backend,
        "rate_hz": rec.meta.rate_hz.to_string(),
        "command": rec.meta.command,
        "hostname": rec.meta.hostname,
        "selection": sel.description(),
        "truncated": rec.truncated.to_string(),
    });
    serde_json::to_writer(&mut out, &other).context("serializing the Chrome trace")?;
    out.push(b'}');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t_ns: u64, stack: u32, flags: u8) -> Sample {
        Sample {
            t_ns,
            pid: 1,
            tid: 1,
            stack,
            flags,
            weight_ns: 10,
        }
    }

    #[test]
    fn runs_merge_and_break() {
        let v = [
            s(0, 1, flags::GIL),
            s(10, 1, 0),
            s(20, 1, flags::GIL),    // merges: 3 samples
            s(30, 2, 0),             // stack change
            s(40, 2, flags::NATIVE), // flag change
            s(50, 2, flags::NATIVE),
            s(80, 2, flags::NATIVE), // gap of 30 > 15
            s(90, 2, flags::NATIVE), // off-CPU at 85 in between
        ];
        let refs: Vec<&Sample> = v.iter().collect();
        let off = OffCpu {
            pid: 1,
            tid: 1,
            start_ns: 85,
            dur_ns: 3,
            stack: 0,
            preempted: false,
            stolen: false,
        };
        let r = runs(&refs, &[&off]);
        let shape: Vec<(u64, u64, u64)> =
            r.iter().map(|r| (r.first.t_ns, r.samples, r.gil)).collect();
        assert_eq!(
            shape,
            [(0, 3, 2), (30, 1, 0), (40, 2, 0), (80, 1, 0), (90, 1, 0)]
        );
    }

    fn off(start_ns: u64, dur_ns: u64) -> OffCpu {
        OffCpu {
            pid: 1,
            tid: 1,
            start_ns,
            dur_ns,
            stack: 0,
            preempted: false,
            stolen: false,
        }
    }

    #[test]
    fn spans_start_at_switch_in_and_end_at_switch_out() {
        // Off [0, 100), on: samples 103, 113 (stack 1), 118 (stack 2); off [121, 240);
        // sample 250 (ten after the switch-in: not less than a period, so no extension);
        // off [300, 400); sample 402.
        let v = [
            s(103, 1, 0),
            s(113, 1, 0),
            s(118, 2, 0),
            s(250, 1, 0),
            s(402, 1, 0),
        ];
        let o = [off(0, 100), off(121, 119), off(300, 100)];
        let refs: Vec<&Sample> = v.iter().collect();
        let offs: Vec<&OffCpu> = o.iter().collect();
        let r = runs(&refs, &offs);
        let spans: Vec<(u64, u64)> = (0..r.len())
            .map(|i| span(&r[i], i.checked_sub(1).map(|p| &r[p]), r.get(i + 1), &offs))
            .collect();
        assert_eq!(spans, [(100, 118), (118, 121), (250, 260), (400, 412)]);
    }

    #[test]
    fn leaf_names() {
        assert_eq!(leaf_name(&["a", "b", "[native]"], "x"), "b");
        assert_eq!(leaf_name(&["[native]"], "x"), "[native]");
        assert_eq!(leaf_name(&[], "x"), "x");
    }
}
