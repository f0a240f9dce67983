//! Small helpers over scraped metric points: counters as rates, gauges as last values, several
//! label sets of one family summed. (The vLLM module grows fuller ones; these are what the
//! dashboard needs.)

/// Generated tokens (counter): shown as tokens/s.
pub const GEN_TOKENS: &str = "vllm:generation_tokens_total";
/// KV-cache usage, 0..1 (gauge); older vLLM versions call it `gpu_cache_usage_perc`.
pub const KV_CACHE: [&str; 2] = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];
/// Requests being run (gauge).
pub const RUNNING: &str = "vllm:num_requests_running";
/// Requests queued (gauge).
pub const WAITING: &str = "vllm:num_requests_waiting";

/// Several series of one family (one per label set) summed into one: at every time any of
/// them was scraped, the sum of each one's latest value then. Series not scraped yet add
/// nothing. Points of each series must be in time order.
pub fn sum_series(series: &[Vec<(u64, f64)>]) -> Vec<(u64, f64)> {
    if series.len() == 1 {
        return series[0].clone();
    }
    let mut times: Vec<u64> = series.iter().flatten().map(|&(t, _)| t).collect();
    times.sort_unstable();
    times.dedup();
    let mut next = vec![0usize; series.len()];
    let mut last: Vec<Option<f64>> = vec![None; series.len()];
    let mut out = Vec::with_capacity(times.len());
    for t in times {
        for (i, s) in series.iter().enumerate() {
            while let Some(&(pt, v)) = s.get(next[i]) {
                if pt > t {
                    break;
                }
                last[i] = Some(v);
                next[i] += 1;
            }
        }
        out.push((t, last.iter().flatten().sum()));
    }
    out
}

/// Increase of a counter from one point to the next; a drop is a restart from 0.
fn increase(prev: f64, cur: f64) -> f64 {
    if cur >= prev {
        cur - prev
    } else {
        cur
    }
}

/// Per-second rate of a counter between consecutive points, at the later point's time.
pub fn rates(points: &[(u64, f64)]) -> Vec<(u64, f64)> {
    points
        .windows(2)
        .filter(|w| w[1].0 > w[0].0)
        .map(|w| {
            let dt = (w[1].0 - w[0].0) as f64 / 1e9;
            (w[1].0, increase(w[0].1, w[1].1) / dt)
        })
        .collect()
}

/// Average per-second rate of a counter from the last point at or before `from_ns` (or the
/// first after it) to the last point; `None` with fewer than two points.
pub fn rate_since(points: &[(u64, f64)], from_ns: u64) -> Option<f64> {
    let start = points
        .partition_point(|&(t, _)| t <= from_ns)
        .saturating_sub(1);
    let span = points.get(start..)?;
    let (first, last) = (span.first()?, span.last()?);
    if last.0 <= first.0 {
        return None;
    }
    let inc: f64 = span.windows(2).map(|w| increase(w[0].1, w[1].1)).sum();
    Some(inc / ((last.0 - first.0) as f64 / 1e9))
}

/// The latest value.
pub fn last_value(points: &[(u64, f64)]) -> Option<f64> {
    points.last().map(|&(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

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
        assert_eq!(last_value(&p), Some(20.0));
    }

    #[test]
    fn label_sets_sum_with_their_latest_values() {
        let a = vec![(0, 1.0), (2 * S, 3.0)];
        let b = vec![(S, 10.0), (2 * S, 20.0)];
        assert_eq!(
            sum_series(&[a, b]),
            vec![(0, 1.0), (S, 11.0), (2 * S, 23.0)]
        );
    }
}
