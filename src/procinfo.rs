//! Facts about processes and threads from `/proc`: thread lists, names, namespace ids.

use std::collections::HashMap;

/// One thread of a process, as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInfo {
    /// Thread id in the host's PID namespace.
    pub host_tid: i32,
    /// Thread id in the target's own (innermost) PID namespace.
    pub ns_tid: i32,
    /// `/proc/PID/task/TID/comm`.
    pub comm: String,
}

/// Parse the `NSpid:` line of `/proc/.../status`: host id first, innermost last.
pub(crate) fn parse_nspid(status: &str) -> Option<Vec<i32>> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    let ids: Option<Vec<i32>> = line["NSpid:".len()..]
        .split_whitespace()
        .map(|x| x.parse().ok())
        .collect();
    ids.filter(|v| !v.is_empty())
}

/// All threads of `pid`, with their namespace ids and names. Threads that exit while we read
/// are skipped.
pub fn tasks(pid: i32) -> std::io::Result<Vec<TaskInfo>> {
    TaskCache::default().tasks(pid)
}

/// How long a thread's name, once read, stands before it is read again.
pub(crate) const COMM_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The threads of one process, listed again at each call, each thread's namespace id read
/// once (`status`: it never changes) and its name at most every [`COMM_EVERY`] (threads name
/// themselves once, as they start). Listing a 74-thread vLLM every 100 ms read ~1,500 `status`
/// and as many `comm` files a second, each a walk through the target's task and signal
/// structures; a listing now opens only the files of threads it has not met.
#[derive(Debug, Default)]
pub(crate) struct TaskCache {
    known: HashMap<i32, (i32, String, std::time::Instant)>,
    /// When the caller last read what depends on the thread list (the interpreter's own list
    /// of thread states), and the OS threads then: [`TaskCache::list_due`].
    list_read: Option<(std::time::Instant, Vec<i32>)>,
}

/// How long what was read for a thread list stands while the process's OS threads stay the
/// same ([`TaskCache::list_due`]).
pub(crate) const LIST_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl TaskCache {
    /// The threads of `pid` now (sorted by host tid).
    pub fn tasks(&mut self, pid: i32) -> std::io::Result<Vec<TaskInfo>> {
        let mut out = Vec::new();
        let now = std::time::Instant::now();
        for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            let Ok(entry) = entry else { continue };
            let Some(host_tid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            let base = format!("/proc/{pid}/task/{host_tid}");
            let ns_tid = match self.known.get(&host_tid) {
                Some((ns_tid, comm, at)) if now.duration_since(*at) < COMM_EVERY => {
                    out.push(TaskInfo {
                        host_tid,
                        ns_tid: *ns_tid,
                        comm: comm.clone(),
                    });
                    continue;
                }
                Some((ns_tid, _, _)) => *ns_tid,
                None => {
                    let Ok(status) = std::fs::read_to_string(format!("{base}/status")) else {
                        continue;
                    };
                    parse_nspid(&status)
                        .and_then(|v| v.last().copied())
                        .unwrap_or(host_tid)
                }
            };
            let comm = std::fs::read_to_string(format!("{base}/comm"))
                .map(|s| s.trim_end_matches('\n').to_string())
                .unwrap_or_default();
            self.known.insert(host_tid, (ns_tid, comm.clone(), now));
            out.push(TaskInfo {
                host_tid,
                ns_tid,
                comm,
            });
        }
        out.sort_by_key(|t| t.host_tid);
        // Threads gone are forgotten (a tid reused later is a new thread).
        self.known
            .retain(|tid, _| out.binary_search_by_key(tid, |t| t.host_tid).is_ok());
        Ok(out)
    }

    /// Whether what depends on the thread list must be read again: the OS threads in `tasks`
    /// are not those of the last [`TaskCache::list_read`], or that was [`LIST_EVERY`] ago or
    /// more (a Python thread is born with an OS thread, bar a native thread's first
    /// `PyGILState_Ensure`, found at the next read).
    pub(crate) fn list_due(&self, tasks: &[TaskInfo]) -> bool {
        !self.list_read.as_ref().is_some_and(|(at, tids)| {
            at.elapsed() < LIST_EVERY && tids.iter().copied().eq(tasks.iter().map(|t| t.host_tid))
        })
    }

    /// What depends on `tasks` was read now.
    pub(crate) fn list_read(&mut self, tasks: &[TaskInfo]) {
        self.list_read = Some((
            std::time::Instant::now(),
            tasks.iter().map(|t| t.host_tid).collect(),
        ));
    }
}

