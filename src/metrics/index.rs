//! [`MetricIndex`]: a recording's scraped points by engine and sample name, with the family
//! lookups every view uses (rates, gauges, histogram quantiles, prefix-cache hit rate).

use std::collections::BTreeMap;

use super::maths::{combine, parse_le, series_increase, HistogramDelta};
use super::names::{self, Family};
use crate::record::Recording;

/// One series' points in time order.
struct Points<'r> {
    le: Option<&'r str>,
    pts: Vec<(u64, f64)>,
}

/// A recording's metric points by engine and sample name.
pub struct MetricIndex<'r> {
    by_engine: BTreeMap<String, BTreeMap<&'r str, Vec<Points<'r>>>>,
}

/// Increase of a counter over a time range.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Increase {
    /// Summed over the family's label sets.
    pub value: f64,
    /// ns of the range covered by scrape intervals (the most any label set covered).
    pub covered_ns: u64,
}

impl Increase {
    /// Per second over the covered time; None when nothing covered the range.
    pub fn rate(&self) -> Option<f64> {
        (self.covered_ns > 0).then(|| self.value / (self.covered_ns as f64 / 1e9))
    }
}

/// How the index names engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// One entry per engine id (every data-parallel rank together).
    Engines,
    /// Data-parallel ranks apart: an engine whose series carry vLLM's `engine` label with
    /// more than one value gets an entry per rank, named `<id>/dp<rank>`.
    Ranks,
}

/// The name of one DP rank of an engine in a [`Split::Ranks`] index.
pub(crate) fn rank_id(engine: &str, rank: &str) -> String {
    format!("{engine}/dp{rank}")
}

impl<'r> MetricIndex<'r> {
    /// Every engine, its DP ranks together.
    pub fn new(rec: &'r Recording) -> Self {
        Self::with_split(rec, Split::Engines)
    }

    pub(crate) fn with_split(rec: &'r Recording, split: Split) -> Self {
        // Engines with more than one DP rank.
        let mut ranks: BTreeMap<&str, std::collections::BTreeSet<&str>> = BTreeMap::new();
        if split == Split::Ranks {
            for s in &rec.series {
                if let Some(r) = s.labels.get("engine") {
                    ranks.entry(s.engine.as_str()).or_default().insert(r);
                }
            }
        }
        // Series by id; a series record written twice keeps its first description.
        let mut slots: BTreeMap<u32, (String, &'r str, Points<'r>)> = BTreeMap::new();
        for s in &rec.series {
            if slots.contains_key(&s.id) {
                continue;
            }
            let key = match s.labels.get("engine") {
                Some(r) if ranks.get(s.engine.as_str()).is_some_and(|v| v.len() > 1) => {
                    rank_id(&s.engine, r)
                }
                _ => s.engine.clone(),
            };
            slots.insert(
                s.id,
                (
                    key,
                    s.name.as_str(),
                    Points {
                        le: s.labels.get("le").map(String::as_str),
                        pts: Vec::new(),
                    },
                ),
            );
        }
        for m in &rec.metrics {
            if let Some((_, _, p)) = slots.get_mut(&m.series) {
                p.pts.push((m.t_ns, m.value));
            }
        }
        let mut by_engine: BTreeMap<String, BTreeMap<&'r str, Vec<Points<'r>>>> = BTreeMap::new();
        for (_, (engine, name, mut p)) in slots {
            p.pts.sort_by_key(|&(t, _)| t);
            by_engine
                .entry(engine)
                .or_default()
                .entry(name)
                .or_default()
                .push(p);
        }
        MetricIndex { by_engine }
    }

