//! Counter increases (restarts handled), histogram quantiles and label-set combination, over
//! raw scraped points `(t_ns, value)` in time order.
//!
//! Counters are stored raw (cumulative). The increase between two consecutive scrapes is
//! `v1 - v0`, or `v1` when the value went down (the counter restarted from zero, as
//! Prometheus's `increase()` treats it), and it is spread evenly over the time between them,
//! so a time range gets its share of every scrape interval it overlaps. A rate over a range is
//! that increase over the part of the range that scrape intervals cover: a range without two
//! scrapes around it has no rate. Failed scrapes leave no point, so a rate spans whatever
//! scrapes succeeded.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::names::GaugeAgg;

/// The increase of a counter from one point to the next; a drop is a restart from zero.
pub(crate) fn step_increase(prev: f64, cur: f64) -> f64 {
    if cur >= prev {
        cur - prev
    } else {
        cur.max(0.0)
    }
}

/// The increase of one raw counter series within `[t0, t1)`, and the ns of it covered.
pub(crate) fn series_increase(pts: &[(u64, f64)], t0: u64, t1: u64) -> (f64, u64) {
    let (mut inc, mut covered) = (0.0, 0u64);
    // Points are in time order: start at the last point before the range, stop past it.
    let first = pts.partition_point(|p| p.0 < t0).saturating_sub(1);
    for w in pts[first..].windows(2) {
        let ((ta, va), (tb, vb)) = (w[0], w[1]);
        if ta >= t1 {
            break;
        }
        if !va.is_finite() || !vb.is_finite() {
            continue;
        }
        let d = step_increase(va, vb);
        if tb <= ta {
            if (t0..t1).contains(&ta) {
                inc += d;
            }
            continue;
        }
        let (lo, hi) = (ta.max(t0), tb.min(t1));
        if hi <= lo {
            continue;
        }
        let part = hi - lo;
        inc += if part == tb - ta {
            d
        } else {
            d * part as f64 / (tb - ta) as f64
        };
        covered += part;
    }
    (inc, covered)
}

/// The time-weighted mean of one gauge series over `[t0, t1)`, linear between consecutive
/// points (as a counter's increase is spread between them), over the part of the range that
/// pairs of points cover: a range that falls between two scrapes (a slow answer) gets the
/// line between them, not nothing. A range no pair covers gets the mean of the points inside
/// it (a lone scrape), or None. Returns the mean and the ns it covers.
pub(crate) fn series_mean(pts: &[(u64, f64)], t0: u64, t1: u64) -> Option<(f64, u64)> {
    let (mut area, mut covered) = (0.0, 0u64);
    let first = pts.partition_point(|p| p.0 < t0).saturating_sub(1);
    for w in pts[first..].windows(2) {
        let ((ta, va), (tb, vb)) = (w[0], w[1]);
        if ta >= t1 {
            break;
        }
        let (lo, hi) = (ta.max(t0), tb.min(t1));
        if tb <= ta || hi <= lo || !va.is_finite() || !vb.is_finite() {
            continue;
        }
        let at = |t: u64| va + (vb - va) * (t - ta) as f64 / (tb - ta) as f64;
        area += (at(lo) + at(hi)) / 2.0 * (hi - lo) as f64;
        covered += hi - lo;
    }
    if covered > 0 {
        return Some((area / covered as f64, covered));
    }
    mean_max(
        pts.iter()
            .filter(|p| (t0..t1).contains(&p.0) && p.1.is_finite())
            .map(|p| p.1),
    )
    .map(|(mean, _)| (mean, 0))
}

/// Per-second rate of a counter between consecutive points, at the later point's time.
pub fn rates(points: &[(u64, f64)]) -> Vec<(u64, f64)> {
    points
        .windows(2)
        .filter(|w| w[1].0 > w[0].0 && w[0].1.is_finite() && w[1].1.is_finite())
        .map(|w| {
            let dt = (w[1].0 - w[0].0) as f64 / 1e9;
            (w[1].0, step_increase(w[0].1, w[1].1) / dt)
        })
        .collect()
}

/// Average per-second rate of a counter from the last point at or before `from_ns` (or the
/// first after it) to the last point; `None` with fewer than two points.
pub(crate) fn rate_since(points: &[(u64, f64)], from_ns: u64) -> Option<f64> {
    let start = points
        .partition_point(|&(t, _)| t <= from_ns)
        .saturating_sub(1);
    let span = points.get(start..)?;
    let (first, last) = (span.first()?, span.last()?);
    if last.0 <= first.0 {
        return None;
    }
    let (inc, _) = series_increase(span, first.0, last.0 + 1);
    Some(inc / ((last.0 - first.0) as f64 / 1e9))
}

