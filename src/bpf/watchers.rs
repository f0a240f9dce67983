//! Who else on this host watches probes with debug registers.
//!
//! x86 has four debug registers per CPU, and every hardware watchpoint on the host draws on
//! them: a watchpoint set on every CPU takes a register from every thread. An always-on agent
//! whose budgeted probes hold slots on every CPU left an engineer's `record` on the same host
//! one register per thread, so its exact probes took turns ("exact, 67% of the window") where
//! every call was asked for. Each enginescope process that watches probes holds a file here,
//! locked for its life (the kernel drops the lock however the process ends), saying what it
//! holds. Every process reads the directory ([`crate::sampler`]'s BPF source): slots on every
//! CPU only while it is the only one watching probes; an agent gives all its registers back
//! while a foreground recording (`record`, `top`, `demo`) is registered; and a foreground
//! recording waits for room ([`wait_for_room`]) before it sets its first watchpoint.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Where the registrations live (tmpfs: gone at reboot).
pub const DIR: &str = "/run/enginescope/watchers";

/// What a registered process is: an agent gives its registers to the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `agent`: always on, in the background.
    Agent,
    /// `record`, `top`, `demo`: an engineer's recording.
    Foreground,
}

/// What a process says of itself in its file: one line, each of the same length, written in
/// place (a reader never sees a shorter one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Watching probes, with slots on every CPU (which reserve a register on every CPU).
    CpuSlots,
    /// Watching probes with per-thread watchpoints only.
    ThreadsOnly,
    /// An agent that holds no debug register (it gave them to a foreground recording).
    Yielded,
}

fn line(role: Role, state: State) -> &'static [u8] {
    match (role, state) {
        (Role::Foreground, State::CpuSlots) => b"foreground-cpu\n",
        (Role::Foreground, _) => b"foreground-thr\n",
        (Role::Agent, State::CpuSlots) => b"agent------cpu\n",
        (Role::Agent, State::ThreadsOnly) => b"agent------thr\n",
        (Role::Agent, State::Yielded) => b"agent----yield\n",
    }
}

fn parse(bytes: &[u8]) -> Option<(Role, State)> {
    [Role::Foreground, Role::Agent]
        .into_iter()
        .find_map(|role| {
            [State::CpuSlots, State::ThreadsOnly, State::Yielded]
                .into_iter()
                .find(|&st| line(role, st) == bytes)
                .map(|st| (role, st))
        })
}

/// One live registration of another process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watcher {
    pub pid: i32,
    pub role: Role,
    pub state: State,
}

impl Watcher {
    /// Whether it leaves a foreground recording every register: an agent that gave way, or
    /// anyone with no slots on every CPU (per-thread watchpoints of other processes' threads
    /// take none of its threads' registers).
    fn leaves_room(&self) -> bool {
        match self.role {
            Role::Agent => self.state == State::Yielded,
            Role::Foreground => self.state != State::CpuSlots,
        }
    }
}

/// This process's registration: its file, locked; removed when dropped.
#[derive(Debug)]
pub struct Registration {
    file: File,
    path: PathBuf,
    role: Role,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Registration {
    /// Say what this process holds now.
    pub fn say(&self, state: State) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(line(self.role, state), 0)
    }
}

/// Most files read in one look (a directory filled by someone else stays bounded).
const MAX_ENTRIES: usize = 256;