    /// Engines that have at least one series, by id.
    pub fn engines(&self) -> impl Iterator<Item = &str> + '_ {
        self.by_engine.keys().map(String::as_str)
    }

    fn series(&self, engine: &str, name: &str) -> &[Points<'r>] {
        self.by_engine
            .get(engine)
            .and_then(|m| m.get(name))
            .map_or(&[], Vec::as_slice)
    }

    /// The spelling of `family` this engine's scrapes use (`suffix` for a histogram's
    /// `_bucket`), newest first.
    pub fn resolve(&self, engine: &str, family: &Family, suffix: &str) -> Option<&'static str> {
        family.resolve(|n| !self.series(engine, &format!("{n}{suffix}")).is_empty())
    }

    /// Whether the engine has any series of the family.
    pub fn has(&self, engine: &str, family: &Family) -> bool {
        self.resolve(engine, family, "").is_some()
            || self.resolve(engine, family, "_bucket").is_some()
    }

    /// Distinct scrape times of the engine (any series), in order.
    pub fn scrape_times(&self, engine: &str) -> Vec<u64> {
        let mut t: Vec<u64> = self
            .by_engine
            .get(engine)
            .into_iter()
            .flat_map(|m| m.values())
            .flatten()
            .flat_map(|p| p.pts.iter().map(|&(t, _)| t))
            .collect();
        t.sort_unstable();
        t.dedup();
        t
    }

    /// Distinct scrape times of the engine (any series).
    pub fn scrapes(&self, engine: &str) -> usize {
        self.scrape_times(engine).len()
    }

    /// Increase of a counter within `[t0, t1)`, summed over its label sets; None when the
    /// engine has no such series.
    pub fn increase(&self, engine: &str, family: &Family, t0: u64, t1: u64) -> Option<Increase> {
        let series = self.series(engine, self.resolve(engine, family, "")?);
        let mut out = Increase::default();
        for p in series {
            let (v, c) = series_increase(&p.pts, t0, t1);
            out.value += v;
            out.covered_ns = out.covered_ns.max(c);
        }
        Some(out)
    }

    /// A counter's rate per second within `[t0, t1)`.
    pub fn rate(&self, engine: &str, family: &Family, t0: u64, t1: u64) -> Option<f64> {
        self.increase(engine, family, t0, t1)?.rate()
    }

    /// A gauge's value at each scrape, its label sets combined by the family's `agg`, in
    /// time order.
    pub fn gauge(&self, engine: &str, family: &Family) -> Vec<(u64, f64)> {
        let Some(name) = self.resolve(engine, family, "") else {
            return Vec::new();
        };
        combine(
            self.series(engine, name).iter().map(|p| p.pts.as_slice()),
            family.agg,
        )
    }

    /// A histogram's bucket, sum and count increases within `[t0, t1)`, summed over label
    /// sets other than `le`; None when the engine has no buckets for the family.
    pub fn histogram(
        &self,
        engine: &str,
        family: &Family,
        t0: u64,
        t1: u64,
    ) -> Option<HistogramDelta> {
        let base = self.resolve(engine, family, "_bucket")?;
        let buckets = self
            .series(engine, &format!("{base}_bucket"))
            .iter()
            .filter_map(|p| Some((p.le.and_then(parse_le)?, series_increase(&p.pts, t0, t1).0)));
        let inc = |suffix: &str| {
            self.series(engine, &format!("{base}_{suffix}"))
                .iter()
                .map(|p| series_increase(&p.pts, t0, t1).0)
                .sum::<f64>()
        };
        Some(HistogramDelta::from_increases(
            buckets,
            inc("sum"),
            inc("count"),
        ))
    }

    /// Prefix-cache hits over queries (tokens) within `[t0, t1)`; None without queries. An
    /// engine without the counters (vLLM V0) gives its hit-rate gauge's last value in the
    /// range (a rate since the engine started; negative means prefix caching is off).
    pub fn prefix_cache_hit_rate(&self, engine: &str, t0: u64, t1: u64) -> Option<f64> {
        let queries = self.increase(engine, &names::PREFIX_QUERIES, t0, t1);
        let hits = self.increase(engine, &names::PREFIX_HITS, t0, t1);
        match (queries, hits) {
            (Some(q), Some(h)) if q.value > 0.0 => Some(h.value / q.value),
            (Some(_), _) => None,
            (None, _) => self
                .gauge(engine, &names::PREFIX_HIT_RATE_V0)
                .iter()
                .rev()
                .find(|&&(t, _)| (t0..t1).contains(&t))
                .map(|&(_, v)| v)
                .filter(|v| (0.0..=1.0).contains(v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{MetricPoint, MetricSeries};

    const S: u64 = 1_000_000_000;

    fn add(rec: &mut Recording, engine: &str, name: &str, labels: &[(&str, &str)], pts: &[f64]) {
        let id = rec.series.len() as u32;
        rec.series.push(MetricSeries {
            id,
            engine: engine.into(),
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            kind: String::new(),
        });
        for (i, &value) in pts.iter().enumerate() {
            rec.metrics.push(MetricPoint {
                t_ns: i as u64 * S,
                series: id,
                value,
            });
        }
    }

    #[test]
    fn index_sums_label_sets_and_reads_older_names() {
        let mut rec = Recording::default();
        let ramp = |k: f64| (0..=4).map(|t| k * t as f64).collect::<Vec<_>>();
        add(
            &mut rec,
            "engine0",
            names::RUNNING.name,
            &[("engine", "0")],
            &[1.0; 5],
        );
        add(
            &mut rec,
            "engine0",
            names::RUNNING.name,
            &[("engine", "1")],
            &[2.0; 5],
        );
        add(
            &mut rec,
            "engine0",
            names::GENERATION_TOKENS.name,
            &[("engine", "0")],
            &ramp(10.0),
        );
        add(
            &mut rec,
            "engine0",
            names::GENERATION_TOKENS.name,
            &[("engine", "1")],
            &ramp(30.0),
        );
        // An older vLLM: the KV gauge under its earlier name, on two ranks.
        add(
            &mut rec,
            "engine0",
            "vllm:gpu_cache_usage_perc",
            &[("engine", "0")],
            &[0.2; 5],
        );
        add(
            &mut rec,
            "engine0",
            "vllm:gpu_cache_usage_perc",
            &[("engine", "1")],
            &[0.6; 5],
        );
        // Both prefix-cache spellings (a version in transition): the current one wins.
        add(
            &mut rec,
            "engine0",
            "vllm:prefix_cache_queries_total",
            &[],
            &ramp(100.0),
        );
        add(
            &mut rec,
            "engine0",
            "vllm:prefix_cache_hits_total",
            &[],
            &ramp(25.0),
        );
        add(
            &mut rec,
            "engine0",
            "vllm:gpu_prefix_cache_queries_total",
            &[],
            &ramp(1.0),
        );
        add(
            &mut rec,
            "engine0",
            "vllm:gpu_prefix_cache_hits_total",
            &[],
            &ramp(1.0),
        );
        // V0: only the hit-rate gauge.
        add(
            &mut rec,
            "v0",
            "vllm:gpu_prefix_cache_hit_rate",
            &[],
            &[0.1, 0.2, 0.3],
        );
        add(
            &mut rec,
            "off",
            "vllm:gpu_prefix_cache_hit_rate",
            &[],
            &[-1.0],
        );

        let ix = MetricIndex::new(&rec);
        assert_eq!(ix.engines().collect::<Vec<_>>(), ["engine0", "off", "v0"]);
        assert_eq!(ix.scrapes("engine0"), 5);
        assert_eq!(ix.gauge("engine0", &names::RUNNING)[0], (0, 3.0));
        let kv = ix.gauge("engine0", &names::KV_CACHE_USAGE);
        assert!((kv[0].1 - 0.4).abs() < 1e-12, "{kv:?}");
        assert_eq!(
            ix.rate("engine0", &names::GENERATION_TOKENS, 0, 4 * S),
            Some(40.0)
        );
        assert_eq!(ix.rate("engine0", &names::PROMPT_TOKENS, 0, 4 * S), None);
        assert_eq!(
            ix.rate("engine1", &names::GENERATION_TOKENS, 0, 4 * S),
            None
        );
        assert_eq!(ix.prefix_cache_hit_rate("engine0", 0, 4 * S), Some(0.25));
        assert_eq!(ix.prefix_cache_hit_rate("v0", 0, 2 * S), Some(0.2));
        assert_eq!(ix.prefix_cache_hit_rate("off", 0, 2 * S), None);

        // Ranks apart.
        let r = MetricIndex::with_split(&rec, Split::Ranks);
        assert_eq!(
            r.engines().collect::<Vec<_>>(),
            ["engine0", "engine0/dp0", "engine0/dp1", "off", "v0"]
        );
        assert_eq!(
            r.rate("engine0/dp1", &names::GENERATION_TOKENS, 0, 4 * S),
            Some(30.0)
        );
        assert_eq!(r.gauge("engine0/dp0", &names::KV_CACHE_USAGE)[0], (0, 0.2));
    }
}
