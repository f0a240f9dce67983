//! `record --measure-cost`: what watching costs a live engine, measured on that engine under
//! its own load (issue 34). Inside one attach, the recording's parts are switched off and on
//! in short slices; at every slice edge the engine's own progress counter
//! (`vllm:generation_tokens_total` by default) is read from its `/metrics`. Slices come in
//! pairs, one on and one off in an order drawn at random for each pair, so that the engine's
//! drift (its throughput moves 3× over minutes and ±3-15% between 20 s phases on a 2-CPU
//! machine) falls on both arms alike; the ratio of each pair's rates is one observation, and
//! their geometric mean with a 95% t-interval is the cost.
//!
//! "Off" is: every BPF program of the part returns at its first instruction (the `control`
//! map), the probes' watchpoints removed, the asyncio task readers paused, the recording loop
//! at normal priority instead of real-time. Attach, detach and
//! start-up stay outside the slices (they come before the first and after the last). What
//! stays on in both arms, and so is not measured: the perf events' own clock interrupts,
//! GC uprobes' int3 (the program returns at once), the recording loop's thread-list reads and
//! the 1 Hz scraper, and this instrument's own reads of the counter (one GET per slice edge).
//!
//! Each comparison's arms are masks of parts switched off: `everything` is all on against all
//! off; with `--cost-each-part`, each part is measured by leaving it out (all on against all
//! on less that part), and a null comparison (all off against all off) shows the interval the
//! instrument reaches when nothing differs.

use std::time::Duration;

use crate::bpf::abi::{OFF_GC, OFF_PROBE, OFF_SAMPLE, OFF_STACKS, OFF_SWITCH};
use crate::sys::next_random;

/// The asyncio task readers (user space only: not a BPF bit).
pub(crate) const OFF_TASKS: u32 = 1 << 16;
/// The recording loop's real-time priority (user space only): "off", the loop runs as a
/// normal thread, as under `ENGINESCOPE_NO_REALTIME=1`. Left out, its comparison says what
/// the real-time loop costs the engine against the same recording at normal priority.
pub const OFF_REALTIME: u32 = 1 << 17;
/// Every part.
pub(crate) const OFF_ALL: u32 =
    OFF_SAMPLE | OFF_SWITCH | OFF_STACKS | OFF_GC | OFF_PROBE | OFF_TASKS | OFF_REALTIME;

/// The parts: the name `--cost-part` takes, the name the table prints, the mask bit.
pub(crate) const PARTS: &[(&str, &str, u32)] = &[
    ("sampling", "sampling", OFF_SAMPLE),
    ("offcpu", "off-CPU and GIL", OFF_SWITCH),
    // Off: switch tracing goes on, but the scheduler's hooks walk no stack (a switch-out carries
    // the thread's last known stack): what the stacks cost of the part above.
    ("stacks", "off-CPU stacks", OFF_STACKS),
    ("gc", "GC", OFF_GC),
    ("probes", "probes", OFF_PROBE),
    ("tasks", "task readers", OFF_TASKS),
    ("realtime", "real-time loop", OFF_REALTIME),
];

/// `record` flags of the instrument.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct CostArgs {
    /// Measure what this recording costs the engine instead of recording for a duration:
    /// switch its parts off and on in slices (pairs in random order) and read the engine's
    /// own progress counter at each edge; prints the throughput ratio with a 95% interval.
    #[arg(long)]
    pub measure_cost: bool,
    /// With --measure-cost: pairs of slices per comparison.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u32).range(2..=10_000))]
    pub cost_pairs: u32,
    /// With --measure-cost: seconds per slice.
    #[arg(long, default_value_t = 1.5)]
    pub cost_slice: f64,
    /// With --measure-cost: also each part alone (sampling, off-CPU and GIL, the stack walks
    /// of off-CPU intervals, GC, probes, task readers, the loop's real-time priority), by
    /// leaving it out, and a null comparison
    /// (nothing differs).
    #[arg(long)]
    pub cost_each_part: bool,
    /// With --measure-cost: only the named comparisons, in this order (repeat the flag):
    /// everything, sampling, offcpu, stacks, gc, probes, tasks, realtime, null. One part's cost
    /// then gets all the pairs instead of a ninth of them.
    #[arg(long = "cost-part", value_name = "NAME", value_parser = part_name)]
    pub cost_parts: Vec<String>,
    /// With --measure-cost: the Prometheus counter that counts the engine's progress, summed
    /// over its series (default vLLM's generated tokens).
    #[arg(
        long,
        default_value = "vllm:generation_tokens_total",
        value_name = "NAME"
    )]
    pub cost_counter: String,
    /// With --measure-cost: the seed of the slices' order (default: from the clock).
    #[arg(long)]
    pub cost_seed: Option<u64>,
}

