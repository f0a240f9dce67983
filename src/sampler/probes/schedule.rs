//! When each exact probe is watched: the debug registers' rotation among more probes than a
//! thread has registers, and `--probe-budget`'s on- and off-phases (sized from the traps and
//! context switches a thread's probes cost it, taken in turns among threads). The state is
//! per thread ([`ThreadRegs`]); [`phase_steps`] is the budget's schedule as a pure function;
//! [`super::Probes`] carries the steps out through [`super::Watchpoints`].

use crate::sys::Schedstat;

/// How long one assignment of a thread's debug registers lasts when more exact probes want
/// one on that thread than it has: then the registers rotate among them (one probe out, the
/// next in, every period), each probe watched for `registers / probes` of the time, in runs
/// of `registers` periods (1.5-2 s), so calls of up to ~100 ms are mostly seen whole (a call
/// is lost when a switch falls inside it). Measured on mq_pipeline (five probes on one
/// thread, 2-core machine at load 10-20): with 500 ms, estimated counts within 1.5% of the
/// truth on 3.11-3.15 and p50/p90 within 10% but for one p90 of six at -10.1%; with 200 ms,
/// counts off by up to 15% and a p90 by -40% (each switch perturbs the thread; a call slowed
/// by it is never timed by the probe coming in or going out).
/// `ENGINESCOPE_PROBE_ROTATE_MS` overrides it (measurements).
pub const ROTATE_NS: u64 = 500_000_000;

pub(super) fn rotate_ns() -> u64 {
    ns_from_env_ms("ENGINESCOPE_PROBE_ROTATE_MS", ROTATE_NS)
}

/// A length in ms from the environment variable `var` (measurements), as ns; `default` when
/// it is unset, not a number or 0.
fn ns_from_env_ms(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .map_or(default, |ms| ms * 1_000_000)
}

/// The exact probes that want a debug register on one thread, and which of them have one.
#[derive(Debug)]
pub(super) struct ThreadRegs {
    /// Probe indexes, in the order they came.
    pub(super) want: Vec<usize>,
    /// Registers the probes may use here: 4, less the GC watchpoint's, lowered to what the
    /// thread holds when the kernel refuses one (another tool holds the rest).
    pub(super) cap: usize,
    /// Rotation position: the next assignment starts at `want[next]`.
    pub(super) next: usize,
    /// When the assignment last changed, absolute ns.
    pub(super) last_ns: u64,
    /// `--probe-budget`: the share of the time the thread's probes are watched at all
    /// (1.0 = all the time). Below 1, they are watched in on-phases of [`BUDGET_ON_NS`]
    /// separated by off-phases, [`Self::width`] of them in each on-phase (the next ones of
    /// the rotation).
    pub(super) phase: f64,
    /// Under a budget, how many of the thread's probes one on-phase watches
    /// ([`phase_and_width`]); 0 for as many as it has registers.
    pub(super) width: usize,
    /// In an off-phase: when it ends (absolute ns).
    pub(super) off_until: Option<u64>,
    /// When the current on-phase began (absolute ns).
    pub(super) on_since: u64,
    /// How long the current on-phase lasts (drawn at its start, [`on_phase_len`]).
    pub(super) on_len: u64,
    /// How late the current on-phase began after its off-phase ended (another thread's
    /// on-phase held it back, [`phase_steps`]): taken off the next off-phase.
    pub(super) late: u64,
    /// Start of the thread's current budget window (absolute ns) and its trap count then.
    pub(super) budget_mark: (u64, u64),
    /// Whether a budget window has been measured on the thread yet.
    pub(super) measured: bool,
    /// The thread's scheduler counters at the budget window's start (None when unreadable).
    pub(super) sched: Option<Schedstat>,
    /// What the budget is sized from, by the events' own times (not when they were
    /// drained, which lags when the recording loop does): the traps the thread took at or
    /// after the window's start, and its probes' watched time (probe·ns) since then: the
    /// watched time summed up to `on_mark`, plus `on_count` probes watched since it.
    pub(super) window: BudgetWindow,
    /// Watchpoints the thread holds now (its probes watched, not the GC's).
    pub(super) held: usize,
    /// The thread's context switches when `held` last changed (None when unreadable): each
    /// switch while it holds watchpoints costs it a reload of its debug registers.
    pub(super) held_mark: Option<u64>,
    /// When a thread whose `cap` was lowered next asks for one more register (absolute ns).
    pub(super) regain_at: u64,
}

