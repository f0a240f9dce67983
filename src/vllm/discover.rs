//! Finding vLLM engines on this host from `/proc`.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use enginescope::vllm::discover::{discover_engines, rediscover};
//! let d = discover_engines(None)?; // or Some("http://10.0.0.5:8000/metrics")
//! for e in &d.engines {
//!     println!("{} api={} cores={:?} workers={:?} {}", e.id, e.api_server_pid,
//!              e.engine_core_pids, e.worker_pids, e.metrics_url);
//! }
//! // `d.roles` gives `ProcessInfo::role` for every pid ("api_server", "engine_core", "worker_tp0").
//! // While recording: every few seconds,
//! let (d2, change) = rediscover(&d, None)?;
//! // attach `change.new_pids`, close `change.exited_pids`, rewrite `change.changed_engines`.
//! # Ok(()) }
//! ```
//!
//! What is recognised (vLLM 0.32's process titles, `vllm/utils/system_utils.py`
//! `set_process_title`: `{VLLM_PROCESS_NAME_PREFIX}::{name}[_{suffix}]`, prefix `VLLM` by
//! default):
//!
//! | process | title (cmdline; `comm` is cut to 15 bytes) | role |
//! |---|---|---|
//! | engine core | `VLLM::EngineCore`, `VLLM::EngineCore_DP<n>` | `engine_core`, `engine_core_dp<n>` |
//! | worker | `VLLM::Worker`, `VLLM::Worker[_DP<n>][_PP<n>][_PCP<n>][_TP<n>][_DCP<n>][_EP<n>]` | `worker`, `worker_tp0`, `worker_pp1_tp0`, … |
//! | extra API servers (`--api-server-count`) | `VLLM::APIServer_<n>`, `VLLM::APIServer_DP<n>` | `api_server_<n>`, `api_server_dp<n>` |
//! | DP coordinator | `VLLM::DPCoordinator` | `dp_coordinator` |
//!
//! The title is read from the command line (setproctitle rewrites it, padded with spaces);
//! when that is not a title (a process that only set its `comm`), from `comm`, whose 15-byte cut
//! (`VLLM::EngineCor`, `VLLM::Worker_TP`) is completed to the known name.
//!
//! Engines are grouped by the process tree: an engine core's parent is the engine's root (the
//! API server, or the script that called `LLM(...)`); workers descend from an engine core (or,
//! with the engine running in-process, directly from the root). The root is an `api_server`
//! when its argv is `vllm serve …`, `python -m vllm.entrypoints.….api_server …`, or any argv
//! with a `serve` word and `--port` (such a root is only considered because it has an engine
//! core or worker child, so unrelated servers are never matched); otherwise it is an
//! `offline_llm` script (`EngineInfo::api_server_pid` 0). A `vllm serve` process is also
//! reported before its engine core has started.
//!
//! The metrics URL comes from, in order: the override (`--metrics-url`), the API server's
//! `--host`/`--port` (source "argv"), the TCP sockets it listens on (`/proc/PID/fd` socket
//! inodes matched in `/proc/PID/net/tcp{,6}`; source "socket"), else vLLM's default port 8000
//! (source "default"). An override with no local engine makes one remote engine with no pids,
//! so a remote engine's metrics can be scraped too.
//!
//! Engine ids (`engine0`, `engine1`, …) follow the roots' pids at first discovery and stay
//! with their engine across [`rediscover`]; a new engine gets the next unused number.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::record::EngineInfo;

/// The port `vllm serve` listens on without `--port`.
pub(crate) const VLLM_DEFAULT_PORT: u16 = 8000;

/// Longest ancestor chain followed when grouping (vLLM trees are 3 deep).
const MAX_ANCESTRY: usize = 64;

/// One process as `/proc` shows it: what discovery needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcEntry {
    pub pid: i32,
    pub ppid: i32,
    /// `/proc/PID/comm` (at most 15 bytes).
    pub comm: String,
    /// `/proc/PID/cmdline`, split at NULs, empty arguments dropped.
    pub argv: Vec<String>,
    pub threads: u32,
}

/// Where process facts come from: the live `/proc`, or a fixed table in tests.
pub trait ProcSource {
    /// Every live (non-zombie) process that could be read.
    fn processes(&self) -> anyhow::Result<Vec<ProcEntry>>;
    /// TCP addresses `pid` listens on (sockets it holds open in LISTEN state).
    fn listening_tcp(&self, pid: i32) -> Vec<SocketAddr>;
}

/// The host's `/proc`, through the `procfs` crate.
pub struct LiveProc;

impl ProcSource for LiveProc {
    fn processes(&self) -> anyhow::Result<Vec<ProcEntry>> {
        use anyhow::Context;
        let all = procfs::process::all_processes()
            .context("listing /proc (is /proc mounted? in a container, run with --pid=host)")?;
        let mut out = Vec::new();
        for p in all {
            // A process can exit between listing and reading: skip it.
            let Ok(p) = p else { continue };
            let Ok(stat) = p.stat() else { continue };
            if matches!(stat.state, 'Z' | 'X' | 'x') {
                continue;
            }
            out.push(ProcEntry {
                pid: stat.pid,
                ppid: stat.ppid,
                comm: stat.comm.clone(),
                // Kernel threads and processes we may not read have no argv; comm still works.
                argv: p.cmdline().unwrap_or_default(),
                threads: u32::try_from(stat.num_threads).unwrap_or(0),
            });
        }
        out.sort_by_key(|e| e.pid);
        Ok(out)
    }