/// Map namespace tid → task.
pub(crate) fn by_ns_tid(tasks: &[TaskInfo]) -> HashMap<i32, &TaskInfo> {
    tasks.iter().map(|t| (t.ns_tid, t)).collect()
}

/// The process's command line, NUL-separated arguments joined by spaces.
pub fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// A name for `pid` in messages: its command line, else its `comm` (a process caught between
/// `execve` and the kernel filling in its arguments has an empty command line), else `?`.
pub(crate) fn describe(pid: i32) -> String {
    let cmd = cmdline(pid);
    if !cmd.is_empty() {
        return cmd;
    }
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim_end().to_string())
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "?".to_string())
}

/// The parent of `pid` (0 when unknown).
pub fn ppid(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|st| {
            // The 2nd field after the ")" that ends comm (comm may hold spaces and parens).
            st.rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// Whether `pid` is `root` or one of its descendants (bounded walk up the parents).
pub(crate) fn descends_from(pid: i32, root: i32) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        if p == root {
            return true;
        }
        if p <= 1 {
            return false;
        }
        p = ppid(p);
    }
    false
}

/// Whether `pid` still runs: it exists and is not a zombie waiting for its parent to reap it.
/// The process's auxiliary vector (/proc/PID/auxv): fixed for the life of one program image
/// and new at every `exec` (the stack's and loader's addresses are randomized), so two
/// readings that differ mean the process exec'd in between. None when unreadable.
pub(crate) fn image_id(pid: i32) -> Option<Vec<u8>> {
    std::fs::read(format!("/proc/{pid}/auxv"))
        .ok()
        .filter(|b| !b.is_empty())
}

pub(crate) fn is_running(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("");
    !matches!(state, "Z" | "X" | "x")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_list_due_when_threads_change_or_never_read() {
        let task = |host_tid| TaskInfo {
            host_tid,
            ns_tid: host_tid,
            comm: String::new(),
        };
        let (a, b) = (vec![task(1), task(2)], vec![task(1), task(3)]);
        let mut c = TaskCache::default();
        assert!(c.list_due(&a), "never read");
        c.list_read(&a);
        assert!(!c.list_due(&a), "the same threads, just read");
        assert!(c.list_due(&b), "another thread");
        assert!(c.list_due(&a[..1]), "a thread gone");
    }

    #[test]
    fn own_threads_listed_with_names() {
        let mut c = TaskCache::default();
        let me = std::process::id() as i32;
        let mine = |v: Vec<TaskInfo>| v.into_iter().find(|t| t.host_tid == me);
        let first = mine(c.tasks(me).expect("own task list")).expect("main thread listed");
        assert!(!first.comm.is_empty());
        // The second listing, from the cache, says the same of it.
        assert_eq!(mine(c.tasks(me).expect("own task list")), Some(first));
    }

    #[test]
    fn nspid() {
        assert_eq!(
            parse_nspid("Name:\tx\nNSpid:\t986\t1\n"),
            Some(vec![986, 1])
        );
        assert_eq!(parse_nspid("NSpid:\t42\n"), Some(vec![42]));
        assert_eq!(parse_nspid("Name:\tx\n"), None);
        assert_eq!(parse_nspid("NSpid:\tx\n"), None);
    }

    #[test]
    fn zombies_are_not_running() {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id() as i32;
        assert!(is_running(std::process::id() as i32));
        // Wait for it to exit without reaping it: it stays a zombie until `wait`.
        // SAFETY: waitid with WNOWAIT on our own child leaves it unreaped; `info` is a plain
        // C struct the call fills in.
        let rc = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PID,
                pid as u32,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        assert_eq!(rc, 0);
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        assert!(!is_running(pid));
        c.wait().unwrap();
        assert!(!is_running(pid));
    }

    #[test]
    fn own_tasks() {
        let t = tasks(std::process::id() as i32).unwrap();
        assert!(t.iter().any(|t| t.host_tid == std::process::id() as i32));
    }
}