/// The context switches from `from` to `to` of a thread holding `held` watchpoints all that
/// time, and what they cost it at `cost` (nothing without a reading at both ends, or with no
/// watchpoint held).
pub(super) fn watched_switches(
    from: Option<u64>,
    to: Option<u64>,
    held: usize,
    cost: crate::bpf::SwitchCost,
) -> (u64, u64) {
    match (from, to) {
        (Some(a), Some(b)) if held > 0 => {
            let n = b.saturating_sub(a);
            (n, n.saturating_mul(cost.with_regs(held)))
        }
        _ => (0, 0),
    }
}

/// What watching a thread's probes all the time would cost it, as a share of its wall time:
/// `trap_share` (its traps' time over the wall time, scaled to every probe watched) plus its
/// context switches from `from` to `to` times what each costs holding `regs` watchpoints.
/// Without scheduler counters, the trap share alone.
pub fn full_cost(
    trap_share: f64,
    from: Option<Schedstat>,
    to: Option<Schedstat>,
    switch: crate::bpf::SwitchCost,
    regs: usize,
) -> f64 {
    let (Some(a), Some(b)) = (from, to) else {
        return trap_share;
    };
    let wall = b.t_ns.saturating_sub(a.t_ns);
    if wall == 0 {
        return trap_share;
    }
    let switches = b.switches.saturating_sub(a.switches) as f64;
    trap_share + switches * switch.with_regs(regs) as f64 / wall as f64
}

/// One thread's budget window, measured by event time.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct BudgetWindow {
    pub(super) traps: u64,
    pub(super) on_acc: u64,
    pub(super) on_count: u64,
    pub(super) on_mark: u64,
}

impl BudgetWindow {
    /// The thread's watched probe count changes by `delta` at `t`.
    pub(super) fn watch(&mut self, t: u64, delta: i64) {
        let t = t.max(self.on_mark);
        self.on_acc += self.on_count * (t - self.on_mark);
        self.on_mark = t;
        self.on_count = self.on_count.saturating_add_signed(delta);
    }

    /// Watched probe·ns from the window's start to `t`.
    pub(super) fn watched(&self, t: u64) -> u64 {
        self.on_acc + self.on_count * t.saturating_sub(self.on_mark)
    }

    /// A new window from `t` on (the probes watched then stay counted).
    pub(super) fn restart(&mut self, t: u64) {
        self.traps = 0;
        self.on_acc = 0;
        self.on_mark = self.on_mark.max(t);
    }
}

impl ThreadRegs {
    /// How many of the thread's probes one assignment watches: all of them, or as many as
    /// it has registers; under a budget, [`Self::width`] of them.
    pub(super) fn per_turn(&self) -> usize {
        let all = self.cap.min(self.want.len());
        if self.phase < 1.0 && self.width > 0 {
            self.width.min(all)
        } else {
            all
        }
    }

    /// Whether successive assignments differ (fewer probes in one than the thread has).
    pub(super) fn takes_turns(&self) -> bool {
        self.per_turn() < self.want.len() && self.per_turn() > 0
    }

    /// The share of the time each probe is watched: the on-phases' share, times the share
    /// of the thread's probes one assignment holds.
    pub(super) fn duty(&self) -> f64 {
        let n = self.want.len();
        if n == 0 {
            return self.phase;
        }
        self.phase * self.per_turn() as f64 / n as f64
    }

