//! The lowest layer: the clock, facts about this host, and the stop token. Everything else may
//! use it; it uses nothing of the crate, so no import cycle can go through it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of every event time in a recording (the BPF
/// programs' `bpf_ktime_get_ns`, the scraper's points, `Meta::start_mono_ns`).
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CPU time of the calling thread, ns (`CLOCK_THREAD_CPUTIME_ID`): what it ran, not what it
/// waited on the run queue.
pub(crate) fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Run the calling thread under `SCHED_FIFO` at the lowest real-time priority, with
/// `SCHED_RESET_ON_FORK` (threads it starts later run as normal ones). For the recording loop,
/// which must drain the ring buffer on time: measured on a 2-CPU machine under a real vLLM
/// engine (whose EngineCore spins on sched_yield), the loop at normal priority, even at nice
/// -10, waited 0.3-2.5 s at a time on the run queue (`/proc/thread-self/schedstat`), filling
/// the ring (8,855 events lost in 40 s); as SCHED_FIFO 1 no wait over 50 ms. The loop sleeps
/// between batches and its batches are bounded, and the kernel's real-time throttling keeps 5%
/// of each CPU for normal tasks whatever it does. `ENGINESCOPE_NO_REALTIME=1` leaves the
/// thread as it is. Err (no CAP_SYS_NICE, a container without real-time runtime) says why.
pub(crate) fn realtime_this_thread() -> Result<(), String> {
    if std::env::var_os("ENGINESCOPE_NO_REALTIME").is_some() {
        return Err("ENGINESCOPE_NO_REALTIME is set".into());
    }
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler on the calling thread (0) with a valid sched_param.
    let rc = unsafe {
        libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().to_string())
    }
}

/// The CPU affinity of thread `tid` (0 = the calling thread).
pub(crate) fn affinity(tid: i32) -> std::io::Result<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain data; all zeros is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity writes at most `size_of::<cpu_set_t>()` bytes into `set`.
    let rc =
        unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc == 0 {
        Ok(set)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Set the CPU affinity of thread `tid` (0 = the calling thread).
pub(crate) fn set_affinity(tid: i32, set: &libc::cpu_set_t) -> std::io::Result<()> {
    // SAFETY: sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of `set`.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Pin thread `tid` (0 = the calling thread) to CPU `cpu`.
pub(crate) fn pin(tid: i32, cpu: usize) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; all zeros is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
        return Err(std::io::Error::other(format!("CPU {cpu} out of range")));
    }
    // SAFETY: CPU_SET writes one bit of `set`; `cpu` past the set's size was refused above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    set_affinity(tid, &set)
}

/// Back to `SCHED_OTHER` (see [`realtime_this_thread`]).
pub(crate) fn normal_this_thread() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler on the calling thread (0) with a valid sched_param; a
    // thread may always lower its own policy.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) };
}

/// Whether the calling thread runs `SCHED_FIFO` (see [`realtime_this_thread`]).
pub(crate) fn is_realtime_this_thread() -> bool {
    // SAFETY: sched_getscheduler on the calling thread has no preconditions.
    let policy = unsafe { libc::sched_getscheduler(0) } & !libc::SCHED_RESET_ON_FORK;
    policy == libc::SCHED_FIFO
}

/// Seconds since the Unix epoch (0.0 if the clock is before it).
pub(crate) fn unix_now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// What the kernel and our privileges allow.
#[derive(Debug, serde::Serialize)]
pub struct MachineFacts {
    pub kernel: String,
    pub euid: u32,
    pub btf: bool,
    pub perf_event_paranoid: Option<i32>,
    pub ptrace_scope: Option<i32>,
    pub effective_caps: String,
    pub cap_sys_ptrace: bool,
    pub cap_bpf: bool,
    pub cap_perfmon: bool,
    pub cap_sys_admin: bool,
}

fn read_int(path: &str) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

pub fn machine_facts() -> MachineFacts {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let bits = u64::from_str_radix(&caps, 16).unwrap_or(0);
    let has = |n: u32| bits & (1u64 << n) != 0;
    MachineFacts {
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        // SAFETY: geteuid has no preconditions and cannot fail.
        euid: unsafe { libc::geteuid() },
        btf: std::path::Path::new("/sys/kernel/btf/vmlinux").exists(),
        perf_event_paranoid: read_int("/proc/sys/kernel/perf_event_paranoid"),
        ptrace_scope: read_int("/proc/sys/kernel/yama/ptrace_scope"),
        effective_caps: caps,
        cap_sys_ptrace: has(19),
        cap_sys_admin: has(21),
        cap_perfmon: has(38),
        cap_bpf: has(39),
    }
}

/// Asks a running recorder (or agent, or dashboard) to finish: cloned into whoever may ask,
/// passed to whoever must stop. A new token per run, so a process can record again after a
/// stop (no process-global flag).
#[derive(Debug, Clone, Default)]
pub struct StopToken(Arc<AtomicBool>);

impl StopToken {
    pub fn new() -> Self {
        Self::default()
    }