    fn listening_tcp(&self, pid: i32) -> Vec<SocketAddr> {
        use procfs::process::FDTarget;
        let Ok(p) = procfs::process::Process::new(pid) else {
            return Vec::new();
        };
        // Reading another user's fds needs root or CAP_SYS_PTRACE; without it: no sockets.
        let Ok(fds) = p.fd() else {
            return Vec::new();
        };
        let inodes: BTreeSet<u64> = fds
            .filter_map(|fd| match fd.ok()?.target {
                FDTarget::Socket(inode) => Some(inode),
                _ => None,
            })
            .collect();
        let mut out: Vec<SocketAddr> = p
            .tcp()
            .unwrap_or_default()
            .into_iter()
            .chain(p.tcp6().unwrap_or_default())
            .filter(|e| e.state == procfs::net::TcpState::Listen && inodes.contains(&e.inode))
            .map(|e| e.local_address)
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// One process that belongs to an engine.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EngineProcess {
    pub pid: i32,
    pub ppid: i32,
    /// `EngineInfo::id`.
    pub engine: String,
    pub role: String,
    /// Command line (or the title), arguments joined by spaces.
    pub cmdline: String,
    pub threads: u32,
}

/// Every vLLM engine found on the host.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Discovery {
    /// Ordered by id number.
    pub engines: Vec<EngineInfo>,
    /// pid → role, for `ProcessInfo::role`.
    pub roles: BTreeMap<i32, String>,
    /// Every engine process, ordered by engine then pid.
    pub processes: Vec<EngineProcess>,
    /// Things a user should know (an override applied to several engines, several listening
    /// sockets to choose from).
    pub warnings: Vec<String>,
    /// The number the next new engine's id gets; ids are never reused within a session.
    pub next_engine_index: u32,
}

impl Discovery {
    /// The processes of one engine.
    pub fn processes_of<'a>(&'a self, engine: &'a str) -> impl Iterator<Item = &'a EngineProcess> {
        self.processes.iter().filter(move |p| p.engine == engine)
    }

    /// Every pid of every engine.
    pub fn pids(&self) -> BTreeSet<i32> {
        self.roles.keys().copied().collect()
    }

    /// Every pid of every engine that runs Python (all but Rust front-ends).
    pub(crate) fn python_pids(&self) -> BTreeSet<i32> {
        self.roles
            .iter()
            .filter(|(_, role)| role.as_str() != ROLE_RUST_FRONTEND)
            .map(|(&pid, _)| pid)
            .collect()
    }

    /// What identifies an engine across rediscoveries: its root process (API server or
    /// offline script), else its first engine core, else its first worker; the URL for an
    /// engine with no local process.
    fn engine_key(&self, e: &EngineInfo) -> String {
        if e.api_server_pid != 0 {
            return format!("pid:{}", e.api_server_pid);
        }
        let root = self
            .processes_of(&e.id)
            .find(|p| p.role == ROLE_OFFLINE || p.role == ROLE_HEADLESS)
            .map(|p| p.pid);
        match root
            .or_else(|| e.engine_core_pids.first().copied())
            .or_else(|| e.worker_pids.first().copied())
        {
            Some(pid) => format!("pid:{pid}"),
            None => format!("url:{}", e.metrics_url),
        }
    }
}

/// What changed between two discoveries: for `record`/`top` to attach and close processes.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DiscoveryChange {
    /// Processes that appeared, with their roles.
    pub new_pids: Vec<(i32, String)>,
    /// Processes that are gone (exited, or no longer part of an engine).
    pub exited_pids: Vec<i32>,
    /// Processes whose role changed (a worker titles itself `VLLM::Worker` first and adds its
    /// ranks once the parallel groups exist).
    pub role_changes: Vec<(i32, String)>,
    /// Engines that are new or whose description changed (write them again).
    pub changed_engines: Vec<EngineInfo>,
    /// Ids of engines that are gone.
    pub gone_engines: Vec<String>,
}

impl DiscoveryChange {
    pub fn is_empty(&self) -> bool {
        self.new_pids.is_empty()
            && self.exited_pids.is_empty()
            && self.role_changes.is_empty()
            && self.changed_engines.is_empty()
            && self.gone_engines.is_empty()
    }
}

pub(crate) const ROLE_API_SERVER: &str = "api_server";
pub(crate) const ROLE_OFFLINE: &str = "offline_llm";
pub(crate) const ROLE_HEADLESS: &str = "headless_launcher";
/// `vllm serve --api-server-count N` (N > 1, or data parallel): the process the user started
/// binds the port and starts the engines and the `APIServer_i` processes that serve it.
pub(crate) const ROLE_SERVE_LAUNCHER: &str = "serve_launcher";
/// vLLM's Rust front-end (`VLLM_USE_RUST_FRONTEND=1`): the `vllm-rs frontend` binary that
/// `vllm serve` starts to serve HTTP in place of a Python API server. Not a Python process:
/// scraped, never read as CPython.
pub(crate) const ROLE_RUST_FRONTEND: &str = "rust_frontend";

/// A vLLM process title: `PREFIX::Name[_Suffix]` split into the known name and its suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Title {
    EngineCore(String),
    Worker(String),
    ApiServer(String),
    DpCoordinator,
}

impl Title {
    fn role(&self) -> String {
        let with = |base: &str, suffix: &str| {
            if suffix.is_empty() {
                base.to_string()
            } else {
                format!("{base}_{}", suffix.to_ascii_lowercase())
            }
        };
        match self {
            Title::EngineCore(s) => with("engine_core", s),
            Title::Worker(s) => with("worker", s),
            Title::ApiServer(s) => with("api_server", s),
            Title::DpCoordinator => "dp_coordinator".into(),
        }
    }
}

const KNOWN_TITLES: [&str; 4] = ["EngineCore", "Worker", "APIServer", "DPCoordinator"];

/// Parse `PREFIX::Name[_Suffix]`. `truncated`: the text is a 15-byte `comm`, so a cut-off
/// name (`EngineCor`) is completed and a cut-off suffix kept as it is.
fn parse_title(text: &str, truncated: bool) -> Option<Title> {
    let (prefix, rest) = text.split_once("::")?;
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    if prefix.is_empty() || !prefix.chars().all(word) || rest.is_empty() || !rest.chars().all(word)
    {
        return None;
    }
    let (name, suffix) = match KNOWN_TITLES
        .iter()
        .find(|k| rest == **k || rest.starts_with(&format!("{k}_")))
    {
        Some(k) => (*k, rest[k.len()..].trim_start_matches('_')),
        // "VLLM::EngineCor": the name itself was cut by comm's 15 bytes.
        None if truncated && rest.len() >= 4 => {
            (*KNOWN_TITLES.iter().find(|k| k.starts_with(rest))?, "")
        }
        None => return None,
    };
    Some(match name {
        "EngineCore" => Title::EngineCore(suffix.to_string()),
        "Worker" => Title::Worker(suffix.to_string()),
        "APIServer" => Title::ApiServer(suffix.to_string()),
        _ => Title::DpCoordinator,
    })
}

