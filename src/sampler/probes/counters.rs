//! The probes' counters: what they timed, dropped, set and cost, written to the recording.

use super::{Probes, Watch};

/// What the probes did over a recording: the `probe_*` counters ([`counters`]).
#[derive(Debug, Default, Clone)]
pub struct Counters {
    /// Traps taken inside timed calls (counter `probe_nested_traps`: with
    /// `probe_trap_cost_ns`, how much of the probed calls' time the probes themselves added).
    pub nested_traps: u64,
    /// On-phases that began late because other threads' on-phases held their turn
    /// (counter `probe_phase_late_starts`).
    pub late_starts: u64,
    /// Calls timed and written.
    pub calls: u64,
    /// Exact entries closed without a return (left by an exception, or attached mid-call).
    pub unfinished: u64,
    /// Pops with no push (the call began before the probe attached).
    pub unmatched_returns: u64,
    /// Calls whose end wrote nothing (a frame object outlived the call and took its reference
    /// to the code object): seen ended when their caller frame called again or when a call
    /// open above them on the same thread ended (counter `probe_ends_unseen`). Not timed.
    pub ends_unseen: u64,
    /// Decrements of a watched count made with no open call's caller frame current: a
    /// reference dropped by something else (a frame object freed after its call, often by
    /// the GC), not a call's end (counter `probe_foreign_releases`).
    pub foreign_releases: u64,
    /// Writes to a watched reference count whose direction had to be guessed (another thread
    /// wrote it between two of this thread's writes).
    pub ambiguous_edges: u64,
    /// Threads a probe could not be set on (no free debug register).
    pub attach_failures: u64,
    /// Threads a probe was set on after its first.
    pub thread_attaches: u64,
    /// Exact probes switched to sampling for their call rate.
    pub demoted: u64,
    /// Register assignments changed by rotation (one probe out, one in).
    pub rotations: u64,
    /// Calls open on a thread when its watch was removed (rotation): not counted.
    pub rotation_dropped: u64,
    /// Watchpoints that could not be set when their turn came (counted, retried next turn).
    pub rotation_attach_failures: u64,
    /// A thread refused registers asking for one more ([`super::REGAIN_NS`]), and the
    /// settings refused for want of a register after a thread's first.
    pub register_asks: u64,
    pub registers_refused: u64,
    pub gc_attach_failures: u64,
    /// Threads whose on-phases `--probe-budget` re-sized.
    pub budget_resizes: u64,
    /// Watchpoints set, and the recording loop's wait for them.
    pub switches: u64,
    pub switch_ns: u64,
    /// The longest of them, and how many took over [`SLOW_SWITCH_NS`].
    pub switch_max_ns: u64,
    pub switches_slow: u64,
    /// Watches set on every CPU instead of on their thread (counter
    /// `probe_watches_every_cpu`).
    pub watches_every_cpu: u64,
    /// Watchpoints removed, and the loop's time handing them to the helper thread.
    pub removals: u64,
    pub removal_ns: u64,
    /// Watchpoint writes outside any watched interval (before its start was stamped, or
    /// drained after its watch was removed): not timed.
    pub late_hits: u64,
    /// Context switches of threads while they held probe watchpoints, and what they cost
    /// them at the calibrated switch cost ([`crate::bpf::SwitchCost`]).
    pub watched_switches: u64,
    pub watched_switch_ns: u64,
    /// Calls that began before the window (timed in the warm-up): not written.
    pub calls_before_window: u64,
}

/// The probe counters, when probes were asked for (`None`: a source that cannot set them, all
/// zero).
pub fn counters<H: Watch>(
    p: Option<&Probes<H>>,
    out: &mut std::collections::BTreeMap<String, u64>,
) {
    let v = |f: fn(&Probes<H>) -> u64| p.map_or(0, f);
    out.insert("probe_trap_cost_ns".into(), v(|p| p.trap_ns));
    out.insert("probe_trap_cost_in_use_ns".into(), v(|p| p.budget_trap_ns));
    out.insert("probe_nested_traps".into(), v(|p| p.n.nested_traps));
    out.insert("probe_phase_late_starts".into(), v(|p| p.n.late_starts));
    out.insert("probe_calls".into(), v(|p| p.n.calls));
    out.insert("probe_calls_unfinished".into(), v(|p| p.n.unfinished));
    out.insert(
        "probe_unmatched_returns".into(),
        v(|p| p.n.unmatched_returns),
    );
    out.insert("probe_ambiguous_edges".into(), v(|p| p.n.ambiguous_edges));
    out.insert("probe_ends_unseen".into(), v(|p| p.n.ends_unseen));
    out.insert("probe_foreign_releases".into(), v(|p| p.n.foreign_releases));
    out.insert("probe_attach_failures".into(), v(|p| p.n.attach_failures));
    out.insert("probe_thread_attaches".into(), v(|p| p.n.thread_attaches));
    out.insert("probes_switched_to_sampling".into(), v(|p| p.n.demoted));
    out.insert("probe_register_rotations".into(), v(|p| p.n.rotations));
    out.insert("probe_budget_resizes".into(), v(|p| p.n.budget_resizes));
    out.insert(
        "probe_switch_cost_1reg_ns".into(),
        v(|p| p.switch_cost.one_ns),
    );
    out.insert(
        "probe_switch_cost_4reg_ns".into(),
        v(|p| p.switch_cost.four_ns),
    );
    out.insert("probe_watch_switches".into(), v(|p| p.n.switches));
    out.insert("probe_watch_switch_ns".into(), v(|p| p.n.switch_ns));
    out.insert("probe_watch_switch_max_ns".into(), v(|p| p.n.switch_max_ns));
    out.insert("probe_watch_switches_slow".into(), v(|p| p.n.switches_slow));
    out.insert("probe_watch_removals".into(), v(|p| p.n.removals));
    out.insert(
        "probe_watches_every_cpu".into(),
        v(|p| p.n.watches_every_cpu),
    );
    out.insert("probe_watch_removal_ns".into(), v(|p| p.n.removal_ns));
    out.insert("probe_hits_outside_watch".into(), v(|p| p.n.late_hits));
    out.insert("probe_watched_switches".into(), v(|p| p.n.watched_switches));
    out.insert(
        "probe_watched_switch_ns".into(),
        v(|p| p.n.watched_switch_ns),
    );
    out.insert(
        "probe_calls_before_window".into(),
        v(|p| p.n.calls_before_window),
    );
    out.insert(
        "probe_calls_dropped_at_rotation".into(),
        v(|p| p.n.rotation_dropped),
    );
    out.insert(
        "probe_rotation_attach_failures".into(),
        v(|p| p.n.rotation_attach_failures),
    );
    out.insert("probe_register_asks".into(), v(|p| p.n.register_asks));
    out.insert(
        "probe_registers_refused".into(),
        v(|p| p.n.registers_refused),
    );
}