impl CostArgs {
    /// The plan, or None without `--measure-cost`.
    pub fn plan(&self) -> anyhow::Result<Option<CostPlan>> {
        if !self.measure_cost {
            return Ok(None);
        }
        anyhow::ensure!(
            self.cost_slice.is_finite() && (0.2..=60.0).contains(&self.cost_slice),
            "--cost-slice must be between 0.2 and 60 seconds, not {}",
            self.cost_slice
        );
        let seed = self.cost_seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
        Ok(Some(CostPlan {
            comparisons: if self.cost_parts.is_empty() {
                comparisons(self.cost_each_part)
            } else {
                named_comparisons(&self.cost_parts)
            },
            pairs: self.cost_pairs as usize,
            slice: Duration::from_secs_f64(self.cost_slice),
            counter: self.cost_counter.clone(),
            seed,
        }))
    }
}

fn part_name(s: &str) -> Result<String, String> {
    let all = comparisons(true);
    if all.iter().any(|c| c.part == s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "no part named {s:?}: one of {}",
            all.iter().map(|c| c.part).collect::<Vec<_>>().join(", ")
        ))
    }
}

/// The comparisons named by `--cost-part`, in the order given (a name given twice once).
pub(crate) fn named_comparisons(names: &[String]) -> Vec<Comparison> {
    let all = comparisons(true);
    let mut out: Vec<Comparison> = Vec::new();
    for name in names {
        if let Some(c) = all.iter().find(|c| c.part == name) {
            if !out.contains(c) {
                out.push(c.clone());
            }
        }
    }
    out
}

/// Two arms, each the mask of parts switched off.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// What `--cost-part` calls it.
    pub part: &'static str,
    /// What the table prints.
    pub name: String,
    /// The arm whose cost is measured (fewer parts off).
    pub on: u32,
    /// The reference arm.
    pub off: u32,
}

/// `everything`, then (with `each_part`) each part left out and the null comparison.
pub fn comparisons(each_part: bool) -> Vec<Comparison> {
    let mut v = vec![Comparison {
        part: "everything",
        name: "everything".into(),
        on: 0,
        off: OFF_ALL,
    }];
    if each_part {
        v.extend(PARTS.iter().map(|&(part, name, bit)| Comparison {
            part,
            name: name.into(),
            on: 0,
            off: bit,
        }));
        v.push(Comparison {
            part: "null",
            name: "null (nothing differs)".into(),
            on: OFF_ALL,
            off: OFF_ALL,
        });
    }
    v
}

#[derive(Debug, Clone)]
pub struct CostPlan {
    pub comparisons: Vec<Comparison>,
    pub pairs: usize,
    pub slice: Duration,
    pub counter: String,
    pub seed: u64,
}

/// One slice of the schedule: comparison `c`'s pair `pair`, arm `on` (else off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    pub comparison: usize,
    pub pair: usize,
    pub on: bool,
}

impl CostPlan {
    /// Every slice in order: round by round, each comparison's pair in that round, its two
    /// arms in an order drawn at random.
    pub fn schedule(&self) -> Vec<Slice> {
        let mut state = self.seed;
        let mut out = Vec::with_capacity(2 * self.pairs * self.comparisons.len());
        for pair in 0..self.pairs {
            for comparison in 0..self.comparisons.len() {
                let on_first = next_random(&mut state) >> 63 == 1;
                for on in [on_first, !on_first] {
                    out.push(Slice {
                        comparison,
                        pair,
                        on,
                    });
                }
            }
        }
        out
    }

    /// The mask of a slice.
    pub fn mask(&self, s: &Slice) -> u32 {
        let c = &self.comparisons[s.comparison];
        if s.on {
            c.on
        } else {
            c.off
        }
    }
}

/// What one slice measured: its counter's increase and its length.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SliceResult {
    pub comparison: usize,
    pub pair: usize,
    pub on: bool,
    pub secs: f64,
    pub delta: f64,
}

