//! Figures from part of a window: percentiles of the calls timed, an exact probe's coverage
//! (the stretches of its span it was watched) and how its calls are weighed for it, and the
//! 95% intervals of counts and percentiles estimated from the watched phases. Pure maths over
//! call lists, below the views that print them (`views::latency`) and the probe schedule's
//! replay that checks them (`sampler::probes::replay`).

use serde::{Deserialize, Serialize};

/// Nearest-rank percentile of sorted values, `q` in 0..=1; None when empty.
pub fn nearest_rank(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    // The epsilon keeps float error (0.7 * 10 = 7.000000000000001) from skipping a rank.
    let rank = (q * sorted.len() as f64 - 1e-9).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Latency statistics of a set of calls, ms.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LatencyMs {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

pub(crate) fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl LatencyMs {
    /// Statistics of call durations (ns), sorted in place; None without calls.
    pub fn of(durs: &mut [u64]) -> Option<LatencyMs> {
        durs.sort_unstable();
        let max = *durs.last()?;
        let total: u128 = durs.iter().map(|&d| u128::from(d)).sum();
        let pct = |q| nearest_rank(durs, q).map_or(0.0, ms);
        Some(LatencyMs {
            p50: pct(0.5),
            p90: pct(0.9),
            p99: pct(0.99),
            max: ms(max),
            mean: total as f64 / durs.len() as f64 / 1e6,
        })
    }
}

impl LatencyMs {
    /// Statistics of call durations (ns) each standing for `weight` calls (an exact probe
    /// watched for part of the window: [`coverage_weights`]); percentiles are weighted
    /// nearest-rank. None without calls.
    pub fn of_weighted(calls: &mut [(u64, f64)]) -> Option<LatencyMs> {
        calls.sort_unstable_by_key(|&(d, _)| d);
        let max = calls.last()?.0;
        let total_w: f64 = calls.iter().map(|&(_, w)| w).sum();
        let total: f64 = calls.iter().map(|&(d, w)| d as f64 * w).sum();
        let pct = |q: f64| {
            let want = q * total_w - 1e-9;
            let mut acc = 0.0;
            for &(d, w) in calls.iter() {
                acc += w;
                if acc >= want {
                    return ms(d);
                }
            }
            ms(max)
        };
        Some(LatencyMs {
            p50: pct(0.5),
            p90: pct(0.9),
            p99: pct(0.99),
            max: ms(max),
            mean: if total_w > 0.0 {
                total / total_w / 1e6
            } else {
                0.0
            },
        })
    }
}

/// An exact probe on one thread watched for part of its span: the span and its watched
/// intervals.
#[derive(Debug, Clone)]
pub struct Coverage {
    /// From the first watch on that thread to its thread's last watch edge (or `end_ns`).
    pub span_ns: u64,
    pub intervals: Vec<(u64, u64)>,
}

impl Coverage {
    /// Share of the span that was watched.
    pub fn share(&self) -> f64 {
        let w: u64 = self.intervals.iter().map(|(a, b)| b - a).sum();
        w as f64 / self.span_ns.max(1) as f64
    }

    /// How many calls one observed call of `dur_ns` stands for: the span over the total time
    /// a call of that length could have started and still been watched from its start to its
    /// end (sum over intervals of max(0, L - d)). Long calls straddle a switch more often, so
    /// they weigh more than the coverage alone says (L / (L - d) for one interval).
    pub fn weight(&self, dur_ns: u64) -> f64 {
        let room: u64 = self
            .intervals
            .iter()
            .map(|(a, b)| (b - a).saturating_sub(dur_ns))
            .sum();
        let share = self.share().max(1e-9);
        if room == 0 {
            1.0 / share
        } else {
            self.span_ns as f64 / room as f64
        }
    }

    /// As [`Self::weight`], for a call that began at `start_ns`, with the share taken locally
    /// ([`Strata::weight`]). Weighing many calls of one coverage, cut it once with
    /// [`Self::strata`] (what the views do; this one is the tests' reference).
    #[cfg(test)]
    pub(crate) fn weight_at(&self, start_ns: u64, dur_ns: u64) -> f64 {
        self.strata().weight(start_ns, dur_ns)
    }

    /// The span cut into strata of consecutive watched intervals, each at least
    /// [`STRATUM_NS`] long (the first from the first interval's start, the last to the span's
    /// end).
    pub(crate) fn strata(&self) -> Strata {
        let mut iv = self.intervals.clone();
        iv.sort_unstable();
        let Some(&(first, _)) = iv.first() else {
            return Strata(Vec::new());
        };
        let end = first + self.span_ns;
        let mut strata = Vec::new();
        let (mut lo, mut from) = (first, 0);
        for k in 0..iv.len() {
            let last = k + 1 == iv.len();
            // A stratum closes at the next interval's start once it is long enough.
            let hi = if last { end } else { iv[k + 1].0 };
            if last || hi.saturating_sub(lo) >= STRATUM_NS {
                strata.push(Stratum {
                    lo,
                    hi,
                    intervals: iv[from..=k].to_vec(),
                });
                (lo, from) = (hi, k + 1);
            }
        }
        Strata(strata)
    }
}

/// A [`Coverage`] cut into strata ([`Coverage::strata`]).
#[derive(Debug, Clone)]
pub struct Strata(Vec<Stratum>);

#[derive(Debug, Clone)]
struct Stratum {
    lo: u64,
    hi: u64,
    intervals: Vec<(u64, u64)>,
}

impl Strata {
    /// How many calls one timed call that began at `start_ns` and lasted `dur_ns` stands for:
    /// its stratum's length over the room a call of its length had in the stratum's
    /// intervals (where none fits, over the time they were watched). Where the share changes
    /// over the span (the budget's re-sizing), a stretch watched less weighs more; where it
    /// does not, this is [`Coverage::weight`]. 1 without any interval.
    pub fn weight(&self, start_ns: u64, dur_ns: u64) -> f64 {
        let Some(s) = self
            .0
            .iter()
            .find(|s| start_ns < s.hi)
            .or_else(|| self.0.last())
        else {
            return 1.0;
        };
        let len = s.hi.saturating_sub(s.lo).max(1);
        let room: u64 = s
            .intervals
            .iter()
            .map(|&(a, b)| (b - a).saturating_sub(dur_ns))
            .sum();
        if room == 0 {
            let watched: u64 = s.intervals.iter().map(|&(a, b)| b - a).sum();
            return len as f64 / watched.max(1) as f64;
        }
        len as f64 / room as f64
    }
}

/// The stretch of a span over which [`Coverage::weight_at`] takes the watched share as
/// constant: `--probe-budget` re-sizes a thread's on-phases every two seconds or more, from
/// the traps of the last window, so the share watched follows the thread's call rate (less of
/// it watched while it calls more); a count scaled by the whole span's share would then be low.
pub(crate) const STRATUM_NS: u64 = 2_000_000_000;

/// What an estimate `v` prints after its ±: the larger side of its interval `[lo, hi]` (one
/// figure for an interval that need not be symmetric, never negative). `report`, `diff`, `top`
/// and its headline print their error bars with it.
pub fn larger_side(v: f64, [lo, hi]: [f64; 2]) -> f64 {
    (v - lo).max(hi - v).max(0.0)
}

/// 95% intervals of a row estimated from part of the window (an exact probe watched in
/// phases, or taking turns for its thread's debug registers).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Uncertainty {
    /// Calls in the span.
    pub calls: [f64; 2],
    /// p50 and p90, ms.
    pub p50_ms: [f64; 2],
    pub p90_ms: [f64; 2],
    /// How the intervals were found: `phases` (a bootstrap over the watched phases, which
    /// holds the load's swings between them) or `calls` (one or two phases: Poisson counts
    /// and the binomial ranks of the percentiles, as if the calls seen were drawn
    /// independently, which understates the error under a swinging load).
    pub method: String,
    /// Watched phases the calls came from.
    pub phases: u32,
}

/// Fewest watched phases a bootstrap over phases is run on.
const MIN_PHASES: usize = 3;

/// How much wider than a bootstrap's 95% spread an interval from `k` phases is drawn: the
/// Student t quantile over the normal one with k - 1 degrees of freedom, times sqrt(k/(k-1))
/// (a percentile bootstrap over few clusters is too narrow by about both).
fn small_sample_factor(k: usize) -> f64 {
    const T975: [f64; 10] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    ];
    let df = k.saturating_sub(1).max(1);
    let t = match df {
        1..=10 => T975[df - 1],
        11..=15 => 2.16,
        16..=20 => 2.10,
        21..=30 => 2.06,
        _ => 1.96,
    };
    t / 1.96 * (k as f64 / df as f64).sqrt()
}
/// Bootstrap replicates (the interval's ends are its 2.5th and 97.5th percentiles).
const REPLICATES: usize = 400;

