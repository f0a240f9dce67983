//! The backend without BPF: poll each target from user space through the same CPython reader
//! (`process_vm_readv`), at a lower rate. At each tick every thread's Python stack is read, and
//! the CPU time the kernel charged to the thread since the previous tick
//! (`/proc/PID/task/TID/schedstat`, nanoseconds) becomes a sample of that weight at that stack;
//! the rest of the tick becomes an off-CPU interval at that stack. So per-thread on/off-CPU
//! totals are exact, and their attribution to stacks is sampled at the tick rate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::target::Target;
use super::{monotonic_ns, Pipeline};
use crate::record::{flags, ThreadInfo};

/// Highest rate the memory backend attempts; each tick reads every thread's stack.
pub const MAX_RATE_HZ: u32 = 250;

/// Nanoseconds the thread has run on a CPU (first field of schedstat).
fn thread_cpu_ns(pid: i32, tid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

pub fn run(
    targets: &mut [Target],
    pipe: &mut Pipeline,
    rate_hz: u32,
    deadline: Option<Instant>,
    stop: &AtomicBool,
) -> anyhow::Result<String> {
    let period = Duration::from_nanos(1_000_000_000 / rate_hz.max(1) as u64);
    let mut next = Instant::now();
    let mut known: HashMap<(i32, i32), (String, Option<String>)> = HashMap::new();
    // (thread CPU ns, monotonic ns) at the previous tick
    let mut last: HashMap<(i32, i32), (u64, u64)> = HashMap::new();
    let mut last_flush = Instant::now();
    let mut last_prune = Instant::now();
    let no_probes = super::probes::Probes::new(Vec::new(), 1, true);
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok("stopped by signal".into());
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok("duration reached".into());
        }
        let mut any_alive = false;
        for t in targets.iter_mut() {
            if !crate::procinfo::is_running(t.pid) {
                continue;
            }
            let Ok(snap) = t.proc.snapshot() else {
                continue;
            };
            any_alive = true;
            let mut tstates: Vec<u64> = snap.threads.iter().map(|th| th.tstate).collect();
            tstates.sort_unstable();
            if let Some(by_tstate) = t.python_names_by_tstate(&tstates) {
                // Threads keep their last name when they leave `threading`'s registry.
                for th in &snap.threads {
                    if let (Some(tid), Some(n)) = (th.tid, by_tstate.get(&th.tstate)) {
                        t.python_names.insert(tid, n.clone());
                    }
                }
                let alive: std::collections::HashSet<i32> =
                    snap.threads.iter().filter_map(|th| th.tid).collect();
                t.python_names.retain(|tid, _| alive.contains(tid));
            }
            for th in snap.threads {
                let Some(tid) = th.tid else { continue };
                let Some(cpu) = thread_cpu_ns(t.pid, tid) else {
                    continue;
                };
                let now = monotonic_ns();
                let key = (t.pid, tid);
                let names = (th.os_name.clone(), t.python_names.get(&tid).cloned());
                if known.get(&key) != Some(&names) {
                    known.insert(key, names.clone());
                    pipe.writer.thread(&ThreadInfo {
                        pid: t.pid,
                        tid,
                        name: names.0,
                        t_ns: now.saturating_sub(pipe.start_ns),
                        python_name: names.1,
                    })?;
                }
                let stack = pipe.writer.intern_stack(&th.frames)?;
                let Some((cpu0, t0)) = last.insert(key, (cpu, now)) else {
                    continue;
                };
                let wall = now.saturating_sub(t0);
                let on = cpu.saturating_sub(cpu0).min(wall);
                if on > 0 {
                    let mut fl = 0;
                    if th.holds_gil {
                        fl |= flags::GIL;
                    }
                    if th.gc_collecting {
                        fl |= flags::GC;
                    }
                    if th.error.is_some() {
                        fl |= flags::PARTIAL;
                    }
                    pipe.sample_weighted(t.pid, tid, now, stack, fl, on)?;
                }
                if wall > on {
                    pipe.offcpu_interval(t.pid, tid, now - (wall - on), wall - on, stack)?;
                }
            }
        }
        if !any_alive {
            return Ok("all targets exited".into());
        }
        if last_flush.elapsed() >= Duration::from_millis(200) {
            last_flush = Instant::now();
            pipe.writer.flush()?;
            pipe.periodic(&|p: &Pipeline| super::collect_counters(None, targets, p, &no_probes))?;
        }
        if last_prune.elapsed() >= Duration::from_secs(5) {
            // Threads that exited: forget them (threads may come and go for hours).
            last_prune = Instant::now();
            let gone = |&(pid, tid): &(i32, i32)| {
                !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
            };
            known.retain(|k, _| !gone(k));
            last.retain(|k, _| !gone(k));
        }
        next += period;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
}
