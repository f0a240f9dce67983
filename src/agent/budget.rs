//! Bounded label cardinality: which label sets get a series of their own.
//!
//! A metric labelled by thread name or function could grow without end (threads named
//! `Thread-123`, every function of a large program). A [`Budget`] keeps at most `cap` keys
//! with series of their own; the rest add into an aggregate series (`thread="_other"`,
//! `function="_other"`) that the caller keeps per coarser key. Which keys: the busiest. Each
//! key's activity (seconds of CPU, say) is averaged over about a minute; a key without a
//! series replaces the least busy kept key when it has been at least twice as busy and that key
//! has had its series for `min_residency` ticks (hysteresis: series do not flap). Keys idle for
//! `idle_ticks` lose their series, which frees room. Every key that loses its series is returned
//! to the caller, which removes it from its metric families (Prometheus marks it stale).
//!
//! Memory: `cap` kept keys plus at most `max_candidates` keys waiting, whatever the input.

use std::collections::HashMap;
use std::hash::Hash;

/// Limits and timing, in ticks (the agent ticks once per poll, 1 s by default).
#[derive(Debug, Clone, Copy)]
pub struct BudgetConfig {
    /// Most keys with series of their own.
    pub cap: usize,
    /// A kept key with no activity for this many ticks loses its series.
    pub idle_ticks: u64,
    /// A kept key keeps its series at least this long before a busier key may take it.
    pub min_residency: u64,
    /// Most keys remembered while waiting for room.
    pub max_candidates: usize,
}

impl BudgetConfig {
    pub fn new(cap: usize) -> Self {
        BudgetConfig {
            cap,
            idle_ticks: 600,
            min_residency: 300,
            max_candidates: 4 * cap + 256,
        }
    }
}

/// Weight of the previous average at each tick: a time constant of about 60 ticks.
const DECAY: f64 = 0.983_471_453_821_617; // exp(-1/60)

#[derive(Debug, Clone, Copy, Default)]
struct Activity {
    /// This tick's activity.
    window: f64,
    /// Exponentially weighted average of past ticks' activity.
    avg: f64,
    /// Tick of the last activity (or of admission).
    last_active: u64,
    /// Tick when the key got its series.
    since: u64,
}

impl Activity {
    fn roll(&mut self, tick: u64) {
        if self.window > 0.0 {
            self.last_active = tick;
        }
        self.avg = self.avg * DECAY + self.window * (1.0 - DECAY);
        self.window = 0.0;
    }
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct Budget<K> {
    cfg: BudgetConfig,
    kept: HashMap<K, Activity>,
    waiting: HashMap<K, Activity>,
    tick: u64,
    /// Activity that went to the aggregate series since the start (for tests and a gauge).
    pub overflowed: u64,
}

impl<K: Clone + Eq + Hash> Budget<K> {
    pub fn new(cfg: BudgetConfig) -> Self {
        Budget {
            cfg,
            kept: HashMap::new(),
            waiting: HashMap::new(),
            tick: 0,
            overflowed: 0,
        }
    }

    /// Note `activity` for `key`; true when the key has its own series (use it), false when
    /// its activity goes to the aggregate.
    pub(crate) fn admit(&mut self, key: &K, activity: f64) -> bool {
        let activity = if activity.is_finite() {
            activity.max(0.0)
        } else {
            0.0
        };
        if let Some(a) = self.kept.get_mut(key) {
            a.window += activity;
            return true;
        }
        if self.kept.len() < self.cfg.cap {
            self.waiting.remove(key);
            self.kept.insert(
                key.clone(),
                Activity {
                    window: activity,
                    last_active: self.tick,
                    since: self.tick,
                    ..Default::default()
                },
            );
            return true;
        }
        self.overflowed += 1;
        if let Some(a) = self.waiting.get_mut(key) {
            a.window += activity;
        } else if self.waiting.len() < self.cfg.max_candidates {
            self.waiting.insert(
                key.clone(),
                Activity {
                    window: activity,
                    last_active: self.tick,
                    ..Default::default()
                },
            );
        }
        false
    }

    /// Whether `key` has a series of its own now.
    #[cfg(test)]
    pub fn is_kept(&self, key: &K) -> bool {
        self.kept.contains_key(key)
    }

    #[cfg(test)]
    pub(crate) fn kept_len(&self) -> usize {
        self.kept.len()
    }