/// Several series of one family (one per label set) combined per scrape: at each time any
/// of them has a point, the sum or mean (by `agg`) of the finite values there. Every point of
/// one scrape carries the same time (the scraper stamps them so), so a label set missing from
/// a scrape does not count in it, and one gone for good does not linger.
pub(crate) fn combine<'a>(
    series: impl IntoIterator<Item = &'a [(u64, f64)]>,
    agg: GaugeAgg,
) -> Vec<(u64, f64)> {
    let mut by_t: BTreeMap<u64, (f64, u32)> = BTreeMap::new();
    for pts in series {
        for &(t, v) in pts.iter().filter(|(_, v)| v.is_finite()) {
            let e = by_t.entry(t).or_default();
            e.0 += v;
            e.1 += 1;
        }
    }
    by_t.into_iter()
        .map(|(t, (sum, n))| {
            (
                t,
                match agg {
                    GaugeAgg::Sum => sum,
                    GaugeAgg::Mean => sum / f64::from(n),
                },
            )
        })
        .collect()
}

/// Prometheus' `histogram_quantile`: `buckets` are cumulative `(le, count)` pairs (any
/// order); the last bound must be `+Inf`. Linear interpolation inside the bucket the rank
/// falls in (from 0 for the first bucket); a rank in the `+Inf` bucket gives the highest
/// finite bound. None without observations or without a `+Inf` bucket.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    quantile_in_bucket(q, buckets).map(|(v, _)| v)
}

/// [`histogram_quantile`] and the bucket its rank fell in, `(lower, upper]`: where the true
/// quantile lies (the value interpolates inside it). `upper` is `+Inf` for the last bucket,
/// where the value is only the highest finite bound.
pub(crate) fn quantile_in_bucket(q: f64, buckets: &[(f64, f64)]) -> Option<(f64, (f64, f64))> {
    let mut b: Vec<(f64, f64)> = buckets
        .iter()
        .copied()
        .filter(|(le, c)| !le.is_nan() && c.is_finite())
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    if b.len() < 2 || b.last().is_none_or(|l| l.0 != f64::INFINITY) || !(0.0..=1.0).contains(&q) {
        return None;
    }
    // Counts from deltas of separately scraped series can be slightly non-monotonic.
    for i in 1..b.len() {
        b[i].1 = b[i].1.max(b[i - 1].1);
    }
    let total = b[b.len() - 1].1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let i = b[..b.len() - 1]
        .iter()
        .position(|&(_, c)| c >= rank)
        .unwrap_or(b.len() - 1);
    if i == b.len() - 1 {
        let highest = b[b.len() - 2].0;
        return Some((highest, (highest, f64::INFINITY)));
    }
    let (end, count) = b[i];
    let (start, below) = if i == 0 {
        if end <= 0.0 {
            return Some((end, (f64::NEG_INFINITY, end)));
        }
        (0.0, 0.0)
    } else {
        b[i - 1]
    };
    let in_bucket = count - below;
    if in_bucket <= 0.0 {
        return Some((end, (start, end)));
    }
    Some((
        start + (end - start) * (rank - below) / in_bucket,
        (start, end),
    ))
}

/// A histogram bucket's `le` label.
pub(crate) fn parse_le(le: &str) -> Option<f64> {
    match le.trim() {
        "+Inf" | "Inf" | "inf" | "+inf" => Some(f64::INFINITY),
        s => s.parse::<f64>().ok().filter(|v| !v.is_nan()),
    }
}

/// A histogram's increase over a time range: cumulative buckets, sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramDelta {
    /// `(le, cumulative count)`, by `le`, the last `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

/// p50/p90/p99 and mean of a latency histogram, ms; null without observations.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LatencyQuantiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    /// `_sum` increase over `_count` increase.
    pub mean: Option<f64>,
    /// Observations (requests, or tokens for inter-token latency): the `_count` increase.
    pub count: f64,
    /// The bucket each quantile's rank fell in, `[lower, upper]` ms (upper null for `+Inf`):
    /// where the true quantile lies. A quantile is only as fine as the engine's buckets
    /// (vLLM's inter-token and per-request TPOT buckets start at 10 ms: every token of a
    /// 2-5 ms step falls in the first, and an interpolated p50 reads 5 ms whatever it was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p50_bucket: Option<QuantileBucket>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p90_bucket: Option<QuantileBucket>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_bucket: Option<QuantileBucket>,
}

/// A histogram bucket's bounds in ms, `(lower, upper]`; `upper` None for the `+Inf` bucket.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct QuantileBucket(pub f64, pub Option<f64>);