/// SplitMix64: a fixed-seed generator, so that one recording always gives one report.
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Weighted nearest-rank p50 and p90 of `calls` sorted by duration, each call's weight times
/// its phase's multiplicity `mult`; `phase_w` is each phase's calls' summed weight (so the
/// total is a sum over the phases, and one pass over the calls finds both: a bootstrap
/// replicate costs one pass, not four).
fn weighted_p50_p90(
    calls: &[(u64, f64, usize)],
    phase_w: &[f64],
    mult: &[f64],
) -> Option<(f64, f64)> {
    let total: f64 = phase_w.iter().zip(mult).map(|(w, m)| w * m).sum();
    if total <= 0.0 {
        return None;
    }
    let (want50, want90) = (0.5 * total - 1e-9, 0.9 * total - 1e-9);
    let mut acc = 0.0;
    let mut p50 = None;
    for &(d, w, k) in calls {
        acc += w * mult[k];
        if p50.is_none() && acc >= want50 {
            p50 = Some(ms(d));
        }
        if acc >= want90 {
            return Some((p50.unwrap_or(ms(d)), ms(d)));
        }
    }
    let last = ms(calls.last()?.0);
    Some((p50.unwrap_or(last), last))
}

/// The value at quantile `q` of `v` (sorted in place).
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len().saturating_sub(1)) as f64 * q).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

