//! Folded stacks (`proc;thread;outer;...;inner count`), the input of flamegraph tools, and
//! the aggregation the flamegraph draws from.
//!
//! Every line starts with the process and thread (`python3.12 (pid 1);MainThread (tid 2)`), so
//! threads stay apart; then Python frames outermost first; then the synthetic frames for
//! sample flags (`[gc]`, `[native]`, `[kernel]`, and `[partial stack]` at the root of a stack
//! that could not be read completely).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use super::gil::{thread_name_or_tid, GIL_FREE, RELEASING, UNKNOWN_FUNCTION};
use super::{process_label, thread_label, FrameLabels, Selection, PREEMPTED_FRAME, SHAPE_FLAGS};
use crate::record::Recording;

/// What a folded line counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Number of on-CPU samples.
    Samples,
    /// On-CPU time: the sum of sample weights, ns.
    OnCpuNs,
    /// Off-CPU time: the sum of interval durations, ns (stack at switch-out; preempted
    /// intervals end in a `[preempted]` leaf).
    OffCpuNs,
}

/// Folded-format frame names cannot contain the separator or line breaks.
pub(super) fn clean(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains([';', '\n', '\r']) {
        s.replace(';', ",").replace(['\n', '\r'], " ").into()
    } else {
        s.into()
    }
}

/// Folded stacks with their totals, sorted by stack text (deterministic output).
pub fn stacks(rec: &Recording, sel: &Selection, measure: Measure) -> BTreeMap<String, u64> {
    // Aggregate on ids first: building strings once per distinct stack, not per sample.
    let mut by_id: HashMap<(i32, i32, u32, u8), u64> = HashMap::new();
    match measure {
        Measure::Samples | Measure::OnCpuNs => {
            for s in sel.samples(rec) {
                let v = if measure == Measure::Samples {
                    1
                } else {
                    u64::from(s.weight_ns)
                };
                *by_id
                    .entry((s.pid, s.tid, s.stack, s.flags & SHAPE_FLAGS))
                    .or_default() += v;
            }
        }
        Measure::OffCpuNs => {
            for o in sel.offcpu(rec) {
                *by_id
                    .entry((o.pid, o.tid, o.stack, u8::from(o.preempted)))
                    .or_default() += o.dur_ns;
            }
        }
    }
    let labels = FrameLabels::new(rec);
    let mut roots: HashMap<(i32, i32), String> = HashMap::new();
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for ((pid, tid, stack, bits), v) in by_id {
        let root = roots.entry((pid, tid)).or_insert_with(|| {
            format!(
                "{};{}",
                clean(&process_label(rec, pid)),
                clean(&thread_label(rec, pid, tid))
            )
        });
        let mut line = root.clone();
        let (shape, preempted) = match measure {
            Measure::OffCpuNs => (0, bits != 0),
            _ => (bits, false),
        };
        for f in labels.stack(rec, stack, shape) {
            line.push(';');
            line.push_str(&clean(f));
        }
        if preempted {
            line.push(';');
            line.push_str(PREEMPTED_FRAME);
        }
        *out.entry(line).or_default() += v;
    }
    out
}

/// The frame standing for a GIL holder in the GIL-blame graph: `held by worker (tid 12)`, or
/// [`GIL_FREE`] when no thread held it when the wait began.
pub(crate) fn holder_label(rec: &Recording, pid: i32, holder_tid: i32) -> String {
    if holder_tid == 0 {
        GIL_FREE.to_string()
    } else {
        format!(
            "held by {} (tid {holder_tid})",
            thread_name_or_tid(rec, pid, holder_tid)
        )
    }
}

/// GIL blame: for each GIL wait of a selected thread (not switch waits), the line
/// `proc;waiter;held by holder;holder's stack outermost first`, weighted by the wait in ns.
/// A known holder with no Python frame ends in [`UNKNOWN_FUNCTION`]; a wait whose holder was
/// the waiter itself (releasing the GIL) is the single frame [`RELEASING`].
pub fn gil_blame_stacks(rec: &Recording, sel: &Selection) -> BTreeMap<String, u64> {
    let mut by_id: HashMap<(i32, i32, i32, u32), u64> = HashMap::new();
    for g in sel.gil_waits(rec).filter(|g| !g.switch_wait) {
        let (holder, stack) = match g.holder_tid {
            0 => (0, 0),
            h if h == g.tid => (-1, 0),
            h => (h, g.holder_stack),
        };
        *by_id.entry((g.pid, g.tid, holder, stack)).or_default() += g.dur_ns;
    }
    let labels = FrameLabels::new(rec);
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for ((pid, tid, holder, stack), v) in by_id {
        let mut line = format!(
            "{};{};{}",
            clean(&process_label(rec, pid)),
            clean(&thread_label(rec, pid, tid)),
            if holder == -1 {
                RELEASING.to_string()
            } else {
                clean(&holder_label(rec, pid, holder)).into_owned()
            }
        );
        let frames = labels.stack(rec, stack, 0);
        if frames.is_empty() && holder > 0 {
            line.push(';');
            line.push_str(UNKNOWN_FUNCTION);
        }
        for f in frames {
            line.push(';');
            line.push_str(&clean(f));
        }
        *out.entry(line).or_default() += v;
    }
    out
}

/// The folded export: one `stack count` line per distinct stack, count = samples.
pub fn render(rec: &Recording, sel: &Selection) -> String {
    let mut s = String::new();
    for (stack, n) in stacks(rec, sel, Measure::Samples) {
        let _ = writeln!(s, "{stack} {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_are_replaced() {
        assert_eq!(clean("a;b\nc"), "a,b c");
        assert!(matches!(clean("plain"), std::borrow::Cow::Borrowed(_)));
    }
}