    /// End a tick: average activity, drop idle keys, let busier waiting keys in. Returns the
    /// keys that lost their series.
    pub fn tick(&mut self) -> Vec<K> {
        self.tick += 1;
        let now = self.tick;
        for a in self.kept.values_mut().chain(self.waiting.values_mut()) {
            a.roll(now);
        }
        let idle = self.cfg.idle_ticks;
        let mut lost: Vec<K> = self
            .kept
            .iter()
            .filter(|(_, a)| now.saturating_sub(a.last_active) >= idle)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &lost {
            self.kept.remove(k);
        }
        self.waiting
            .retain(|_, a| now.saturating_sub(a.last_active) < idle);
        // Let the busiest waiting keys in: into free room, else in place of a kept key that is
        // less than half as busy and has had its series long enough. A few per tick.
        for _ in 0..4 {
            let Some((best, best_avg)) = self
                .waiting
                .iter()
                .max_by(|a, b| a.1.avg.total_cmp(&b.1.avg))
                .map(|(k, a)| (k.clone(), a.avg))
            else {
                break;
            };
            if best_avg <= 0.0 {
                break;
            }
            if self.kept.len() >= self.cfg.cap {
                let min_res = self.cfg.min_residency;
                let victim = self
                    .kept
                    .iter()
                    .filter(|(_, a)| now.saturating_sub(a.since) >= min_res)
                    .min_by(|a, b| a.1.avg.total_cmp(&b.1.avg))
                    .map(|(k, a)| (k.clone(), a.avg));
                match victim {
                    Some((v, v_avg)) if best_avg > 2.0 * v_avg => {
                        self.kept.remove(&v);
                        lost.push(v);
                    }
                    _ => break,
                }
            }
            if let Some(mut a) = self.waiting.remove(&best) {
                a.since = now;
                a.last_active = now;
                self.kept.insert(best, a);
            }
        }
        lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_come_until_full_then_aggregate() {
        let mut b = Budget::new(BudgetConfig::new(2));
        assert!(b.admit(&"a", 1.0));
        assert!(b.admit(&"b", 1.0));
        assert!(!b.admit(&"c", 1.0));
        assert!(b.admit(&"a", 1.0));
        assert_eq!(b.kept_len(), 2);
        assert_eq!(b.overflowed, 1);
    }

    #[test]
    fn busier_key_takes_the_place_of_an_idle_one_with_hysteresis() {
        let cfg = BudgetConfig {
            cap: 2,
            idle_ticks: 1000,
            min_residency: 10,
            max_candidates: 8,
        };
        let mut b = Budget::new(cfg);
        let mut lost_all = Vec::new();
        for t in 0..200 {
            b.admit(&"busy", 1.0);
            b.admit(&"quiet", 0.01);
            // "hot" starts after the others and is far busier than "quiet".
            if t >= 5 {
                b.admit(&"hot", 1.0);
            }
            lost_all.extend(b.tick());
        }
        assert!(b.is_kept(&"busy") && b.is_kept(&"hot"), "{b:?}");
        assert_eq!(lost_all, vec!["quiet"], "one swap, no flapping");
        // Equal activity never swaps (needs twice as busy).
        let mut b = Budget::new(cfg);
        let mut lost = Vec::new();
        for _ in 0..200 {
            for k in ["x", "y", "z"] {
                b.admit(&k, 1.0);
            }
            lost.extend(b.tick());
        }
        assert!(lost.is_empty());
    }

    #[test]
    fn idle_keys_lose_their_series_and_memory_is_bounded() {
        let cfg = BudgetConfig {
            cap: 3,
            idle_ticks: 5,
            min_residency: 0,
            max_candidates: 10,
        };
        let mut b = Budget::new(cfg);
        // Thousands of short-lived keys (threads named Thread-N): never more than cap + waiting.
        for t in 0..2_000u32 {
            b.admit(&t, 1.0);
            b.tick();
            assert!(b.kept.len() <= 3 && b.waiting.len() <= 10);
        }
        // Everything idle: all go.
        let mut lost = 0;
        for _ in 0..10 {
            lost += b.tick().len();
        }
        assert_eq!(b.kept_len(), 0);
        assert!(lost >= 3);
        assert!(b.waiting.is_empty());
    }
}