    /// The assignment of the next turn: [`Self::per_turn`] probes from `next` on, round-robin.
    pub(super) fn advance(&mut self, now_abs: u64) -> Vec<usize> {
        let n = self.want.len();
        if n == 0 {
            return Vec::new();
        }
        if self.takes_turns() {
            self.next = (self.next + 1) % n;
        }
        self.last_ns = now_abs;
        (0..self.per_turn())
            .map(|k| self.want[(self.next + k) % n])
            .collect()
    }
}

/// How a thread's `probes` (with `regs` registers for them) are each watched `duty` of the
/// time under a budget: the on-phases' share and how many probes one on-phase watches.
/// As few at once as the duty allows, one where it is low: every watched call's two debug
/// traps lengthen the step it lies in, so an on-phase that watched all of a thread's probes
/// together (an engine step crosses six to ten of their traps) ran the engine 6-9% slower
/// than the unwatched time on a VM, and every count scaled from the watched time came out as
/// much low (docs/probes.md). Watched one at a time, each probe keeps its share and its cost
/// (a probe's cost is its own traps, whoever else is on), and a watched step carries the
/// traps of one probe. `(1.0, 0)`: all of them (or all the registers allow) all the time.
pub(super) fn phase_and_width(duty: f64, probes: usize, regs: usize) -> (f64, usize) {
    let all = regs.min(probes);
    if duty >= 1.0 || all == 0 {
        return (1.0, 0);
    }
    // Probes watched at once on average; one more than its whole part at a time, so that
    // the on-phases keep an off-phase (a thread on all the time is not budgeted).
    let need = duty * probes as f64;
    let width = ((need + 1e-6).floor() as usize + 1).min(all);
    let phase = need / width as f64;
    if phase >= 1.0 - 1e-9 {
        // As much as the registers give all the time (a rotation of `all` at a time).
        return (1.0, 0);
    }
    (phase, width)
}

/// The shortest window over which a thread's trap time is measured for `--probe-budget`.
pub(super) const BUDGET_WINDOW_NS: u64 = 2_000_000_000;
/// The first window, watched all the time, is shorter: it costs the full price (hundreds of
/// calls at the rates that make a budget matter).
pub(super) const BUDGET_FIRST_WINDOW_NS: u64 = 500_000_000;
/// Length of one on-phase under `--probe-budget` (on average; each is drawn between half and
/// one and a half times it): short, so that a window holds many of them. A count scaled from a
/// few phases follows the engine's own swings: at 250 ms a 28 s window of a loaded vllm serve
/// held 6-7 phases per thread and the estimated counts were 5-18% off, at 50 ms 23-25 phases
/// and every count within 1.4% of the in-process timers (docs/probes.md). A call is timed only
/// when it lies inside one phase, so calls of more than a few tens of ms are timed less often
/// (and weighted for it, `views::latency`). Sizing the phases from the thread's longest recent
/// call was tried: a probed call that waits (the EngineCore's `dequeue` while the engine is
/// idle) made them seconds long, and the off-phases after them (their real length × 19 at a
/// 5% share) left one thread unwatched for a whole 28 s window.
pub const BUDGET_ON_NS: u64 = 50_000_000;

/// [`BUDGET_ON_NS`], or `ENGINESCOPE_PROBE_PHASE_MS` (measurements).
pub(super) fn budget_on_ns() -> u64 {
    static ON: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ON.get_or_init(|| ns_from_env_ms("ENGINESCOPE_PROBE_PHASE_MS", BUDGET_ON_NS))
}
/// `ENGINESCOPE_PROBE_SHARE` (a share from 0.01 to 1, measurements): every budgeted thread
/// watched that share of the time, whatever its probes cost (the budget's sizing is skipped).
/// For checking the estimates at a chosen coverage (`tests/live_probes.rs`), not for use.
pub(super) fn forced_share() -> Option<f64> {
    static SHARE: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    *SHARE.get_or_init(|| {
        std::env::var("ENGINESCOPE_PROBE_SHARE")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| (0.01..=1.0).contains(s))
    })
}

/// The least share of the time the probes are watched under `--probe-budget` (a probe
/// watched less would time too few calls to say anything).
pub const BUDGET_MIN_PHASE: f64 = 0.05;