/// One comparison's outcome.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CostRow {
    pub name: String,
    /// Geometric mean of the pairs' on/off rate ratios, and its 95% interval.
    pub ratio: f64,
    pub low: f64,
    pub high: f64,
    /// Pairs used (both slices with progress), and pairs left out (a slice without any).
    pub pairs: usize,
    pub pairs_without_progress: usize,
    /// Mean rate of each arm, counter units per second.
    pub on_rate: f64,
    pub off_rate: f64,
    /// The pairs' spread: standard deviation of the log ratio.
    pub sd_log_ratio: f64,
}

/// Student's t 0.975 quantile for `df` degrees of freedom (a table to 30, then the normal
/// approximation with its first correction terms; within 0.1% of the exact value).
pub(crate) fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        d if d <= 30 => T[d - 1],
        d => {
            let z: f64 = 1.959_964;
            let d = d as f64;
            z + (z.powi(3) + z) / (4.0 * d)
                + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * d * d)
        }
    }
}

/// The rows of `plan`'s comparisons from the slices measured.
pub fn summarize(plan: &CostPlan, slices: &[SliceResult]) -> Vec<CostRow> {
    use std::collections::BTreeMap;
    plan.comparisons
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let mut pairs: BTreeMap<usize, (Option<f64>, Option<f64>)> = BTreeMap::new();
            let (mut on_sum, mut on_t, mut off_sum, mut off_t) = (0.0, 0.0, 0.0, 0.0);
            for s in slices.iter().filter(|s| s.comparison == ci && s.secs > 0.0) {
                let rate = s.delta / s.secs;
                let e = pairs.entry(s.pair).or_default();
                if s.on {
                    e.0 = Some(rate);
                    (on_sum, on_t) = (on_sum + s.delta, on_t + s.secs);
                } else {
                    e.1 = Some(rate);
                    (off_sum, off_t) = (off_sum + s.delta, off_t + s.secs);
                }
            }
            let mut logs = Vec::new();
            let mut without = 0;
            for (a, b) in pairs.values() {
                match (a, b) {
                    (Some(a), Some(b)) if *a > 0.0 && *b > 0.0 => logs.push((a / b).ln()),
                    (Some(_), Some(_)) => without += 1,
                    _ => {}
                }
            }
            let n = logs.len();
            let mean = if n > 0 {
                logs.iter().sum::<f64>() / n as f64
            } else {
                0.0
            };
            let sd = if n > 1 {
                (logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
            } else {
                f64::NAN
            };
            let half = t975(n.saturating_sub(1)) * sd / (n as f64).sqrt();
            CostRow {
                name: c.name.clone(),
                ratio: if n > 0 { mean.exp() } else { f64::NAN },
                low: (mean - half).exp(),
                high: (mean + half).exp(),
                pairs: n,
                pairs_without_progress: without,
                on_rate: if on_t > 0.0 { on_sum / on_t } else { 0.0 },
                off_rate: if off_t > 0.0 { off_sum / off_t } else { 0.0 },
                sd_log_ratio: sd,
            }
        })
        .collect()
}

/// The result of a measurement, per engine.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CostResult {
    pub counter: String,
    pub slice_s: f64,
    pub seed: u64,
    /// (engine id, its rows).
    pub engines: Vec<(String, Vec<CostRow>)>,
    /// Counter reads that failed (their slices are left out).
    pub read_errors: u64,
    pub last_error: String,
    /// When the parts switched off changed: (ns since the recording's start, the mask
    /// from then on); the last entry is everything on again.
    pub mask_changes: Vec<(u64, u32)>,
    /// Whether the recording loop ran real-time after each change (the kernel's answer,
    /// `sched_getscheduler`): the `realtime` part's arms, as applied.
    pub loop_realtime: Vec<bool>,
}

