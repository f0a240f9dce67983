//! What the probes need of the kernel, as a trait: hardware write watchpoints on a
//! reference count (on one thread, or on every CPU) and on a process's GC state.
//! [`crate::bpf::BpfSampler`] sets real ones; the tests' fake ([`fake`]) keeps what was asked and
//! refuses as the kernel does, so that the schedule is tested without a kernel.

use crate::bpf::{BpfSampler, Breakpoint};

use super::ExactPlan;

/// A watchpoint set through [`Watchpoints`].
pub trait Watch {
    /// Set on every CPU (a slot any thread's write hits) rather than on its thread.
    fn on_every_cpu(&self) -> bool;
}

impl Watch for Breakpoint {
    fn on_every_cpu(&self) -> bool {
        Breakpoint::on_every_cpu(self)
    }
}

/// Setting and removing the probes' watchpoints. Errors carry the kernel's (`os error 28`
/// when no debug register is free: [`no_register`]).
pub trait Watchpoints {
    type Watch: Watch;
    /// Watch writes to the reference count at `addr` on thread `tid`.
    fn watch_refcount(&mut self, tid: i32, addr: u64) -> anyhow::Result<Self::Watch>;
    /// Watch writes to the reference count at `addr` on every CPU (any thread).
    fn watch_refcount_cpus(&mut self, addr: u64) -> anyhow::Result<Self::Watch>;
    fn unwatch_refcount(&mut self, w: Self::Watch);
    /// Watch writes to `gcstate->collecting` at `addr` on thread `tid`.
    fn watch_gc_thread(&mut self, tid: i32, addr: u64) -> anyhow::Result<Self::Watch>;
    fn unwatch_gc_thread(&mut self, w: Self::Watch);
}

impl Watchpoints for BpfSampler {
    type Watch = Breakpoint;
    fn watch_refcount(&mut self, tid: i32, addr: u64) -> anyhow::Result<Breakpoint> {
        BpfSampler::watch_refcount(self, tid, addr)
    }
    fn watch_refcount_cpus(&mut self, addr: u64) -> anyhow::Result<Breakpoint> {
        BpfSampler::watch_refcount_cpus(self, addr)
    }
    fn unwatch_refcount(&mut self, w: Breakpoint) {
        BpfSampler::unwatch_refcount(self, w)
    }
    fn watch_gc_thread(&mut self, tid: i32, addr: u64) -> anyhow::Result<Breakpoint> {
        BpfSampler::watch_gc_thread(self, tid, addr)
    }
    fn unwatch_gc_thread(&mut self, w: Breakpoint) {
        BpfSampler::unwatch_gc_thread(self, w)
    }
}

/// Whether setting a watchpoint failed for want of a free debug register.
pub(super) fn no_register(e: &anyhow::Error) -> bool {
    let s = format!("{e:#}");
    s.contains("No space left") || s.contains("os error 28")
}

/// Set plan `p`'s watchpoints for thread `tid`: on every CPU with `every_cpu` where a slot is
/// free ([`BpfSampler::watch_refcount_cpus`]), else on the thread.
pub(super) fn attach_all<H: Watch>(
    b: &mut dyn Watchpoints<Watch = H>,
    tid: i32,
    p: &ExactPlan,
    every_cpu: bool,
) -> anyhow::Result<Vec<H>> {
    let mut ls = Vec::new();
    for &addr in std::iter::once(&p.refcnt) {
        let set = if every_cpu {
            b.watch_refcount_cpus(addr)
                .or_else(|_| b.watch_refcount(tid, addr))
        } else {
            b.watch_refcount(tid, addr)
        };
        match set {
            Ok(l) => ls.push(l),
            Err(e) => {
                for l in ls {
                    b.unwatch_refcount(l);
                }
                return Err(e);
            }
        }
    }
    Ok(ls)
}

/// A fake kernel for the probes' schedule: it keeps every watchpoint set and refuses one as
/// the kernel does when a thread's debug registers (or the CPUs' slots) are all taken. The
/// unit tests drive the schedule through it, and [`super::replay`] replays call timelines.
pub mod fake {
    use std::collections::BTreeMap;