/// A process's vLLM title: from its command line when setproctitle wrote one, else `comm`.
fn title_of(p: &ProcEntry) -> Option<Title> {
    // setproctitle leaves one argument: the title padded with spaces.
    if let [only] = p.argv.as_slice() {
        let t = only.trim();
        if !t.contains(' ') {
            if let Some(t) = parse_title(t, false) {
                return Some(t);
            }
        }
    }
    parse_title(p.comm.trim(), p.comm.len() >= 15)
}

fn basename(s: &str) -> &str {
    s.rsplit('/').next().unwrap_or(s)
}

/// `vllm serve …` or `python -m vllm.entrypoints.….api_server …`.
fn is_vllm_server_argv(argv: &[String]) -> bool {
    let serve = argv
        .windows(2)
        .any(|w| basename(&w[0]) == "vllm" && w[1] == "serve");
    let module = argv
        .iter()
        .any(|a| a.starts_with("vllm.entrypoints.") && a.ends_with("api_server"));
    serve || module
}

/// `vllm-rs frontend --listen-fd N --input-listener-fd M …`: vLLM's Rust front-end, started by
/// `vllm serve` with the listening socket and the engine's ZMQ sockets passed as descriptors.
fn is_rust_frontend_argv(argv: &[String]) -> bool {
    argv.get(1).is_some_and(|a| a == "frontend")
        && argv.iter().any(|a| a == "--listen-fd")
        && argv.iter().any(|a| a == "--input-listener-fd")
}

/// A `serve` word (or a script named like one) and `--port`: a server of some engine, e.g. a
/// wrapper around vLLM. Only trusted together with an engine core or worker child.
fn is_generic_server_argv(argv: &[String]) -> bool {
    let serve = argv.iter().skip(1).any(|a| {
        a == "serve" || {
            let b = basename(a);
            b.contains("serve") && !a.starts_with('-')
        }
    });
    serve && argv_value(argv, "--port").is_some()
}

/// The value of `--name VALUE` or `--name=VALUE` (the last one wins, as in argparse).
fn argv_value<'a>(argv: &'a [String], name: &str) -> Option<&'a str> {
    let mut found = None;
    let mut it = argv.iter().peekable();
    while let Some(a) = it.next() {
        if a == name {
            found = it.peek().map(|v| v.as_str());
        } else if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            found = Some(v);
        }
    }
    found
}

/// The address to connect to for a server bound to `host`.
fn connect_host(host: &str) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) if a.is_unspecified() => "127.0.0.1".into(),
        Ok(IpAddr::V6(a)) if a.is_unspecified() => "[::1]".into(),
        Ok(IpAddr::V6(a)) => format!("[{a}]"),
        Ok(IpAddr::V4(a)) => a.to_string(),
        Err(_) if host.is_empty() => "127.0.0.1".into(),
        Err(_) => host.to_string(),
    }
}