impl CostResult {
    /// The table a person reads.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        for (engine, rows) in &self.engines {
            let _ = writeln!(
                s,
                "What watching costs {engine}: {} per second with each comparison's parts on vs off, {:.1} s slices, the two arms of each pair in random order (seed {}). Ratio = on/off (1.000: no cost); 95% interval from the pairs' spread.",
                self.counter, self.slice_s, self.seed
            );
            let _ = writeln!(
                s,
                "{:<24} {:>7} {:>17} {:>6} {:>11} {:>11} {:>9}",
                "part", "ratio", "95% interval", "pairs", "on rate", "off rate", "sd(log)"
            );
            for r in rows {
                let _ = writeln!(
                    s,
                    "{:<24} {:>7.3} {:>17} {:>6} {:>11.1} {:>11.1} {:>9.3}{}",
                    r.name,
                    r.ratio,
                    format!("[{:.3}, {:.3}]", r.low, r.high),
                    r.pairs,
                    r.on_rate,
                    r.off_rate,
                    r.sd_log_ratio,
                    if r.pairs_without_progress > 0 {
                        format!(
                            " ({} pairs without progress left out)",
                            r.pairs_without_progress
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
        if self.read_errors > 0 {
            let _ = writeln!(
                s,
                "{} counter reads failed (their slices left out); last: {}",
                self.read_errors, self.last_error
            );
        }
        s
    }
}

/// A measurement under way: the recording loop calls [`CostRun::tick`] after each collect.
pub struct CostRun {
    plan: CostPlan,
    schedule: Vec<Slice>,
    /// The slice running now (its mask applied at the last edge).
    current: usize,
    /// The last edge: when the counters were read (monotonic ns of each answer's head) and
    /// their values, per engine.
    edge: Option<(Instant, Vec<Reading>)>,
    urls: Vec<(String, String)>,
    agent: ureq::Agent,
    slices: Vec<Vec<SliceResult>>,
    read_errors: u64,
    last_error: String,
    /// The recording's start (monotonic ns) and the masks applied since, as in
    /// [`CostResult::mask_changes`].
    start_ns: u64,
    mask_changes: Vec<(u64, u32)>,
    loop_realtime: Vec<bool>,
}

/// What the loop does after a tick.
pub enum Tick {
    /// Nothing to change.
    Wait,
    /// Switch these parts off (the mask of the slice that begins now).
    Apply(u32),
    /// Every slice measured: everything back on.
    Done,
}

use std::time::Instant;

/// One engine's counter at an edge: when its answer's head came (monotonic ns) and the value;
/// None when the read failed.
type Reading = Option<(u64, f64)>;

impl CostRun {
    /// A measurement of `plan` reading the counter from each (engine id, metrics URL).
    pub fn new(
        plan: CostPlan,
        urls: Vec<(String, String)>,
        start_ns: u64,
    ) -> anyhow::Result<CostRun> {
        anyhow::ensure!(
            !urls.is_empty(),
            "--measure-cost reads the engine's own progress counter from its /metrics: no engine with a metrics URL was found (give --vllm, and --metrics-url when the API server's port is not found)"
        );
        let schedule = plan.schedule();
        let n = urls.len();
        Ok(CostRun {
            // An answer later than a slice would make the slice's edges uncertain.
            agent: crate::vllm::metrics::agent(plan.slice.max(Duration::from_secs(2))),
            plan,
            schedule,
            current: 0,
            edge: None,
            urls,
            slices: vec![Vec::new(); n],
            read_errors: 0,
            last_error: String::new(),
            start_ns,
            mask_changes: Vec::new(),
            loop_realtime: Vec::new(),
        })
    }

    /// How long the measurement takes.
    pub fn total(&self) -> Duration {
        self.plan.slice * self.schedule.len() as u32
    }

    fn read(&mut self) -> Vec<Reading> {
        let mut out = Vec::with_capacity(self.urls.len());
        for (_, url) in &self.urls {
            let v = crate::vllm::metrics::get_text(&self.agent, url).and_then(|(text, head_ns)| {
                counter_value(&text, &self.plan.counter)
                    .map(|v| (head_ns, v))
                    .ok_or_else(|| format!("{url}: no {} in the answer", self.plan.counter))
            });
            match v {
                Ok(v) => out.push(Some(v)),
                Err(e) => {
                    self.read_errors += 1;
                    self.last_error = e;
                    out.push(None);
                }
            }
        }
        out
    }

    /// Called by the loop: at a slice's end, read the counters and say what comes next.
    pub fn tick(&mut self, now: Instant) -> Tick {
        let t = self.step(now);
        let mask = match t {
            Tick::Wait => return t,
            Tick::Apply(m) => m,
            Tick::Done => 0,
        };
        let rel = crate::sys::monotonic_ns().saturating_sub(self.start_ns);
        self.mask_changes.push((rel, mask));
        t
    }

    /// The loop's priority once the last change was applied ([`CostResult::loop_realtime`]).
    pub fn note_loop_realtime(&mut self, realtime: bool) {
        self.loop_realtime.push(realtime);
    }

    fn step(&mut self, now: Instant) -> Tick {
        let Some((at, _)) = &self.edge else {
            let values = self.read();
            self.edge = Some((now, values));
            return Tick::Apply(self.plan.mask(&self.schedule[0]));
        };
        if now.duration_since(*at) < self.plan.slice {
            return Tick::Wait;
        }
        let values = self.read();
        let s = self.schedule[self.current];
        if let Some((_, before)) = &self.edge {
            for (e, (b, a)) in before.iter().zip(&values).enumerate() {
                if let (Some((t0, v0)), Some((t1, v1))) = (b, a) {
                    self.slices[e].push(SliceResult {
                        comparison: s.comparison,
                        pair: s.pair,
                        on: s.on,
                        secs: t1.saturating_sub(*t0) as f64 / 1e9,
                        delta: (v1 - v0).max(0.0),
                    });
                }
            }
        }
        self.edge = Some((now, values));
        self.current += 1;
        match self.schedule.get(self.current) {
            Some(next) => Tick::Apply(self.plan.mask(next)),
            None => Tick::Done,
        }
    }

    /// The rows per engine.
    pub fn result(&self) -> CostResult {
        CostResult {
            counter: self.plan.counter.clone(),
            slice_s: self.plan.slice.as_secs_f64(),
            seed: self.plan.seed,
            engines: self
                .urls
                .iter()
                .zip(&self.slices)
                .map(|((id, _), sl)| (id.clone(), summarize(&self.plan, sl)))
                .collect(),
            read_errors: self.read_errors,
            last_error: self.last_error.clone(),
            mask_changes: self.mask_changes.clone(),
            loop_realtime: self.loop_realtime.clone(),
        }
    }
}

/// The sum of `name`'s samples in a Prometheus text exposition (None when it has none).
pub(crate) fn counter_value(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // The name itself, not a longer one that begins with it.
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let v = rest
            .rsplit_once('}')
            .map_or(rest, |(_, v)| v)
            .split_ascii_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = v.filter(|v| v.is_finite()) {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(each: bool, pairs: usize) -> CostPlan {
        CostPlan {
            comparisons: comparisons(each),
            pairs,
            slice: Duration::from_secs(1),
            counter: "c".into(),
            seed: 42,
        }
    }

    #[test]
    fn cost_parts_name_their_comparisons_in_the_order_given() {
        let all = comparisons(true);
        // Every short name picks a comparison, each a different one.
        for (i, name) in all.iter().map(|c| c.part).enumerate() {
            let c = named_comparisons(&[name.to_string()]);
            assert_eq!(c.len(), 1, "{name}");
            assert_eq!(c[0], all[i]);
        }
        for name in [
            "everything",
            "sampling",
            "offcpu",
            "stacks",
            "gc",
            "probes",
            "tasks",
            "realtime",
            "null",
        ] {
            assert!(part_name(name).is_ok(), "{name}");
        }
        let c = named_comparisons(&["probes".into(), "null".into(), "probes".into()]);
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].on, c[0].off), (0, OFF_PROBE));
        assert_eq!((c[1].on, c[1].off), (OFF_ALL, OFF_ALL));
        assert_eq!(named_comparisons(&["everything".into()])[0], all[0]);
        assert!(part_name("prob").is_err());
    }

    #[test]
    fn every_pair_has_both_arms_in_a_random_order() {
        let p = plan(true, 200);
        let s = p.schedule();
        assert_eq!(s.len(), 2 * 200 * p.comparisons.len());
        let mut on_first = 0;
        for w in s.chunks(2) {
            assert_eq!(w[0].comparison, w[1].comparison);
            assert_eq!(w[0].pair, w[1].pair);
            assert_ne!(w[0].on, w[1].on);
            on_first += usize::from(w[0].on);
        }
        // About half each way (1,400 pairs: 50% ± 4.3% is over 3 sd).
        let share = on_first as f64 / (s.len() / 2) as f64;
        assert!((0.457..0.543).contains(&share), "{share}");
        // Reproducible from the seed.
        assert_eq!(s, p.schedule());
        assert_eq!(p.mask(&s[0]), if s[0].on { 0 } else { OFF_ALL });
    }

    #[test]
    fn ratio_and_interval_from_the_pairs() {
        let p = plan(false, 4);
        // On slices at 97 units/s, off at 100: ratio 0.97, no spread.
        let mut slices = Vec::new();
        for pair in 0..4 {
            slices.push(SliceResult {
                comparison: 0,
                pair,
                on: true,
                secs: 2.0,
                delta: 194.0,
            });
            slices.push(SliceResult {
                comparison: 0,
                pair,
                on: false,
                secs: 1.0,
                delta: 100.0,
            });
        }
        let r = &summarize(&p, &slices)[0];
        assert!((r.ratio - 0.97).abs() < 1e-12, "{r:?}");
        assert!((r.low - 0.97).abs() < 1e-9 && (r.high - 0.97).abs() < 1e-9);
        assert_eq!((r.on_rate, r.off_rate), (97.0, 100.0));
        // Ratios 0.9 and 1.1: geometric mean sqrt(0.99), interval from t(1) = 12.706.
        let slices = vec![
            SliceResult {
                comparison: 0,
                pair: 0,
                on: true,
                secs: 1.0,
                delta: 90.0,
            },
            SliceResult {
                comparison: 0,
                pair: 0,
                on: false,
                secs: 1.0,
                delta: 100.0,
            },
            SliceResult {
                comparison: 0,
                pair: 1,
                on: true,
                secs: 1.0,
                delta: 110.0,
            },
            SliceResult {
                comparison: 0,
                pair: 1,
                on: false,
                secs: 1.0,
                delta: 100.0,
            },
            // A pair whose off slice made no progress is left out, and said so.
            SliceResult {
                comparison: 0,
                pair: 2,
                on: true,
                secs: 1.0,
                delta: 100.0,
            },
            SliceResult {
                comparison: 0,
                pair: 2,
                on: false,
                secs: 1.0,
                delta: 0.0,
            },
        ];
        let r = &summarize(&p, &slices)[0];
        assert_eq!((r.pairs, r.pairs_without_progress), (2, 1));
        assert!((r.ratio - 0.99f64.sqrt()).abs() < 1e-12);
        let sd = ((0.9f64.ln() - 1.1f64.ln()).abs()) / 2f64.sqrt();
        assert!((r.sd_log_ratio - sd).abs() < 1e-12);
        let half = 12.706 * sd / 2f64.sqrt();
        assert!((r.high / r.ratio - half.exp()).abs() < 1e-9);
    }

    /// Simulated slices: an engine drifting slowly, arms 2% apart, noise of 5% a slice; the
    /// interval covers the truth in about 95% of runs.
    #[test]
    fn the_interval_covers_the_truth() {
        let mut state = 7u64;
        let mut uniform = || crate::sys::unit_random(&mut state);
        let mut covered = 0;
        let runs = 400;
        for run in 0..runs {
            let p = CostPlan {
                seed: run,
                ..plan(false, 60)
            };
            let mut slices = Vec::new();
            for (k, s) in p.schedule().iter().enumerate() {
                let drift = 1.0 + 0.5 * (k as f64 / 40.0).sin();
                // Sum of 4 uniforms: roughly normal, sd ~ 0.05.
                let noise: f64 = (0..4).map(|_| uniform() - 0.5).sum::<f64>() * 0.087;
                let rate = 1000.0 * drift * (1.0 + noise) * if s.on { 0.98 } else { 1.0 };
                slices.push(SliceResult {
                    comparison: s.comparison,
                    pair: s.pair,
                    on: s.on,
                    secs: 1.0,
                    delta: rate,
                });
            }
            let r = &summarize(&p, &slices)[0];
            if r.low <= 0.98 && 0.98 <= r.high {
                covered += 1;
            }
        }
        assert!((360..=396).contains(&covered), "{covered} of {runs}");
    }

    #[test]
    fn t_quantiles() {
        assert_eq!(t975(1), 12.706);
        assert_eq!(t975(30), 2.042);
        assert!((t975(59) - 2.001).abs() < 0.002, "{}", t975(59));
        assert!((t975(1000) - 1.962).abs() < 0.001);
        assert!(t975(0).is_infinite());
    }

    #[test]
    fn counter_sums_every_series_of_the_name() {
        let text = "# HELP vllm:generation_tokens_total x\n\
                    vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 1500.0\n\
                    vllm:generation_tokens_total{engine=\"1\",model_name=\"m\"} 500\n\
                    vllm:generation_tokens_total_created{engine=\"0\"} 1.7e9\n\
                    vllm:prompt_tokens_total 9\n";
        assert_eq!(
            counter_value(text, "vllm:generation_tokens_total"),
            Some(2000.0)
        );
        assert_eq!(counter_value("plain 3 1700000000\n", "plain"), Some(3.0));
        assert_eq!(counter_value(text, "vllm:absent"), None);
    }
}