    use super::{Watch, Watchpoints};

    /// One watchpoint the fake set: on thread `tid` (`None`: on every CPU), at `addr`.
    #[derive(Debug, PartialEq, Eq)]
    pub(crate) struct FakeWatch {
        pub id: u64,
        pub tid: Option<i32>,
        pub addr: u64,
        pub gc: bool,
    }

    impl Watch for FakeWatch {
        fn on_every_cpu(&self) -> bool {
            self.tid.is_none()
        }
    }

    /// Each thread has `registers` debug registers, less those another tool holds
    /// (`held_elsewhere`) and less the watchpoints set on every CPU (each takes one register
    /// of every CPU); `cpu_slots` watchpoints can be set on every CPU at once.
    #[derive(Debug)]
    pub(crate) struct FakeWatchpoints {
        pub registers: usize,
        pub cpu_slots: usize,
        pub held_elsewhere: BTreeMap<i32, usize>,
        /// id → (tid, address, gc) of every watchpoint set now.
        pub live: BTreeMap<u64, (Option<i32>, u64, bool)>,
        /// Every setting and removal, in order: (set, tid, address).
        pub log: Vec<(bool, Option<i32>, u64)>,
        next: u64,
    }

    impl Default for FakeWatchpoints {
        fn default() -> Self {
            FakeWatchpoints {
                registers: 4,
                cpu_slots: 3,
                held_elsewhere: BTreeMap::new(),
                live: BTreeMap::new(),
                log: Vec::new(),
                next: 1,
            }
        }
    }

    impl FakeWatchpoints {
        /// Watchpoints set now on thread `tid` itself (GC's included).
        pub(crate) fn on_thread(&self, tid: i32) -> usize {
            self.live.values().filter(|w| w.0 == Some(tid)).count()
        }
        /// Watchpoints set now on every CPU.
        pub(crate) fn on_cpus(&self) -> usize {
            self.live.values().filter(|w| w.0.is_none()).count()
        }
        /// Whether a write to `addr` by thread `tid` would trap now.
        pub fn watched(&self, tid: i32, addr: u64) -> bool {
            self.live
                .values()
                .any(|&(t, a, gc)| !gc && a == addr && t.is_none_or(|t| t == tid))
        }
        fn set(&mut self, tid: Option<i32>, addr: u64, gc: bool) -> anyhow::Result<FakeWatch> {
            let full = match tid {
                Some(t) => {
                    let other = self.held_elsewhere.get(&t).copied().unwrap_or(0);
                    self.on_thread(t) + self.on_cpus() + other >= self.registers
                }
                None => self.on_cpus() >= self.cpu_slots,
            };
            if full {
                anyhow::bail!("perf_event_open: No space left on device (os error 28)");
            }
            let id = self.next;
            self.next += 1;
            self.live.insert(id, (tid, addr, gc));
            self.log.push((true, tid, addr));
            Ok(FakeWatch { id, tid, addr, gc })
        }
        fn unset(&mut self, w: FakeWatch) {
            assert!(self.live.remove(&w.id).is_some(), "{w:?} removed twice");
            self.log.push((false, w.tid, w.addr));
        }
    }

    impl Watchpoints for FakeWatchpoints {
        type Watch = FakeWatch;
        fn watch_refcount(&mut self, tid: i32, addr: u64) -> anyhow::Result<FakeWatch> {
            self.set(Some(tid), addr, false)
        }
        fn watch_refcount_cpus(&mut self, addr: u64) -> anyhow::Result<FakeWatch> {
            self.set(None, addr, false)
        }
        fn unwatch_refcount(&mut self, w: FakeWatch) {
            self.unset(w)
        }
        fn watch_gc_thread(&mut self, tid: i32, addr: u64) -> anyhow::Result<FakeWatch> {
            self.set(Some(tid), addr, true)
        }
        fn unwatch_gc_thread(&mut self, w: FakeWatch) {
            self.unset(w)
        }
    }
}