fn socket_url(a: &SocketAddr) -> String {
    let ip = match a.ip() {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/metrics", SocketAddr::new(ip, a.port()))
}

/// The metrics URL of an API server and how it was found.
fn metrics_url_for(
    root: &ProcEntry,
    src: &dyn ProcSource,
    warnings: &mut Vec<String>,
) -> (String, &'static str) {
    let host = argv_value(&root.argv, "--host");
    let argv_port = argv_value(&root.argv, "--port");
    match argv_port.map(|p| p.parse::<u16>()) {
        // `--port 0`: the OS picked one; only the socket can tell.
        Some(Ok(0)) | None => {}
        Some(Ok(port)) => {
            let host = connect_host(host.unwrap_or(""));
            return (format!("http://{host}:{port}/metrics"), "argv");
        }
        Some(Err(_)) => warnings.push(format!(
            "pid {}: --port {:?} is not a port number; looking at its sockets",
            root.pid,
            argv_port.unwrap_or("")
        )),
    }
    let listening = src.listening_tcp(root.pid);
    let pick = listening
        .iter()
        .find(|a| a.port() == VLLM_DEFAULT_PORT)
        .or_else(|| listening.first());
    if let Some(a) = pick {
        if listening.len() > 1 {
            warnings.push(format!(
                "pid {} listens on {} TCP sockets ({}); using {a}; pass --metrics-url to choose",
                root.pid,
                listening.len(),
                listening
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        return (socket_url(a), "socket");
    }
    if argv_port == Some("0") {
        // A server with an OS-chosen port that listens nowhere (yet): no guess is better
        // than a wrong one.
        return (String::new(), "");
    }
    let host = connect_host(host.unwrap_or(""));
    (
        format!("http://{host}:{VLLM_DEFAULT_PORT}/metrics"),
        "default",
    )
}

/// Find every vLLM engine on this host. `metrics_url_override` replaces each engine's metrics
/// URL; with no local engine it makes one remote engine (no pids) so its metrics can still be
/// scraped.
pub fn discover_engines(metrics_url_override: Option<&str>) -> anyhow::Result<Discovery> {
    discover_with(&LiveProc, metrics_url_override)
}

/// Discover again and say what changed since `prev`; engines keep their ids.
pub fn rediscover(
    prev: &Discovery,
    metrics_url_override: Option<&str>,
) -> anyhow::Result<(Discovery, DiscoveryChange)> {
    let fresh = discover_engines(metrics_url_override)?;
    Ok(reconcile(prev, fresh))
}

/// [`discover_engines`] over any process source.
pub(crate) fn discover_with(
    src: &dyn ProcSource,
    metrics_url_override: Option<&str>,
) -> anyhow::Result<Discovery> {
    let procs = src.processes()?;
    Ok(group(&procs, src, metrics_url_override))
}

/// The process table, indexed: by pid, and the vLLM titles found.
struct Table<'a> {
    by_pid: HashMap<i32, &'a ProcEntry>,
    titles: HashMap<i32, Title>,
}

impl<'a> Table<'a> {
    fn new(procs: &'a [ProcEntry]) -> Self {
        Table {
            by_pid: procs.iter().map(|p| (p.pid, p)).collect(),
            titles: procs
                .iter()
                .filter_map(|p| Some((p.pid, title_of(p)?)))
                .collect(),
        }
    }

    fn is_core(&self, pid: i32) -> bool {
        matches!(self.titles.get(&pid), Some(Title::EngineCore(_)))
    }

    fn is_titled(&self, pid: i32) -> bool {
        self.titles.contains_key(&pid)
    }

    /// The parent of a titled process, when that parent is a real (untitled) process.
    fn root_above(&self, pid: i32) -> Option<i32> {
        let ppid = self.by_pid.get(&pid)?.ppid;
        (ppid > 1 && self.by_pid.contains_key(&ppid) && !self.is_titled(ppid)).then_some(ppid)
    }

    /// The nearest engine core above a pid (bounded walk).
    fn core_above(&self, pid: i32) -> Option<i32> {
        let mut cur = self.by_pid.get(&pid)?.ppid;
        for _ in 0..MAX_ANCESTRY {
            if self.is_core(cur) {
                return Some(cur);
            }
            cur = self.by_pid.get(&cur)?.ppid;
        }
        None
    }
}

/// One engine's processes, before it is described.
#[derive(Default)]
struct Group {
    root: Option<i32>,
    cores: BTreeSet<i32>,
    workers: BTreeSet<i32>,
    others: BTreeSet<i32>,
    rust_frontends: BTreeSet<i32>,
}

/// Group a process table into engines.
fn group(procs: &[ProcEntry], src: &dyn ProcSource, url_override: Option<&str>) -> Discovery {
    let t = Table::new(procs);
    let mut d = Discovery::default();
    let mut ordered: Vec<(i32, Group)> = groups(&t, procs).into_iter().collect();
    ordered.sort_by_key(|(anchor, _)| *anchor);
    for (i, (_, g)) in ordered.into_iter().enumerate() {
        describe(&t, format!("engine{i}"), &g, src, &mut d);
    }
    d.processes.sort_by(|a, b| {
        engine_number(&a.engine)
            .cmp(&engine_number(&b.engine))
            .then(a.pid.cmp(&b.pid))
    });
    apply_override(&mut d, url_override);
    d.next_engine_index = d.engines.len() as u32;
    d
}

/// The engines' process groups, by anchor: roots (pid of the API server / script) or, for an
/// orphaned engine core or worker, the process itself.
fn groups(t: &Table, procs: &[ProcEntry]) -> BTreeMap<i32, Group> {
    let mut groups: BTreeMap<i32, Group> = BTreeMap::new();
    let mut core_group: HashMap<i32, i32> = HashMap::new();
    for p in procs {
        if !t.is_core(p.pid) {
            continue;
        }
        let anchor = t.root_above(p.pid).unwrap_or(p.pid);
        let g = groups.entry(anchor).or_default();
        g.root = t.root_above(p.pid);
        g.cores.insert(p.pid);
        core_group.insert(p.pid, anchor);
    }
    for p in procs {
        match t.titles.get(&p.pid) {
            Some(Title::Worker(_)) => match t.core_above(p.pid) {
                Some(core) => {
                    if let Some(g) = core_group.get(&core).and_then(|a| groups.get_mut(a)) {
                        g.workers.insert(p.pid);
                    }
                }
                // In-process engine core: workers are the root's children.
                None => {
                    let root = t.root_above(p.pid);
                    let g = groups.entry(root.unwrap_or(p.pid)).or_default();
                    g.root = g.root.or(root);
                    g.workers.insert(p.pid);
                }
            },
            Some(Title::ApiServer(_)) | Some(Title::DpCoordinator) => {
                if let Some(g) = t.root_above(p.pid).and_then(|r| groups.get_mut(&r)) {
                    g.others.insert(p.pid);
                }
            }
            None if is_rust_frontend_argv(&p.argv) => {
                if let Some(g) = t.root_above(p.pid).and_then(|r| groups.get_mut(&r)) {
                    g.rust_frontends.insert(p.pid);
                }
            }
            _ => {}
        }
    }
    // Roots must look like an engine's parent; a titled process under some unrelated parent
    // (a shell that started an orphaned core) still counts, the parent is just not a root.
    for g in groups.values_mut() {
        if let Some(root) = g.root {
            let Some(r) = t.by_pid.get(&root) else {
                g.root = None;
                continue;
            };
            let shell = matches!(basename(&r.comm), "bash" | "sh" | "zsh" | "fish" | "dash");
            if shell || r.argv.is_empty() {
                g.root = None;
            }
        }
    }
    // `vllm serve` before its engine core exists.
    for p in procs {
        if is_vllm_server_argv(&p.argv) && !t.is_titled(p.pid) && !groups.contains_key(&p.pid) {
            groups.insert(
                p.pid,
                Group {
                    root: Some(p.pid),
                    ..Default::default()
                },
            );
        }
    }
    groups
}

/// Add engine `id` of group `g` to `d`: its description and its processes with their roles.
fn describe(t: &Table, id: String, g: &Group, src: &dyn ProcSource, d: &mut Discovery) {
    let root = g.root.and_then(|r| t.by_pid.get(&r).copied());
    let root_role = root.map(|r| {
        if r.argv.iter().any(|a| a == "--headless") {
            ROLE_HEADLESS
        } else if is_vllm_server_argv(&r.argv) || is_generic_server_argv(&r.argv) {
            ROLE_API_SERVER
        } else {
            ROLE_OFFLINE
        }
    });
    let mut info = EngineInfo {
        id: id.clone(),
        engine_core_pids: g.cores.iter().copied().collect(),
        worker_pids: g.workers.iter().copied().collect(),
        ..Default::default()
    };
    let mut members: Vec<(i32, String)> = Vec::new();
    // API servers of their own (`APIServer_0`, …): the root only launched them; the engine's
    // API server is the first (their port and arguments are the root's).
    let api_children: Vec<i32> = g
        .others
        .iter()
        .copied()
        .filter(|pid| matches!(t.titles.get(pid), Some(Title::ApiServer(_))))
        .chain(g.rust_frontends.iter().copied())
        .collect();
    if let (Some(r), Some(role)) = (root, root_role) {
        let launcher = role == ROLE_API_SERVER && !api_children.is_empty();
        members.push((
            r.pid,
            if launcher { ROLE_SERVE_LAUNCHER } else { role }.to_string(),
        ));
        if role == ROLE_API_SERVER {
            info.api_server_pid = api_children.first().copied().unwrap_or(r.pid);
            if !api_children.is_empty() {
                info.api_server_pids = api_children.clone();
            }
            let (url, how) = metrics_url_for(r, src, &mut d.warnings);
            info.metrics_url = url;
            info.metrics_url_source = how.into();
        }
    }
    for pid in g.cores.iter().chain(&g.workers).chain(&g.others) {
        if let Some(title) = t.titles.get(pid) {
            members.push((*pid, title.role()));
        }
    }
    for pid in &g.rust_frontends {
        members.push((*pid, ROLE_RUST_FRONTEND.to_string()));
    }
    for (pid, role) in members {
        let Some(p) = t.by_pid.get(&pid) else {
            continue;
        };
        d.roles.insert(pid, role.clone());
        d.processes.push(EngineProcess {
            pid,
            ppid: p.ppid,
            engine: id.clone(),
            role,
            cmdline: p.argv.join(" ").trim().to_string(),
            threads: p.threads,
        });
    }
    d.engines.push(info);
}

fn apply_override(d: &mut Discovery, url_override: Option<&str>) {
    let Some(url) = url_override else { return };
    if d.engines.is_empty() {
        d.engines.push(EngineInfo {
            id: "engine0".into(),
            ..Default::default()
        });
    }
    if d.engines.len() > 1 {
        d.warnings.push(format!(
            "--metrics-url {url} applies to all {} engines; they will report the same metrics",
            d.engines.len()
        ));
    }
    for e in &mut d.engines {
        e.metrics_url = url.to_string();
        e.metrics_url_source = "--metrics-url".into();
    }
}

fn engine_number(id: &str) -> u64 {
    id.strip_prefix("engine")
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}

/// Renumber `fresh` so engines seen in `prev` keep their ids, and list what changed.
pub(crate) fn reconcile(prev: &Discovery, mut fresh: Discovery) -> (Discovery, DiscoveryChange) {
    let prev_by_key: HashMap<String, &EngineInfo> = prev
        .engines
        .iter()
        .map(|e| (prev.engine_key(e), e))
        .collect();
    let mut next = prev.next_engine_index.max(prev.engines.len() as u32);
    let mut rename: HashMap<String, String> = HashMap::new();
    for e in &fresh.engines {
        let new_id = match prev_by_key.get(&fresh.engine_key(e)) {
            Some(old) => old.id.clone(),
            None => {
                let id = format!("engine{next}");
                next += 1;
                id
            }
        };
        rename.insert(e.id.clone(), new_id);
    }
    for e in &mut fresh.engines {
        if let Some(id) = rename.get(&e.id) {
            e.id = id.clone();
        }
    }
    for p in &mut fresh.processes {
        if let Some(id) = rename.get(&p.engine) {
            p.engine = id.clone();
        }
    }
    fresh.engines.sort_by_key(|e| engine_number(&e.id));
    fresh.processes.sort_by(|a, b| {
        engine_number(&a.engine)
            .cmp(&engine_number(&b.engine))
            .then(a.pid.cmp(&b.pid))
    });
    fresh.next_engine_index = next;

    let mut ch = DiscoveryChange::default();
    for (pid, role) in &fresh.roles {
        match prev.roles.get(pid) {
            None => ch.new_pids.push((*pid, role.clone())),
            Some(old) if old != role => ch.role_changes.push((*pid, role.clone())),
            Some(_) => {}
        }
    }
    ch.exited_pids = prev
        .roles
        .keys()
        .filter(|pid| !fresh.roles.contains_key(pid))
        .copied()
        .collect();
    let prev_by_id: HashMap<&str, &EngineInfo> =
        prev.engines.iter().map(|e| (e.id.as_str(), e)).collect();
    for e in &fresh.engines {
        if prev_by_id.get(e.id.as_str()) != Some(&e) {
            ch.changed_engines.push(e.clone());
        }
    }
    let fresh_ids: BTreeSet<&str> = fresh.engines.iter().map(|e| e.id.as_str()).collect();
    ch.gone_engines = prev
        .engines
        .iter()
        .filter(|e| !fresh_ids.contains(e.id.as_str()))
        .map(|e| e.id.clone())
        .collect();
    (fresh, ch)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake {
        procs: Vec<ProcEntry>,
        listen: HashMap<i32, Vec<SocketAddr>>,
    }

    impl ProcSource for Fake {
        fn processes(&self) -> anyhow::Result<Vec<ProcEntry>> {
            Ok(self.procs.clone())
        }
        fn listening_tcp(&self, pid: i32) -> Vec<SocketAddr> {
            self.listen.get(&pid).cloned().unwrap_or_default()
        }
    }

    fn p(pid: i32, ppid: i32, comm: &str, argv: &str, threads: u32) -> ProcEntry {
        ProcEntry {
            pid,
            ppid,
            comm: comm.into(),
            argv: argv
                .split(' ')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            threads,
        }
    }

    /// A setproctitle title: one argument padded with spaces.
    fn titled(pid: i32, ppid: i32, title: &str, threads: u32) -> ProcEntry {
        let comm: String = title.chars().take(15).collect();
        ProcEntry {
            pid,
            ppid,
            comm,
            argv: vec![format!("{title}{}", " ".repeat(135))],
            threads,
        }
    }

    fn fake(procs: Vec<ProcEntry>) -> Fake {
        Fake {
            procs,
            listen: HashMap::new(),
        }
    }

    const SERVE: &str = "/opt/vllm-cpu-venv/bin/python3.11 /opt/vllm-cpu-venv/bin/vllm serve /opt/tiny-moe --served-model-name tiny-moe --load-format dummy --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 --port 8000";

    /// The tree NOTES.md shows for `vllm serve` (ps --forest).
    fn serve_tree() -> Vec<ProcEntry> {
        vec![
            p(1, 0, "init", "/sbin/init", 1),
            p(900, 1, "bash", "bash", 1),
            p(1385, 900, "vllm", SERVE, 12),
            p(1527, 1385, "python3.11", "/opt/vllm-cpu-venv/bin/python3.11 -B -c from multiprocessing.resource_tracker import main;main(32)", 1),
            titled(1528, 1385, "VLLM::EngineCore", 15),
            titled(1975, 1528, "VLLM::Worker", 52),
            p(2000, 900, "python3", "python3 -m http.server --port 9000 serve", 1),
        ]
    }

    #[test]
    fn titles_from_cmdline_and_comm() {
        let role = |e: &ProcEntry| title_of(e).map(|t| t.role());
        assert_eq!(
            role(&titled(1, 0, "VLLM::EngineCore", 1)).as_deref(),
            Some("engine_core")
        );
        assert_eq!(
            role(&titled(1, 0, "VLLM::EngineCore_DP3", 1)).as_deref(),
            Some("engine_core_dp3")
        );
        assert_eq!(
            role(&titled(1, 0, "VLLM::Worker_PP1_TP0", 1)).as_deref(),
            Some("worker_pp1_tp0")
        );
        assert_eq!(
            role(&titled(1, 0, "VLLM::APIServer_2", 1)).as_deref(),
            Some("api_server_2")
        );
        assert_eq!(
            role(&titled(1, 0, "VLLM::DPCoordinator", 1)).as_deref(),
            Some("dp_coordinator")
        );
        assert_eq!(
            role(&titled(1, 0, "MYCO::Worker_TP7", 1)).as_deref(),
            Some("worker_tp7")
        );
        // Only comm set (prctl), 15 bytes: the cut name is completed, the cut suffix kept.
        assert_eq!(
            role(&p(1, 0, "VLLM::EngineCor", "python3 fake.py core", 1)).as_deref(),
            Some("engine_core")
        );
        assert_eq!(
            role(&p(1, 0, "VLLM::Worker_TP", "python3 fake.py w", 1)).as_deref(),
            Some("worker_tp")
        );
        // Not titles.
        assert_eq!(role(&p(1, 0, "python3", "python3 a::b.py", 1)), None);
        assert_eq!(role(&p(1, 0, "VLLM::Foo", "", 1)), None);
        assert_eq!(role(&p(1, 0, "vllm", SERVE, 1)), None);
        // A long, untruncated comm that is not a known title prefix.
        assert_eq!(role(&p(1, 0, "VLLM::Wor", "", 1)), None);
    }

    #[test]
    fn serve_tree_groups_into_one_engine() {
        let d = discover_with(&fake(serve_tree()), None).unwrap();
        assert_eq!(d.engines.len(), 1, "{d:#?}");
        let e = &d.engines[0];
        assert_eq!(e.id, "engine0");
        assert_eq!(e.api_server_pid, 1385);
        assert_eq!(e.engine_core_pids, vec![1528]);
        assert_eq!(e.worker_pids, vec![1975]);
        assert_eq!(e.metrics_url, "http://127.0.0.1:8000/metrics");
        assert_eq!(e.metrics_url_source, "argv");
        let roles: Vec<(i32, &str)> = d.roles.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            roles,
            vec![
                (1385, "api_server"),
                (1528, "engine_core"),
                (1975, "worker")
            ]
        );
        assert_eq!(
            d.processes.iter().map(|p| p.threads).collect::<Vec<_>>(),
            vec![12, 15, 52]
        );
        assert!(d.warnings.is_empty());
    }

    #[test]
    fn metrics_url_from_argv_socket_or_default() {
        let server = |argv: &str| {
            vec![
                p(10, 1, "python3", argv, 3),
                titled(11, 10, "VLLM::EngineCore", 2),
            ]
        };
        let url = |f: Fake| {
            let d = discover_with(&f, None).unwrap();
            (
                d.engines[0].metrics_url.clone(),
                d.engines[0].metrics_url_source.clone(),
                d.warnings,
            )
        };
        // --port=N and --host 0.0.0.0 (connect over loopback).
        let (u, how, _) = url(fake(server(
            "python3 -m vllm.entrypoints.openai.api_server --model m --host 0.0.0.0 --port=8123",
        )));
        assert_eq!(
            (u.as_str(), how.as_str()),
            ("http://127.0.0.1:8123/metrics", "argv")
        );
        // IPv6 host.
        let (u, _, _) = url(fake(server("vllm serve m --host ::1 --port 9000")));
        assert_eq!(u, "http://[::1]:9000/metrics");
        // No --port: the listening socket.
        let mut f = fake(server("/venv/bin/vllm serve m"));
        f.listen.insert(10, vec!["0.0.0.0:8044".parse().unwrap()]);
        let (u, how, w) = url(f);
        assert_eq!(
            (u.as_str(), how.as_str()),
            ("http://127.0.0.1:8044/metrics", "socket")
        );
        assert!(w.is_empty());
        // Several sockets: 8000 preferred, with a warning.
        let mut f = fake(server("/venv/bin/vllm serve m"));
        f.listen.insert(
            10,
            vec![
                "127.0.0.1:7000".parse().unwrap(),
                "[::]:8000".parse().unwrap(),
            ],
        );
        let (u, how, w) = url(f);
        assert_eq!(
            (u.as_str(), how.as_str()),
            ("http://[::1]:8000/metrics", "socket")
        );
        assert_eq!(w.len(), 1, "{w:?}");
        // --port 0 (the fake engine of samples/engine): the socket tells; no socket, no URL.
        let argv0 = "python3 samples/engine serve --port 0 --seconds 1";
        let mut f = fake(server(argv0));
        f.listen
            .insert(10, vec!["127.0.0.1:40111".parse().unwrap()]);
        let (u, how, _) = url(f);
        assert_eq!(
            (u.as_str(), how.as_str()),
            ("http://127.0.0.1:40111/metrics", "socket")
        );
        let (u, how, _) = url(fake(server(argv0)));
        assert_eq!((u.as_str(), how.as_str()), ("", ""));
        // Nothing known: vLLM's default port.
        let (u, how, _) = url(fake(server("/venv/bin/vllm serve m")));
        assert_eq!(
            (u.as_str(), how.as_str()),
            ("http://127.0.0.1:8000/metrics", "default")
        );
    }

    #[test]
    fn override_replaces_urls_and_stands_for_a_remote_engine() {
        let d = discover_with(&fake(serve_tree()), Some("http://10.1.2.3:9/metrics")).unwrap();
        assert_eq!(d.engines[0].metrics_url, "http://10.1.2.3:9/metrics");
        assert_eq!(d.engines[0].metrics_url_source, "--metrics-url");
        let d = discover_with(
            &fake(vec![p(1, 0, "init", "/sbin/init", 1)]),
            Some("http://h:1/metrics"),
        )
        .unwrap();
        assert_eq!(d.engines.len(), 1);
        assert_eq!(d.engines[0].api_server_pid, 0);
        assert!(d.engines[0].engine_core_pids.is_empty());
        assert_eq!(d.engines[0].metrics_url, "http://h:1/metrics");
        let d = discover_with(&fake(vec![]), None).unwrap();
        assert!(d.engines.is_empty());
    }

    #[test]
    fn offline_script_tensor_parallel_and_fake_engine_shape() {
        let procs = vec![
            p(1, 0, "init", "/sbin/init", 1),
            // offline LLM(...) script: its child is the engine core.
            p(50, 1, "python", "python offline.py --n 64", 9),
            titled(51, 50, "VLLM::EngineCore", 15),
            titled(52, 51, "VLLM::Worker", 40),
            // vllm serve -tp 2, started later, higher pid.
            p(
                100,
                1,
                "vllm",
                "/v/bin/python /v/bin/vllm serve m --port 8001 -tp 2",
                12,
            ),
            titled(101, 100, "VLLM::EngineCore", 15),
            titled(102, 101, "VLLM::Worker_TP0", 40),
            titled(103, 101, "VLLM::Worker_TP1", 40),
            // The fake engine of samples/engine: comm-only titles, `serve --port`.
            p(
                200,
                1,
                "python3",
                "python3 samples/engine/fake_vllm.py serve --port 18080",
                4,
            ),
            p(
                201,
                200,
                "VLLM::EngineCor",
                "python3 samples/engine/fake_vllm.py engine-core",
                2,
            ),
            p(
                202,
                201,
                "VLLM::Worker_TP",
                "python3 samples/engine/fake_vllm.py worker 0",
                2,
            ),
            // A random server with `serve` and --port but no engine: never matched.
            p(300, 1, "python3", "python3 app.py serve --port 5000", 2),
            p(301, 300, "python3", "python3 app.py child", 2),
        ];
        let d = discover_with(&fake(procs), None).unwrap();
        assert_eq!(d.engines.len(), 3, "{d:#?}");
        let (a, b, c) = (&d.engines[0], &d.engines[1], &d.engines[2]);
        assert_eq!((a.id.as_str(), a.api_server_pid), ("engine0", 0));
        assert_eq!(
            (a.engine_core_pids.clone(), a.worker_pids.clone()),
            (vec![51], vec![52])
        );
        assert_eq!(a.metrics_url, "");
        assert_eq!(d.roles[&50], "offline_llm");
        assert_eq!((b.id.as_str(), b.api_server_pid), ("engine1", 100));
        assert_eq!(b.worker_pids, vec![102, 103]);
        assert_eq!(b.metrics_url, "http://127.0.0.1:8001/metrics");
        assert_eq!(
            (d.roles[&102].as_str(), d.roles[&103].as_str()),
            ("worker_tp0", "worker_tp1")
        );
        assert_eq!((c.id.as_str(), c.api_server_pid), ("engine2", 200));
        assert_eq!(
            (c.engine_core_pids.clone(), c.worker_pids.clone()),
            (vec![201], vec![202])
        );
        assert_eq!(c.metrics_url, "http://127.0.0.1:18080/metrics");
        assert_eq!(
            (
                d.roles[&200].as_str(),
                d.roles[&201].as_str(),
                d.roles[&202].as_str()
            ),
            ("api_server", "engine_core", "worker_tp")
        );
        assert!(!d.roles.contains_key(&300) && !d.roles.contains_key(&301));
    }

    #[test]
    fn data_parallel_and_multi_api_server() {
        let procs = vec![
            p(
                10,
                1,
                "vllm",
                "/v/bin/python /v/bin/vllm serve m --port 8000 -dp 2 --api-server-count 2",
                12,
            ),
            titled(11, 10, "VLLM::APIServer_0", 8),
            titled(12, 10, "VLLM::APIServer_1", 8),
            titled(13, 10, "VLLM::DPCoordinator", 3),
            titled(14, 10, "VLLM::EngineCore_DP0", 15),
            titled(15, 10, "VLLM::EngineCore_DP1", 15),
            titled(16, 14, "VLLM::Worker_DP0", 40),
            titled(17, 15, "VLLM::Worker_DP1", 40),
        ];
        let d = discover_with(&fake(procs), None).unwrap();
        assert_eq!(d.engines.len(), 1, "{d:#?}");
        let e = &d.engines[0];
        // The root launched the API servers: the engine's API server is the first of them.
        assert_eq!(
            (
                e.api_server_pid,
                e.engine_core_pids.clone(),
                e.worker_pids.clone()
            ),
            (11, vec![14, 15], vec![16, 17])
        );
        assert_eq!(
            e.metrics_url, "http://127.0.0.1:8000/metrics",
            "from the root's argv"
        );
        let roles: Vec<&str> = d.roles.values().map(|s| s.as_str()).collect();
        assert_eq!(
            roles,
            vec![
                "serve_launcher",
                "api_server_0",
                "api_server_1",
                "dp_coordinator",
                "engine_core_dp0",
                "engine_core_dp1",
                "worker_dp0",
                "worker_dp1"
            ]
        );
    }

    /// `VLLM_USE_RUST_FRONTEND=1`: `vllm serve` starts the engine core and the `vllm-rs
    /// frontend` binary, which serves HTTP on the socket it inherits.
    #[test]
    fn rust_frontend_is_the_api_server_and_not_python() {
        let procs = vec![
            p(
                10,
                1,
                "vllm",
                "/v/bin/python /v/bin/vllm serve m --port 8123",
                9,
            ),
            titled(11, 10, "VLLM::EngineCore", 15),
            titled(12, 11, "VLLM::Worker", 40),
            p(
                13,
                10,
                "vllm-rs",
                "/v/bin/vllm-rs frontend --listen-fd 9 --input-listener-fd 11 \
                 --output-listener-fd 12 --engine-start-index 0 --engine-count 1 \
                 --data-parallel-size 1 --args-json {}",
                6,
            ),
            // Not a front-end: another child of the same parent with a "frontend" word.
            p(14, 10, "sh", "/bin/sh frontend", 1),
        ];
        let d = discover_with(&fake(procs), None).unwrap();
        assert_eq!(d.engines.len(), 1, "{d:#?}");
        let e = &d.engines[0];
        assert_eq!(
            (
                e.api_server_pid,
                e.api_server_pids.clone(),
                e.metrics_url.as_str()
            ),
            (13, vec![13], "http://127.0.0.1:8123/metrics")
        );
        let roles: Vec<(i32, &str)> = d.roles.iter().map(|(p, r)| (*p, r.as_str())).collect();
        assert_eq!(
            roles,
            vec![
                (10, "serve_launcher"),
                (11, "engine_core"),
                (12, "worker"),
                (13, "rust_frontend")
            ]
        );
        assert_eq!(
            d.python_pids().into_iter().collect::<Vec<_>>(),
            vec![10, 11, 12],
            "the front-end is never read as CPython"
        );
    }

    #[test]
    fn serve_without_engine_core_yet_and_in_process_workers() {
        let procs = vec![
            // vllm serve still loading: no children yet.
            p(
                10,
                1,
                "vllm",
                "/v/bin/python /v/bin/vllm serve m --port 8002",
                5,
            ),
            // LLM(...) with the engine in-process, tensor parallel: workers are its children.
            p(20, 1, "python", "python batch.py", 9),
            titled(21, 20, "VLLM::Worker_TP0", 4),
            titled(22, 20, "VLLM::Worker_TP1", 4),
            // An engine core whose parent died (reparented to init), with its worker: seen
            // after SIGTERM to an offline script.
            titled(30, 1, "VLLM::EngineCore", 4),
            titled(31, 30, "VLLM::Worker", 4),
        ];
        let d = discover_with(&fake(procs), None).unwrap();
        assert_eq!(d.engines.len(), 3, "{d:#?}");
        assert_eq!(d.engines[0].api_server_pid, 10);
        assert!(d.engines[0].engine_core_pids.is_empty());
        assert_eq!(d.engines[1].worker_pids, vec![21, 22]);
        assert_eq!(d.roles[&20], "offline_llm");
        let orphan = &d.engines[2];
        assert_eq!(
            (
                orphan.api_server_pid,
                orphan.engine_core_pids.clone(),
                orphan.worker_pids.clone()
            ),
            (0, vec![30], vec![31])
        );
        let roles: Vec<&str> = d.processes_of("engine2").map(|p| p.role.as_str()).collect();
        assert_eq!(roles, ["engine_core", "worker"]);
    }

    #[test]
    fn rediscovery_keeps_ids_and_lists_changes() {
        let mut procs = serve_tree();
        procs.push(p(3000, 1, "python", "python offline.py", 9));
        procs.push(titled(3001, 3000, "VLLM::EngineCore", 15));
        let d0 = discover_with(&fake(procs.clone()), None).unwrap();
        assert_eq!(
            d0.engines.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
            ["engine0", "engine1"]
        );

        // The serve engine exits; the offline one gets a worker; a new server starts with a
        // lower pid (pids wrap): it must not take engine0.
        let mut later: Vec<ProcEntry> = procs
            .into_iter()
            .filter(|p| !(1385..=1975).contains(&p.pid))
            .collect();
        later.push(titled(3002, 3001, "VLLM::Worker", 30));
        later.push(p(
            500,
            1,
            "vllm",
            "/v/bin/python /v/bin/vllm serve m --port 8003",
            12,
        ));
        later.push(titled(501, 500, "VLLM::EngineCore", 15));
        let fresh = discover_with(&fake(later), None).unwrap();
        assert_eq!(
            fresh.engines[0].api_server_pid, 500,
            "fresh numbering follows pids"
        );
        let (d1, ch) = reconcile(&d0, fresh);
        let ids: Vec<(&str, i32)> = d1
            .engines
            .iter()
            .map(|e| (e.id.as_str(), e.engine_core_pids[0]))
            .collect();
        assert_eq!(ids, vec![("engine1", 3001), ("engine2", 501)]);
        assert_eq!(ch.exited_pids, vec![1385, 1528, 1975]);
        assert_eq!(
            ch.new_pids,
            vec![
                (500, "api_server".to_string()),
                (501, "engine_core".into()),
                (3002, "worker".into())
            ]
        );
        assert_eq!(ch.gone_engines, vec!["engine0".to_string()]);
        assert_eq!(
            ch.changed_engines
                .iter()
                .map(|e| e.id.as_str())
                .collect::<Vec<_>>(),
            ["engine1", "engine2"]
        );
        assert_eq!(
            d1.processes_of("engine1")
                .map(|p| p.pid)
                .collect::<Vec<_>>(),
            [3000, 3001, 3002]
        );
        assert_eq!(d1.next_engine_index, 3);

        // Nothing changed: an empty change; a worker adding its ranks is a role change.
        let (d2, ch) = reconcile(&d1, d1.clone());
        assert!(ch.is_empty(), "{ch:?}");
        let mut retitled = d2.clone();
        retitled.roles.insert(3002, "worker_tp0".into());
        let (_, ch) = reconcile(&d2, retitled);
        assert_eq!(ch.role_changes, vec![(3002, "worker_tp0".to_string())]);
    }

    #[test]
    fn argv_values() {
        let a: Vec<String> = "x --port 1 --host=h --port=2 --flag"
            .split(' ')
            .map(String::from)
            .collect();
        assert_eq!(argv_value(&a, "--port"), Some("2"));
        assert_eq!(argv_value(&a, "--host"), Some("h"));
        assert_eq!(argv_value(&a, "--flag"), None);
        assert_eq!(argv_value(&a, "--po"), None);
    }

    /// The live /proc reader finds this test process's own listening socket.
    #[test]
    fn live_listening_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let got = LiveProc.listening_tcp(std::process::id() as i32);
        assert!(got.contains(&addr), "{addr} not in {got:?}");
        let all = LiveProc.processes().unwrap();
        let me = all
            .iter()
            .find(|e| e.pid == std::process::id() as i32)
            .unwrap();
        assert!(me.threads >= 1 && !me.argv.is_empty());
    }
}