/// The off-phase that follows an on-phase of `on_ns` for an on share of `phase`.
pub(super) fn off_phase_ns(on_ns: u64, phase: f64) -> u64 {
    let phase = phase.clamp(BUDGET_MIN_PHASE, 1.0);
    (on_ns as f64 * (1.0 / phase - 1.0)).round() as u64
}

/// When the off-phase of an on-phase that began at `on_since` and ends at `now` ends, for an
/// on share of `phase`: sized from the on-phase as it really lasted, not as planned, so that
/// a recording loop that gets to the phase's end late (a busy machine, normal priority) still
/// keeps the probes within their share over every on/off cycle.
pub(super) fn off_phase_end(on_since: u64, now: u64, phase: f64) -> u64 {
    now.saturating_add(off_phase_ns(now.saturating_sub(on_since), phase))
}

/// A thread's on-phase lasts between half and one and a half times `on_ns`, drawn from
/// `draw` (uniform 64 bits): phases of one length would fall in step with an engine loop of
/// a commensurate period and watch the same part of it every time.
pub(super) fn on_phase_len(on_ns: u64, draw: u64) -> u64 {
    let u = (draw >> 11) as f64 / (1u64 << 53) as f64;
    (on_ns as f64 * (0.5 + u)).round() as u64
}

/// A thread's place in the `--probe-budget` schedule, as [`phase_steps`] reads it.
#[derive(Debug, Clone, Copy)]
pub(super) struct PhaseState {
    pub(super) tid: i32,
    pub(super) phase: f64,
    pub(super) off_until: Option<u64>,
    pub(super) on_since: u64,
    pub(super) on_len: u64,
    pub(super) late: u64,
}

/// What the schedule does to one thread now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum PhaseStep {
    /// End its on-phase; the off-phase lasts until then.
    End { off_until: u64 },
    /// Begin an on-phase, `late` ns after its off-phase ended.
    Start { late: u64 },
}