/// 95% intervals of an estimated row: `calls` are (start, duration, weight) of the calls
/// timed on one (probe, thread), `cov` its coverage. With enough watched phases, a bootstrap
/// that draws phases (not calls) with replacement: calls inside one phase share its load, so
/// phases are the independent units, and a count scaled from them varies as their rates do
/// (an engine whose rate swings 3x between seconds, watched in five 250 ms phases, has a count
/// error of tens of percent that the calls' own Poisson error, a few percent, does not show).
/// The spread is narrowed by the finite-population factor sqrt(1 - share) (a probe watched
/// all the time has no sampling error) and widened for few phases ([`small_sample_factor`]).
/// Deterministic (a fixed seed).
pub fn uncertainty(calls: &[StartedCall], cov: &Coverage) -> Option<Uncertainty> {
    let share = cov.share().clamp(0.0, 1.0);
    let fpc = (1.0 - share).max(0.0).sqrt();
    let widen = fpc * small_sample_factor(cov.intervals.len());
    // Each call's phase: the watched interval holding its start. A call outside every one
    // (before or after a window's coverage) is not part of the estimate.
    let phase_of = |start: u64| {
        cov.intervals
            .iter()
            .position(|&(a, b)| start >= a && start < b)
    };
    let mut sorted: Vec<(u64, f64, usize)> = calls
        .iter()
        .filter_map(|&(s, d, w)| Some((d, w, phase_of(s)?)))
        .collect();
    if sorted.is_empty() {
        return None;
    }
    let est: f64 = sorted.iter().map(|c| c.1).sum();
    sorted.sort_unstable_by_key(|c| c.0);
    let k = cov.intervals.len().max(1);
    let ones = vec![1.0; k];
    let mut per_phase = vec![0.0; k];
    for &(_, w, i) in &sorted {
        per_phase[i] += w;
    }
    let (p50, p90) = weighted_p50_p90(&sorted, &per_phase, &ones)?;
    // The point estimate plus the replicates' spread around their own centre, narrowed.
    let around = |point: f64, reps: &mut [f64]| -> [f64; 2] {
        let (lo, mid, hi) = (
            quantile(reps, 0.025),
            quantile(reps, 0.5),
            quantile(reps, 0.975),
        );
        [
            (point - (mid - lo) * widen).max(0.0),
            point + (hi - mid) * widen,
        ]
    };
    if cov.intervals.len() >= MIN_PHASES {
        let len: Vec<f64> = cov.intervals.iter().map(|&(a, b)| (b - a) as f64).collect();
        let watched: f64 = len.iter().sum();
        let mut rng = SplitMix(0x5EED ^ sorted.len() as u64 ^ (cov.span_ns << 1));
        let (mut rc, mut r50, mut r90) = (Vec::new(), Vec::new(), Vec::new());
        let mut mult = vec![0.0; k];
        for _ in 0..REPLICATES {
            mult.iter_mut().for_each(|m| *m = 0.0);
            for _ in 0..k {
                mult[rng.below(k)] += 1.0;
            }
            let w_b: f64 = len.iter().zip(&mult).map(|(l, m)| l * m).sum();
            if w_b <= 0.0 {
                continue;
            }
            let n_b: f64 = per_phase.iter().zip(&mult).map(|(w, m)| w * m).sum();
            rc.push(n_b * watched / w_b);
            if let Some((a, b)) = weighted_p50_p90(&sorted, &per_phase, &mult) {
                r50.push(a);
                r90.push(b);
            }
        }
        if rc.len() >= REPLICATES / 2 && !r50.is_empty() {
            // The count: a total over K phases (clusters), each phase's weighted calls
            // against its share of the estimate by length; Var = K/(K-1) * sum of squared
            // residuals, and a Student t interval.
            let kf = k as f64;
            let ss: f64 = per_phase
                .iter()
                .zip(&len)
                .map(|(z, l)| (z - est * l / watched).powi(2))
                .sum();
            let t = small_sample_factor(k) * 1.96 / (kf / (kf - 1.0)).sqrt();
            // Never narrower than the calls' own Poisson error: with few calls timed, phases
            // that happen to hold alike counts say nothing of the calls they missed (a probe
            // timing 14 of 190 calls at a 10% share read 35% low beside a printed +-16%).
            let poisson = 1.96 * est / (sorted.len() as f64).sqrt() * fpc;
            let half = (t * (kf / (kf - 1.0) * ss).sqrt() * fpc).max(poisson);
            return Some(Uncertainty {
                calls: [(est - half).max(0.0), est + half],
                p50_ms: around(p50, &mut r50),
                p90_ms: around(p90, &mut r90),
                method: "phases".into(),
                phases: cov.intervals.len() as u32,
            });
        }
    }
    // Few phases: the calls as independent draws. The count is Poisson in the calls seen,
    // scaled by the share; a percentile's interval is between the order statistics at the
    // binomial ranks n q -/+ 1.96 sqrt(n q (1 - q)).
    let n = sorted.len() as f64;
    let dn = 1.96 * n.sqrt() * fpc * est / n;
    let ranks = |q: f64| {
        let sd = 1.96 * (n * q * (1.0 - q)).sqrt() * fpc;
        let at = |r: f64| {
            let i = (r.round().clamp(1.0, n) as usize).saturating_sub(1);
            ms(sorted[i.min(sorted.len() - 1)].0)
        };
        [at(n * q - sd), at(n * q + sd)]
    };
    let (a50, a90) = (ranks(0.5), ranks(0.9));
    Some(Uncertainty {
        calls: [(est - dn).max(0.0), est + dn],
        p50_ms: [a50[0].min(p50), a50[1].max(p50)],
        p90_ms: [a90[0].min(p90), a90[1].max(p90)],
        method: "calls".into(),
        phases: cov.intervals.len() as u32,
    })
}

/// A timed call's (start, duration, weight), ns: what [`uncertainty`] takes.
pub type StartedCall = (u64, u64, f64);