impl LatencyQuantiles {
    /// p50, p90 and p99 as a reader should see them ([`show`](Self::show)), `decimals` places.
    pub fn shown(&self, decimals: usize) -> [String; 3] {
        [
            Self::show(self.p50, self.p50_bucket, decimals),
            Self::show(self.p90, self.p90_bucket, decimals),
            Self::show(self.p99, self.p99_bucket, decimals),
        ]
    }

    /// A quantile as a reader should see it: the interpolated value, except where its bucket
    /// says only a bound is known: `≤ upper` in the first bucket (interpolated from 0),
    /// `> lower` in `+Inf`; `-` without one.
    fn show(value: Option<f64>, bucket: Option<QuantileBucket>, decimals: usize) -> String {
        match (value, bucket) {
            (None, _) => "-".into(),
            (Some(_), Some(QuantileBucket(lo, None))) => format!(">{lo:.decimals$}"),
            (Some(_), Some(QuantileBucket(lo, Some(hi)))) if lo <= 0.0 => {
                format!("≤{hi:.decimals$}")
            }
            (Some(v), _) => format!("{v:.decimals$}"),
        }
    }
}

impl HistogramDelta {
    /// From each `_bucket` series' increase (`(le, increase)`, label sets other than `le`
    /// added up by bound) and the `_sum` and `_count` increases.
    pub(crate) fn from_increases(
        buckets: impl IntoIterator<Item = (f64, f64)>,
        sum: f64,
        count: f64,
    ) -> HistogramDelta {
        // Keyed by the bound's bits (bounds are non-negative, so bit order is value order).
        let mut by_le: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
        for (le, v) in buckets {
            by_le.entry(le.to_bits()).or_insert((le, 0.0)).1 += v;
        }
        let mut buckets: Vec<(f64, f64)> = by_le.into_values().collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        HistogramDelta {
            buckets,
            sum,
            count,
        }
    }

    /// `_sum` increase over `_count` increase, ms (of a histogram in seconds); None without
    /// observations.
    pub(crate) fn mean_ms(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count * 1e3)
    }

    pub fn quantile(&self, q: f64) -> Option<f64> {
        histogram_quantile(q, &self.buckets)
    }

    /// Quantiles in ms of a histogram in seconds.
    pub fn quantiles_ms(&self) -> LatencyQuantiles {
        let q = |q: f64| quantile_in_bucket(q, &self.buckets);
        let (p50, p90, p99) = (q(0.5), q(0.9), q(0.99));
        let value = |x: Option<(f64, (f64, f64))>| x.map(|(v, _)| v * 1e3);
        let bucket = |x: Option<(f64, (f64, f64))>| {
            x.map(|(_, (lo, hi))| {
                QuantileBucket(lo.max(0.0) * 1e3, hi.is_finite().then_some(hi * 1e3))
            })
        };
        LatencyQuantiles {
            p50: value(p50),
            p90: value(p90),
            p99: value(p99),
            mean: self.mean_ms(),
            count: self.count,
            p50_bucket: bucket(p50),
            p90_bucket: bucket(p90),
            p99_bucket: bucket(p99),
        }
    }
}