    /// Ask to stop (as SIGINT would).
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The token SIGINT and SIGTERM stop, once [`stop_on_signals`] has installed the handlers.
static SIGNALLED: OnceLock<StopToken> = OnceLock::new();

extern "C" fn on_signal(_: libc::c_int) {
    // OnceLock::get is an atomic load and StopToken::stop an atomic store: async-signal-safe.
    if let Some(t) = SIGNALLED.get() {
        t.stop();
    }
}

/// Stop cleanly (finish the file) on SIGINT and SIGTERM: returns the token those signals
/// stop. For the binary (`main`) only: a library must not take a process's signals. The
/// handlers are installed once; later calls return the same token.
pub(crate) fn stop_on_signals() -> StopToken {
    let t = SIGNALLED.get_or_init(StopToken::new).clone();
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // SAFETY: the handler only does atomic loads and stores, which are async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
            libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        }
    });
    t
}

/// A thread's scheduler counters (`/proc/TID/schedstat`): its CPU time and how many times it
/// was switched in, read at `t_ns` (monotonic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedstat {
    pub t_ns: u64,
    pub run_ns: u64,
    pub switches: u64,
}

impl Schedstat {
    /// `run_ns wait_ns switches` as the kernel writes them; None for anything else.
    pub fn parse(text: &str, t_ns: u64) -> Option<Schedstat> {
        let mut f = text.split_ascii_whitespace();
        let run_ns = f.next()?.parse().ok()?;
        let _wait = f.next()?;
        let switches = f.next()?.parse().ok()?;
        Some(Schedstat {
            t_ns,
            run_ns,
            switches,
        })
    }

    /// Thread `tid`'s counters now (None when it is gone or schedstats are not built in).
    pub(crate) fn of_thread(tid: i32) -> Option<Schedstat> {
        Self::read(&format!("/proc/{tid}/schedstat"))
    }

    /// Thread `tid` of process `pid`: its counters now.
    pub(crate) fn of_task(pid: i32, tid: i32) -> Option<Schedstat> {
        Self::read(&format!("/proc/{pid}/task/{tid}/schedstat"))
    }

    fn read(path: &str) -> Option<Schedstat> {
        let text = std::fs::read_to_string(path).ok()?;
        Schedstat::parse(&text, monotonic_ns())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_independent() {
        let a = StopToken::new();
        let b = a.clone();
        let c = StopToken::new();
        b.stop();
        assert!(a.is_stopped());
        assert!(
            !c.is_stopped(),
            "a new run is not stopped by an earlier stop"
        );
    }
}

/// Start-up and shutdown steps timed, in the order they ended: what `record` did between the
/// command and its window, and between the window's end and its exit (docs/benchmarks.md).
/// `ENGINESCOPE_TIMINGS=1` prints each as it ends; the recording keeps them as counters
/// (`step_<name>_us`).
pub mod steps {
    use std::sync::Mutex;
    use std::time::Instant;

    static STEPS: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());

    fn printing() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("ENGINESCOPE_TIMINGS").is_ok_and(|v| v == "1"))
    }

    /// Times one step from now until the guard drops.
    pub struct Step {
        name: &'static str,
        start: Instant,
    }

    /// Time the step `name` until the returned guard drops.
    pub fn step(name: &'static str) -> Step {
        Step {
            name,
            start: Instant::now(),
        }
    }

    /// Note a step's length measured elsewhere.
    pub fn note(name: &str, us: u64) {
        if printing() {
            static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
            let t0 = T0.get_or_init(Instant::now);
            eprintln!(
                "enginescope: step {name}: {:.1} ms (ended at {:.3} s)",
                us as f64 / 1e3,
                t0.elapsed().as_secs_f64()
            );
        }
        if let Ok(mut s) = STEPS.lock() {
            // Bounded: a long recording that adds targets keeps the first 256 steps.
            if s.len() < 256 {
                s.push((name.to_string(), us));
            }
        }
    }

    impl Drop for Step {
        fn drop(&mut self) {
            note(self.name, self.start.elapsed().as_micros() as u64);
        }
    }

    /// The steps timed so far, summed by name (a step done once per target adds up).
    pub fn totals() -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = Vec::new();
        if let Ok(s) = STEPS.lock() {
            for (name, us) in s.iter() {
                match out.iter_mut().find(|(n, _)| n == name) {
                    Some(e) => e.1 += us,
                    None => out.push((name.clone(), *us)),
                }
            }
        }
        out
    }
}

/// xorshift64*: a draw reproducible from its state (the cost benchmark's arm order, the probe
/// budget's on-phase lengths, the sampling clock's periods).
pub(crate) fn next_random(state: &mut u64) -> u64 {
    let mut x = (*state).max(1);
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// A seed for [`next_random`] that differs between processes and runs (the clock and the pid).
pub(crate) fn random_seed() -> u64 {
    (monotonic_ns() ^ ((std::process::id() as u64) << 32)) | 1
}

/// A map looked up for every event the recorder handles (code objects, lines, interned
/// frames and stacks): foldhash, seeded per process; SipHash's cost per lookup was a fifth of
/// the recorder's CPU at 1 kHz (docs/benchmarks.md).
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A draw uniform in [0, 1) from [`next_random`].
pub(crate) fn unit_random(state: &mut u64) -> f64 {
    (next_random(state) >> 11) as f64 / (1u64 << 53) as f64
}