/// Wait (at most `within`) until every other process registered in `dir` leaves this one
/// every register (agents given way, no slots on every CPU held); the pids of those that do
/// not by then.
pub fn wait_for_room(dir: &Path, within: std::time::Duration) -> Vec<i32> {
    let until = std::time::Instant::now() + within;
    loop {
        let waiting: Vec<i32> = others(dir)
            .into_iter()
            .filter(|w| !w.leaves_room())
            .map(|w| w.pid)
            .collect();
        if waiting.is_empty() || std::time::Instant::now() >= until {
            return waiting;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Register this process in `dir` as `role`. The file's name holds the pid and a nonce, so a
/// stale file of an earlier process with the same pid is never taken for this one's; it is
/// made locked and written under a name readers skip, then renamed (a reader never finds it
/// unlocked and clears it away).
pub fn register(dir: &Path, role: Role) -> std::io::Result<Registration> {
    std::fs::create_dir_all(dir)?;
    let pid = std::process::id();
    let nonce = crate::sys::monotonic_ns();
    let name = format!("{pid}-{nonce}");
    let making = dir.join(format!(".{name}"));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&making)?;
    let mut reg = Registration {
        file,
        path: making,
        role,
    };
    reg.file.try_lock().map_err(std::io::Error::other)?;
    reg.say(State::ThreadsOnly)?;
    let path = dir.join(name);
    std::fs::rename(&reg.path, &path)?;
    reg.path = path;
    Ok(reg)
}

/// The live registrations in `dir` other than this process's: a file whose lock nobody holds
/// is an ended process's and is removed. Errors reading the directory read as nobody.
pub fn others(dir: &Path) -> Vec<Watcher> {
    let own = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten().take(MAX_ENTRIES) {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.split_once('-'))
            .and_then(|(p, _)| p.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == own {
            continue;
        }
        let Ok(mut f) = File::open(e.path()) else {
            continue;
        };
        match f.try_lock_shared() {
            Ok(()) => {
                // Nobody holds it: its process ended.
                let _ = std::fs::remove_file(e.path());
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut buf = [0u8; 32];
                let n = f.read(&mut buf).unwrap_or(0);
                // A file not written yet (or torn) says nothing: looked at again next time.
                let Some((role, state)) = parse(&buf[..n]) else {
                    continue;
                };
                out.push(Watcher { pid, role, state });
            }
            Err(std::fs::TryLockError::Error(_)) => {}
        }
    }
    out.sort_by_key(|w| w.pid);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_is_seen_while_held_and_gone_after() {
        let dir = tempfile::tempdir().unwrap();
        let own = register(dir.path(), Role::Foreground).unwrap();
        // Its own process's registration is not another's.
        assert!(others(dir.path()).is_empty());
        // Another process's file, locked by a descriptor of ours that stands for it.
        let path = dir.path().join("4242-1");
        let f = File::create(&path).unwrap();
        f.try_lock().unwrap();
        // Not written yet: nothing said.
        assert!(others(dir.path()).is_empty());
        let say = |f: &File, role, state| {
            use std::os::unix::fs::FileExt;
            f.write_all_at(line(role, state), 0).unwrap();
        };
        let seen = |role, state| {
            vec![Watcher {
                pid: 4242,
                role,
                state,
            }]
        };
        let short = std::time::Duration::from_millis(30);
        // An agent leaves room once it has given way, whatever it held.
        for (state, room) in [
            (State::CpuSlots, false),
            (State::ThreadsOnly, false),
            (State::Yielded, true),
        ] {
            say(&f, Role::Agent, state);
            assert_eq!(others(dir.path()), seen(Role::Agent, state));
            let late = wait_for_room(dir.path(), short);
            assert_eq!(late.is_empty(), room, "agent {state:?}");
        }
        // Another recording, once it holds no slots on every CPU.
        for (state, room) in [(State::CpuSlots, false), (State::ThreadsOnly, true)] {
            say(&f, Role::Foreground, state);
            assert_eq!(others(dir.path()), seen(Role::Foreground, state));
            let late = wait_for_room(dir.path(), short);
            assert_eq!(late.is_empty(), room, "foreground {state:?}");
        }
        // A line cut short says nothing.
        f.set_len(5).unwrap();
        assert!(others(dir.path()).is_empty());
        // Its process ends: the lock goes with it, the file is cleared away.
        drop(f);
        assert!(others(dir.path()).is_empty());
        assert!(!path.exists());
        // A file whose name is not ours is left alone.
        std::fs::write(dir.path().join("notes"), "x").unwrap();
        assert!(others(dir.path()).is_empty());
        drop(own);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