/// The `--probe-budget` schedule at `now` (pure: the kernel side is [`super::Probes`]'s `phases`).
/// An on-phase that has lasted its length ends, followed by an off-phase sized from how long
/// it really lasted (a late loop keeps the share) less how late it began. Budgeted threads
/// take turns: no more of them are on at once than the sum of their shares rounded up (one,
/// on an engine whose threads are watched a few percent each), the longest-waiting first. An
/// engine's step runs through several watched threads in turn (the EngineCore waits for its
/// worker), and every watched call's two debug traps lengthen it: with each thread on in its
/// own time, a watched call carries the traps of its own thread's probes only, not those of
/// every thread the step crosses. A thread watched all the time takes no turn.
pub(super) fn phase_steps(ts: &[PhaseState], now: u64) -> Vec<(i32, PhaseStep)> {
    let budgeted = |t: &&PhaseState| t.phase < 1.0;
    let mut out = Vec::new();
    let mut on = 0usize;
    for t in ts.iter().filter(budgeted) {
        match t.off_until {
            None if now.saturating_sub(t.on_since) >= t.on_len => {
                let end = off_phase_end(t.on_since, now, t.phase);
                let off_until = end.saturating_sub(t.late).max(now);
                out.push((t.tid, PhaseStep::End { off_until }));
            }
            None => on += 1,
            Some(_) => {}
        }
    }
    let total: f64 = ts.iter().filter(budgeted).map(|t| t.phase).sum();
    let limit = ((total - 1e-9).ceil() as usize).max(1);
    let mut due: Vec<(u64, i32, bool)> = ts
        .iter()
        .filter_map(|t| {
            let at = t.off_until.filter(|&at| now >= at)?;
            Some((at, t.tid, t.phase < 1.0))
        })
        .collect();
    due.sort_unstable();
    for (at, tid, takes_turn) in due {
        if takes_turn {
            if on >= limit {
                continue;
            }
            on += 1;
        }
        let late = if takes_turn { now - at } else { 0 };
        out.push((tid, PhaseStep::Start { late }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::next_random;

    const MS: u64 = 1_000_000;

    /// `--probe-budget`'s phases: each probe on a thread is watched `phase`, times `cap /
    /// probes` where they outnumber the registers, of the time.
    #[test]
    fn budget_phases_give_each_probe_its_share() {
        let regs = |want: usize, cap: usize, phase: f64| ThreadRegs {
            want: (0..want).collect(),
            cap,
            next: 0,
            last_ns: 0,
            phase,
            off_until: None,
            on_since: 0,
            on_len: BUDGET_ON_NS,
            late: 0,
            width: 0,
            budget_mark: (0, 0),
            measured: false,
            sched: None,
            window: BudgetWindow::default(),
            held: 0,
            held_mark: None,
            regain_at: 0,
        };
        assert_eq!(regs(3, 4, 1.0).duty(), 1.0);
        assert!((regs(3, 4, 0.2).duty() - 0.2).abs() < 1e-9);
        assert!((regs(5, 4, 1.0).duty() - 0.8).abs() < 1e-9);
        assert!((regs(5, 4, 0.5).duty() - 0.4).abs() < 1e-9);
        // On 250 ms, off 750 ms: a quarter of the time.
        assert_eq!(off_phase_ns(250 * MS, 0.25), 750_000_000);
        assert_eq!(off_phase_ns(250 * MS, 1.0), 0);
        // Never below the floor: 5% is on 250 ms, off 4.75 s.
        assert_eq!(off_phase_ns(250 * MS, 0.0), 4_750_000_000);
        // Each on-phase takes the next assignment: five probes on four registers, every
        // probe out once in five turns; three on four, all of them every turn.
        let mut r = regs(5, 4, 0.5);
        let mut seen = [0; 5];
        for t in 0..5 {
            for j in r.advance(t) {
                seen[j] += 1;
            }
        }
        assert_eq!(seen, [4; 5]);
        let mut r = regs(3, 4, 0.5);
        assert_eq!(r.advance(0), vec![0, 1, 2]);
        assert_eq!(r.advance(1), vec![0, 1, 2]);
        // One at a time under a budget: each probe every third on-phase.
        let mut r = regs(3, 4, 0.3);
        r.width = 1;
        assert!((r.duty() - 0.1).abs() < 1e-9);
        let turns: Vec<Vec<usize>> = (0..6).map(|t| r.advance(t)).collect();
        assert_eq!(turns, [[1], [2], [0], [1], [2], [0]]);
        // Not budgeted: the width does not apply.
        r.phase = 1.0;
        assert_eq!(r.advance(7), vec![0, 1, 2]);
    }

    /// Each probe gets its duty, with as few of them watched at once as that allows.
    #[test]
    fn budgeted_probes_are_watched_as_few_at_once_as_their_duty_allows() {
        let close = |(p, w): (f64, usize), (p2, w2): (f64, usize)| (p - p2).abs() < 1e-9 && w == w2;
        // Three probes at 5% each: one at a time, on 15% of the time.
        assert!(close(phase_and_width(0.05, 3, 4), (0.15, 1)));
        // At 20%: 60% of the time, one at a time; at 50%: two at a time, 75%.
        assert!(close(phase_and_width(0.2, 3, 4), (0.6, 1)));
        assert!(close(phase_and_width(0.5, 3, 4), (0.75, 2)));
        // At 1/3: two at a time half the time (a thread on all the time takes no turns).
        assert!(close(phase_and_width(1.0 / 3.0, 3, 4), (0.5, 2)));
        // Three probes on three registers at 99%: all at once, 99% of the time.
        assert!(close(phase_and_width(0.99, 3, 3), (0.99, 3)));
        assert_eq!(phase_and_width(1.0, 3, 4), (1.0, 0));
        // One probe: the duty is the phase.
        assert!(close(phase_and_width(0.1, 1, 4), (0.1, 1)));
        // Five probes on four registers at 90% each: more than the rotation gives.
        assert_eq!(phase_and_width(0.9, 5, 4), (1.0, 0));
        for (duty, n, regs) in [
            (0.05, 3, 4),
            (1.0 / 3.0, 3, 4),
            (0.37, 3, 4),
            (0.5, 5, 4),
            (0.7, 2, 3),
        ] {
            let (phase, width) = phase_and_width(duty, n, regs);
            let got = phase * width as f64 / n as f64;
            assert!((got - duty).abs() < 1e-9, "{duty} {n} {regs}: {got}");
        }
    }

    /// Runs [`phase_steps`] every `tick` ns for `until` ns over threads of the given
    /// shares, all starting on together: each thread's watched share, and the most on at
    /// once after the first 2 s.
    fn simulate_phases(phases: &[f64], until: u64, tick: u64) -> (Vec<f64>, usize) {
        let mut ts: Vec<PhaseState> = phases
            .iter()
            .enumerate()
            .map(|(i, &phase)| PhaseState {
                tid: i as i32,
                phase,
                off_until: None,
                on_since: 0,
                on_len: BUDGET_ON_NS,
                late: 0,
            })
            .collect();
        let mut on_ns = vec![0u64; phases.len()];
        let (mut rng, mut most, mut now) = (7u64, 0, 0);
        while now < until {
            for (tid, step) in phase_steps(&ts, now) {
                let t = &mut ts[tid as usize];
                match step {
                    PhaseStep::End { off_until } => {
                        on_ns[tid as usize] += now - t.on_since;
                        t.off_until = Some(off_until);
                    }
                    PhaseStep::Start { late } => {
                        t.off_until = None;
                        t.on_since = now;
                        t.on_len = on_phase_len(BUDGET_ON_NS, next_random(&mut rng));
                        t.late = late;
                    }
                }
            }
            let on = ts
                .iter()
                .filter(|t| t.phase < 1.0 && t.off_until.is_none())
                .count();
            if now >= 2_000_000_000 {
                most = most.max(on);
            }
            now += tick;
        }
        for (i, t) in ts.iter().enumerate() {
            if t.off_until.is_none() {
                on_ns[i] += now - t.on_since;
            }
        }
        let shares = on_ns.iter().map(|&n| n as f64 / now as f64).collect();
        (shares, most)
    }

    /// Budgeted threads take turns: one on at a time while their shares add up to at most
    /// one (a step crossing them pays one thread's traps), as many as the shares' sum rounded
    /// up otherwise; each keeps its share, the turns' waits taken off its next off-phase; on
    /// a loop that looks every 10 ms and on one that is 300 ms late.
    #[test]
    fn budgeted_threads_take_turns_and_keep_their_shares() {
        for tick in [10_000_000, 300_000_000] {
            for (phases, most) in [
                (&[0.25, 0.1, 0.05][..], 1),
                (&[0.3, 0.3, 0.3][..], 1),
                (&[0.5, 0.5, 0.5][..], 2),
            ] {
                let (shares, on) = simulate_phases(phases, 600_000_000_000, tick);
                assert!(on <= most, "{phases:?} tick {tick}: {on} on at once");
                for (s, p) in shares.iter().zip(phases) {
                    assert!(
                        (s - p).abs() <= 0.1 * p,
                        "{phases:?} tick {tick}: share {s:.3} for {p}"
                    );
                }
            }
        }
        // A thread back to all the time starts at once, whoever else is on.
        let t = |tid, phase, off_until| PhaseState {
            tid,
            phase,
            off_until,
            on_since: 0,
            on_len: BUDGET_ON_NS,
            late: 0,
        };
        let steps = phase_steps(
            &[t(1, 0.2, None), t(2, 0.2, Some(5)), t(3, 1.0, Some(5))],
            10,
        );
        assert_eq!(steps, vec![(3, PhaseStep::Start { late: 0 })]);
        // The on-phases' lengths: between half and one and a half times the planned one.
        let mut rng = 3u64;
        let lens: Vec<u64> = (0..1000)
            .map(|_| on_phase_len(BUDGET_ON_NS, next_random(&mut rng)))
            .collect();
        assert!(lens
            .iter()
            .all(|&l| (BUDGET_ON_NS / 2..=BUDGET_ON_NS * 3 / 2).contains(&l)));
        let mean = lens.iter().sum::<u64>() as f64 / lens.len() as f64;
        assert!((mean / BUDGET_ON_NS as f64 - 1.0).abs() < 0.05, "{mean}");
    }

    /// A recording loop that gets to an on-phase's end late (here 1 s instead of 250 ms)
    /// makes the off-phase after it as much longer: the share over the cycle stays `phase`.
    #[test]
    fn budget_share_holds_when_the_loop_is_late() {
        for (on, phase) in [
            (BUDGET_ON_NS, 0.25),
            (1_000_000_000, 0.25),
            (3_700_000_000, 0.1),
        ] {
            let end = off_phase_end(500, 500 + on, phase);
            let share = on as f64 / (end - 500) as f64;
            assert!((share - phase).abs() < 1e-6, "on {on} ns: share {share}");
        }
        // Watched all the time: no off-phase.
        assert_eq!(off_phase_end(0, 900, 1.0), 900);
    }

    #[test]
    fn watched_switches_cost_what_the_registers_held_cost() {
        let cost = crate::bpf::SwitchCost {
            one_ns: 1000,
            four_ns: 4000,
        };
        assert_eq!(watched_switches(Some(10), Some(25), 1, cost), (15, 15_000));
        assert_eq!(watched_switches(Some(10), Some(25), 4, cost), (15, 60_000));
        // Nothing held, or a reading missing at either end: nothing counted.
        assert_eq!(watched_switches(Some(10), Some(25), 0, cost), (0, 0));
        assert_eq!(watched_switches(None, Some(25), 2, cost), (0, 0));
        assert_eq!(watched_switches(Some(30), Some(25), 2, cost), (0, 0));
    }

    #[test]
    fn budget_counts_context_switches() {
        let st = |t_ns, run_ns, switches| Schedstat {
            t_ns,
            run_ns,
            switches,
        };
        assert_eq!(Schedstat::parse("2500 77 30\n", 9), Some(st(9, 2500, 30)));
        assert_eq!(Schedstat::parse("2500 77\n", 9), None);
        let cost = crate::bpf::SwitchCost {
            one_ns: 1000,
            four_ns: 4000,
        };
        assert_eq!(cost.with_regs(0), 0);
        assert_eq!(cost.with_regs(2), 2000);
        assert_eq!(cost.with_regs(9), 4000);
        let s = 1_000_000_000;
        // 1% of the wall time in traps, on a thread that switched 5,000 times in 1 s holding
        // one register: +0.5%; holding four, +2%.
        let full = full_cost(0.01, Some(st(0, 0, 0)), Some(st(s, s, 5000)), cost, 1);
        assert!((full - 0.015).abs() < 1e-9, "{full}");
        let full = full_cost(0.01, Some(st(0, 0, 0)), Some(st(s, 0, 5000)), cost, 4);
        assert!((full - 0.03).abs() < 1e-9, "{full}");
        // No counters: the trap share alone.
        assert_eq!(full_cost(0.01, None, Some(st(s, s, 1)), cost, 1), 0.01);
    }

    #[test]
    fn budget_window_counts_watched_probe_time_by_event_time() {
        let mut w = BudgetWindow::default();
        // Two probes on from 100, one off at 300, the other off at 500: 200·2 + 200·1.
        w.watch(100, 1);
        w.watch(100, 1);
        w.watch(300, -1);
        assert_eq!(w.watched(400), 400 + 100);
        w.watch(500, -1);
        assert_eq!(w.watched(900), 600);
        // A new window at 900 with one probe set at 1000: 50 at 1050.
        w.restart(900);
        w.watch(1000, 1);
        assert_eq!(w.watched(1050), 50);
        // An edge stamped before the window's start counts from the start.
        let mut w = BudgetWindow {
            on_mark: 2000,
            ..BudgetWindow::default()
        };
        w.watch(1500, 1);
        assert_eq!(w.watched(2100), 100);
    }
}