/// Mean and max of a list of values; None when empty.
pub(crate) fn mean_max(v: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
    let (mut n, mut sum, mut max) = (0u64, 0.0, f64::NEG_INFINITY);
    for x in v {
        n += 1;
        sum += x;
        max = max.max(x);
    }
    (n > 0).then(|| (sum / n as f64, max))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn counter_increase_spreads_and_handles_resets() {
        // 100/s for 10 s.
        let pts: Vec<(u64, f64)> = (0..=10).map(|i| (i * S, i as f64 * 100.0)).collect();
        assert_eq!(series_increase(&pts, 0, 10 * S), (1000.0, 10 * S));
        // Half of the interval 2..3 s.
        assert_eq!(series_increase(&pts, 2 * S, 2 * S + S / 2), (50.0, S / 2));
        // Nothing outside the scrapes.
        assert_eq!(series_increase(&pts, 10 * S, 20 * S), (0.0, 0));
        // 1000 -> 40: the counter restarted; 40 counted since.
        let reset = [(0, 900.0), (S, 1000.0), (2 * S, 40.0), (3 * S, 70.0)];
        assert_eq!(
            series_increase(&reset, 0, 3 * S),
            (100.0 + 40.0 + 30.0, 3 * S)
        );
        // Failed scrapes leave gaps: the increase spans the scrapes that succeeded.
        let gaps = [(0, 0.0), (5 * S, 500.0), (6 * S, 600.0)];
        assert_eq!(series_increase(&gaps, 0, 6 * S), (600.0, 6 * S));
    }

    #[test]
    fn gauge_mean_is_time_weighted_and_bridges_slow_scrapes() {
        // 2 for 1 s, then a ramp 2 -> 6 over 2 s: mean over 0..3 s is (2 + 2 * 4) / 3.
        let pts = [(0, 2.0), (S, 2.0), (3 * S, 6.0)];
        let (m, c) = series_mean(&pts, 0, 3 * S).unwrap();
        assert!(close(m, 10.0 / 3.0), "{m}");
        assert_eq!(c, 3 * S);
        // A range inside one interval (no point in it) gets the line there: 1.5..2.5 s.
        let (m, c) = series_mean(&pts, S + S / 2, 2 * S + S / 2).unwrap();
        assert!(close(m, 4.0), "{m}");
        assert_eq!(c, S);
        // Past the last scrape: the covered part only; wholly past it, nothing.
        let (m, c) = series_mean(&pts, 2 * S, 10 * S).unwrap();
        assert!(close(m, 5.0), "{m}");
        assert_eq!(c, S);
        assert_eq!(series_mean(&pts, 4 * S, 10 * S), None);
        // A lone scrape in the range: its value, covering nothing.
        assert_eq!(series_mean(&[(5 * S, 7.0)], 4 * S, 6 * S), Some((7.0, 0)));
        // A NaN pair is skipped.
        let nan = [(0, 1.0), (S, f64::NAN), (2 * S, 3.0), (3 * S, 3.0)];
        assert_eq!(series_mean(&nan, 0, 3 * S), Some((3.0, S)));
    }

    #[test]
    fn counter_rates_handle_restarts() {
        let p = vec![(0, 100.0), (S, 150.0), (2 * S, 250.0), (3 * S, 20.0)];
        assert_eq!(rates(&p), vec![(S, 50.0), (2 * S, 100.0), (3 * S, 20.0)]);
        // From 1 s: +100, then a restart to 20: 120 tokens over 2 s.
        assert_eq!(rate_since(&p, S), Some(60.0));
        // From before the first point: the whole series, 170 over 3 s.
        assert_eq!(rate_since(&p[..3], 0), Some(75.0));
        assert_eq!(rate_since(&p[..1], 0), None);
        assert_eq!(rate_since(&[], 0), None);
    }

    #[test]
    fn label_sets_combine_per_scrape() {
        let a = [(0, 1.0), (2 * S, 3.0)];
        let b = [(0, 10.0), (S, 20.0), (2 * S, 20.0)];
        assert_eq!(
            combine([&a[..], &b[..]], GaugeAgg::Sum),
            vec![(0, 11.0), (S, 20.0), (2 * S, 23.0)]
        );
        assert_eq!(
            combine([&a[..], &b[..]], GaugeAgg::Mean),
            vec![(0, 5.5), (S, 20.0), (2 * S, 11.5)]
        );
    }

    #[test]
    fn quantiles_interpolate_like_prometheus() {
        // 20 observations <= 0.1, 40 in (0.1, 0.2], 40 in (0.2, 0.4].
        let b = [
            (0.1, 20.0),
            (0.2, 60.0),
            (0.4, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert_eq!(histogram_quantile(0.5, &b), Some(0.175));
        assert_eq!(histogram_quantile(0.1, &b), Some(0.05));
        assert!(close(histogram_quantile(0.8, &b).unwrap(), 0.3));
        // Rank in +Inf: the highest finite bound.
        let tail = [(0.1, 10.0), (f64::INFINITY, 20.0)];
        assert_eq!(histogram_quantile(0.9, &tail), Some(0.1));
        assert_eq!(
            histogram_quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]),
            None
        );
        assert_eq!(histogram_quantile(0.5, &[(0.1, 1.0), (0.2, 2.0)]), None);
        // Unsorted input, non-monotonic counts coalesced.
        let b = [(f64::INFINITY, 4.0), (2.0, 3.0), (1.0, 4.0)];
        assert_eq!(histogram_quantile(0.5, &b), Some(0.5));
        // A first bucket with a non-positive bound.
        assert_eq!(
            histogram_quantile(0.1, &[(-1.0, 5.0), (f64::INFINITY, 10.0)]),
            Some(-1.0)
        );
        assert_eq!(histogram_quantile(1.5, &tail), None);
        assert_eq!(parse_le("+Inf"), Some(f64::INFINITY));
        assert_eq!(parse_le("0.25"), Some(0.25));
        assert_eq!(parse_le("x"), None);
    }
}
