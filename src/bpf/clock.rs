//! The sampling clock: one cpu-clock perf event per CPU running `on_sample`, re-phased at
//! random so that it never keeps step with a target.
//!
//! A cpu-clock event fires on a fixed grid (`hrtimer_forward_now` by its period), and a
//! target that wakes on a timer does too: `time.sleep` up to the next step of a paced loop,
//! a 100 Hz poll. When the target's period is a multiple of the sampling period, each of its
//! bursts meets the samples at the same offset, for as long as both run: a 5 ms step loop
//! sampled at 1 kHz showed 4 samples in 5 s from a thread that ran 65 ms a second in one
//! recording, every sample in the same line in another, and in a third a function that took
//! a fifth of the thread's time never once (so a probe on it was never placed: the
//! `rotating_probes_sid_315` failure). Every [`REPHASE_PERIODS`] periods (at least
//! [`REPHASE_MIN_NS`]) each CPU's event gets a new period drawn around the asked one
//! (`PERF_EVENT_IOC_PERIOD`, which restarts its timer from now): its samples land at offsets
//! spread over any period of the target's.
//!
//! The rate is drawn uniform in ±[`DITHER`] of the asked rate, so the expected number of
//! samples per second of CPU is the asked rate's. A restart drops the part of the current
//! period already run (half a period on average, one sample in 2 × [`REPHASE_PERIODS`]);
//! each sample's weight is scaled by its thread's runtime share
//! ([`crate::sampler::runtime_weight`]), which takes that back with the steal.
//! `ENGINESCOPE_SAMPLE_REPHASE=0` keeps the fixed grid (a measurement, docs/benchmarks.md).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::{perf_event_open_on, Breakpoint, PerfEventAttr, PERF_TYPE_SOFTWARE};

/// `PERF_COUNT_SW_CPU_CLOCK`.
const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
/// `_IOW('$', 4, __u64)`.
const PERF_EVENT_IOC_PERIOD: libc::c_ulong = 0x4008_2404;
/// The drawn rate's spread around the asked rate (a fraction of it, each way).
pub(crate) const DITHER: f64 = 0.25;
/// Periods between two re-phasings of one CPU's clock, on average.
pub(crate) const REPHASE_PERIODS: u64 = 32;
/// The shortest time between two re-phasings of one CPU's clock (each costs an
/// inter-processor call to that CPU).
pub(crate) const REPHASE_MIN_NS: u64 = 20_000_000;
/// The kernel's floor for a cpu-clock period (`perf_swevent_start_hrtimer`).
const MIN_PERIOD_NS: u64 = 10_000;

struct CpuClock {
    fd: OwnedFd,
    /// When it is re-phased next (monotonic ns).
    due_ns: u64,
}

/// The sampling events of every online CPU; dropping it closes them.
pub(super) struct SampleClock {
    cpus: Vec<CpuClock>,
    period_ns: u64,
    rephase: bool,
    rng: u64,
    /// Re-phasings made, and refused by the kernel (the event kept its period).
    pub rephases: u64,
    pub rephase_errors: u64,
}

impl SampleClock {
    /// A cpu-clock event of `period_ns` on each CPU of `cpus`, each running `prog_fd`.
    pub(super) fn open(prog_fd: RawFd, cpus: &[u32], period_ns: u64) -> std::io::Result<Self> {
        let period_ns = period_ns.max(MIN_PERIOD_NS);
        let attr = PerfEventAttr {
            type_: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: PERF_COUNT_SW_CPU_CLOCK,
            sample_period: period_ns,
            sample_type: 0,
            read_format: 0,
            // Enabled from the start; nothing is written to a buffer (the program reads
            // what it needs itself).
            flags: 0,
            wakeup_events: 0,
            bp_type: 0,
            bp_addr: 0,
            bp_len: 0,
            rest: [0; 7],
        };
        let now = crate::sys::monotonic_ns();
        let mut rng = crate::sys::random_seed();
        let mut out = Vec::with_capacity(cpus.len());
        for &cpu in cpus {
            let fd = perf_event_open_on(&attr, -1, cpu as i32).map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("opening a cpu-clock perf event on CPU {cpu}: {e}"),
                )
            })?;
            Breakpoint::set_bpf(&fd, prog_fd)?;
            let due_ns = now + interval_ns(period_ns, &mut rng);
            out.push(CpuClock { fd, due_ns });
        }
        Ok(SampleClock {
            cpus: out,
            period_ns,
            rephase: std::env::var_os("ENGINESCOPE_SAMPLE_REPHASE").is_none_or(|v| v != "0"),
            rng,
            rephases: 0,
            rephase_errors: 0,
        })
    }

    /// Give each CPU whose turn has come a new period, drawn around the asked one, from now.
    pub(super) fn rephase(&mut self, now_ns: u64) {
        if !self.rephase {
            return;
        }
        for c in &mut self.cpus {
            if now_ns < c.due_ns {
                continue;
            }
            let mut period = drawn_period_ns(self.period_ns, &mut self.rng);
            // SAFETY: an ioctl on our own perf event descriptor reading the u64 we own.
            let rc = unsafe {
                libc::ioctl(
                    c.fd.as_raw_fd(),
                    PERF_EVENT_IOC_PERIOD as _,
                    &mut period as *mut u64,
                )
            };
            if rc == 0 {
                self.rephases += 1;
            } else {
                self.rephase_errors += 1;
            }
            c.due_ns = now_ns + interval_ns(self.period_ns, &mut self.rng);
        }
    }
}

/// A period whose rate is uniform in ±[`DITHER`] of `1 / period_ns`'s.
fn drawn_period_ns(period_ns: u64, rng: &mut u64) -> u64 {
    let rate_factor = 1.0 + DITHER * (2.0 * crate::sys::unit_random(rng) - 1.0);
    ((period_ns as f64 / rate_factor) as u64).max(MIN_PERIOD_NS)
}

/// Time to the next re-phasing: [`REPHASE_PERIODS`] periods (at least [`REPHASE_MIN_NS`]),
/// drawn between half and one and a half of it, so that it keeps no step with the
/// recording loop either.
fn interval_ns(period_ns: u64, rng: &mut u64) -> u64 {
    let mean = (REPHASE_PERIODS * period_ns).max(REPHASE_MIN_NS);
    (mean as f64 * (0.5 + crate::sys::unit_random(rng))) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_rates_average_the_asked_rate_within_the_dither() {
        let mut rng = 12345;
        let period = 1_000_000u64;
        let n = 100_000;
        let mut rate_sum = 0.0;
        for _ in 0..n {
            let p = drawn_period_ns(period, &mut rng);
            let f = p as f64 / period as f64;
            assert!(
                (1.0 / (1.0 + DITHER) - 1e-6..=1.0 / (1.0 - DITHER) + 1e-6).contains(&f),
                "{p}"
            );
            rate_sum += 1e9 / p as f64;
        }
        let mean_rate = rate_sum / n as f64;
        assert!((mean_rate - 1000.0).abs() < 2.0, "{mean_rate}");
    }

    #[test]
    fn rephase_intervals_hold_many_periods_and_at_least_the_floor() {
        let mut rng = 7;
        for period in [100_000u64, 1_000_000, 10_101_010] {
            let mean = (REPHASE_PERIODS * period).max(REPHASE_MIN_NS);
            for _ in 0..1000 {
                let i = interval_ns(period, &mut rng);
                assert!(i >= mean / 2 && i <= mean * 3 / 2, "{period}: {i}");
            }
        }
    }

    #[test]
    fn the_kernel_floor_holds_at_any_rate() {
        let mut rng = 3;
        assert!(drawn_period_ns(1, &mut rng) >= MIN_PERIOD_NS);
    }
}
