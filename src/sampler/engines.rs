//! `record --vllm`: the engines as discovered, their metrics scraper, and rediscovery of engine
//! processes that start later. The recording loop polls it every tick whatever the source.

use std::time::{Duration, Instant};

use super::{Pipeline, RecordOptions};
use crate::record::{EngineInfo, ProcessInfo};
use crate::sys::monotonic_ns;
use crate::vllm::discover::{self, Discovery};
use crate::vllm::metrics::{ScrapeEvent, Scraper};

/// How often engines are discovered again while recording.
const REDISCOVER_EVERY: Duration = Duration::from_secs(2);

/// Discover the engines `record --vllm` records (only those `--engine-pid` and `--engine-port`
/// ask for, when given), saying what was found unless quiet.
pub fn discover_engines(opts: &RecordOptions) -> anyhow::Result<Discovery> {
    let mut d = discover::discover_engines(opts.metrics_url.as_deref())?;
    restrict(&mut d, opts);
    if !opts.quiet {
        for w in &d.warnings {
            eprintln!("enginescope: {w}");
        }
        for e in &d.engines {
            eprintln!(
                "enginescope: {}: API server {}, engine core {:?}, workers {:?}, metrics {}",
                e.id,
                match e.api_servers().as_slice() {
                    [] => "-".to_string(),
                    [one] => one.to_string(),
                    many => format!("{many:?}"),
                },
                e.engine_core_pids,
                e.worker_pids,
                if e.metrics_url.is_empty() {
                    "-"
                } else {
                    &e.metrics_url
                }
            );
        }
    }
    anyhow::ensure!(
        !d.engines.is_empty() || !opts.pids.is_empty(),
        "no vLLM engine found on this host{} (looked for `vllm serve` API servers, VLLM::EngineCore and VLLM::Worker processes); start one, pass --pid, or give --metrics-url for a remote engine",
        match (opts.vllm_root_pid, opts.vllm_port.as_slice()) {
            (Some(pid), _) => format!(" whose API server is pid {pid}"),
            (None, [port]) => format!(" serving on port {port}"),
            (None, []) => String::new(),
            (None, ports) => format!(" serving on any of ports {ports:?}"),
        }
    );
    Ok(d)
}

/// `--pid … --metrics-url URL` without `--vllm`: the targets as one engine whose metrics are
/// at `url` (its processes stand as engine cores: nothing is discovered, nothing rediscovered).
pub(crate) fn of_targets(pids: &[i32], url: &str) -> Discovery {
    Discovery {
        engines: vec![EngineInfo {
            id: "engine0".into(),
            engine_core_pids: pids.to_vec(),
            metrics_url: url.to_string(),
            metrics_url_source: "--metrics-url".into(),
            ..Default::default()
        }],
        next_engine_index: 1,
        ..Default::default()
    }
}

/// Keep only the engines `--engine-pid` and `--engine-port` ask for (all without either).
fn restrict(d: &mut Discovery, opts: &RecordOptions) {
    let mut keep: Option<std::collections::BTreeSet<String>> = None;
    if let Some(root) = opts.vllm_root_pid {
        keep = Some(
            d.processes
                .iter()
                .filter(|p| p.pid == root)
                .map(|p| p.engine.clone())
                .collect(),
        );
    }
    if !opts.vllm_port.is_empty() {
        let on_port = d
            .engines
            .iter()
            .filter(|e| url_port(&e.metrics_url).is_some_and(|p| opts.vllm_port.contains(&p)))
            .map(|e| e.id.clone());
        keep = Some(match keep {
            Some(k) => on_port.filter(|id| k.contains(id)).collect(),
            None => on_port.collect(),
        });
    }
    let Some(keep) = keep else { return };
    d.engines.retain(|e| keep.contains(&e.id));
    d.processes.retain(|p| keep.contains(&p.engine));
    let pids: std::collections::BTreeSet<i32> = d.processes.iter().map(|p| p.pid).collect();
    d.roles.retain(|pid, _| pids.contains(pid));
}

/// The port of `http://host:port/...` (None without one).
fn url_port(url: &str) -> Option<u16> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let (_, port) = authority.rsplit_once(':')?;
    port.parse().ok()
}

/// A `record --vllm` session: the engines as last discovered and the metrics scraper.
pub struct EngineSession {
    // Dropped before the scraper, whose thread may be waiting for room in the channel.
    rx: std::sync::mpsc::Receiver<ScrapeEvent>,
    scraper: Scraper,
    discovery: Discovery,
    last: Instant,
    pub metric_points: u64,
    pub scrape_errors: u64,
}

impl EngineSession {
    /// Write the engines and start scraping their metrics.
    pub fn start(
        discovery: Discovery,
        pipe: &mut Pipeline,
        opts: &RecordOptions,
    ) -> anyhow::Result<Self> {
        for e in &discovery.engines {
            pipe.writer.engine(&EngineInfo {
                t_ns: 0,
                ..e.clone()
            })?;
        }
        let (scraper, rx) = Scraper::spawn(
            discovery.engines.clone(),
            opts.scrape_interval,
            pipe.start_ns,
        )?;
        Ok(EngineSession {
            rx,
            scraper,
            discovery,
            last: Instant::now(),
            metric_points: 0,
            scrape_errors: 0,
        })
    }

    /// The role discovery gave `pid` ("" when none).
    /// (engine id, metrics URL) of each engine that has one.
    pub(crate) fn metrics_urls(&self) -> Vec<(String, String)> {
        self.discovery
            .engines
            .iter()
            .filter(|e| !e.metrics_url.is_empty())
            .map(|e| (e.id.clone(), e.metrics_url.clone()))
            .collect()
    }

    pub fn role(&self, pid: i32) -> String {
        self.discovery.roles.get(&pid).cloned().unwrap_or_default()
    }

    /// Write whatever the metrics scraper has sent since the last call.
    pub(crate) fn poll_metrics(&mut self, pipe: &mut Pipeline) -> anyhow::Result<()> {
        while let Ok(ev) = self.rx.try_recv() {
            self.write(ev, pipe)?;
        }
        Ok(())
    }

    fn write(&mut self, ev: ScrapeEvent, pipe: &mut Pipeline) -> anyhow::Result<()> {
        match ev {
            ScrapeEvent::Series(s) => pipe.writer.series(&s)?,
            ScrapeEvent::Points(ps) => {
                for p in &ps {
                    pipe.writer.metric(p)?;
                }
                self.metric_points += ps.len() as u64;
            }
            ScrapeEvent::Error(e) => {
                self.scrape_errors += 1;
                pipe.writer.scrape_error(&e)?;
            }
        }
        Ok(())
    }

    /// Stop the scraper and write what it sent until it stopped.
    pub fn finish(&mut self, pipe: &mut Pipeline) -> anyhow::Result<()> {
        self.scraper.request_stop();
        // Until the thread has stopped and closed the channel (after one request at most).
        while let Ok(ev) = self.rx.recv() {
            self.write(ev, pipe)?;
        }
        Ok(())
    }

    /// Every [`REDISCOVER_EVERY`]: discover again; write changed engines and roles, point the
    /// scraper at the engines now present, and return the processes that appeared (pid, role).
    pub(crate) fn rediscover_due(
        &mut self,
        pipe: &mut Pipeline,
        opts: &RecordOptions,
    ) -> anyhow::Result<Vec<(i32, String)>> {
        if !opts.vllm || self.last.elapsed() < REDISCOVER_EVERY {
            return Ok(Vec::new());
        }
        self.last = Instant::now();
        let fresh = match discover::discover_engines(opts.metrics_url.as_deref()) {
            Ok(mut d) => {
                restrict(&mut d, opts);
                d
            }
            // /proc raced with exiting processes: try again next time.
            Err(_) => return Ok(Vec::new()),
        };
        let (fresh, change) = discover::reconcile(&self.discovery, fresh);
        if change.is_empty() {
            return Ok(Vec::new());
        }
        let now = pipe.rel(monotonic_ns());
        for e in &change.changed_engines {
            pipe.writer.engine(&EngineInfo {
                t_ns: now,
                ..e.clone()
            })?;
        }
        if !change.changed_engines.is_empty() || !change.gone_engines.is_empty() {
            self.scraper.set_engines(fresh.engines.clone());
        }
        for (pid, role) in &change.role_changes {
            if let Some(p) = fresh.processes.iter().find(|p| p.pid == *pid) {
                pipe.writer.process(&ProcessInfo {
                    pid: *pid,
                    cmdline: p.cmdline.clone(),
                    python_version: String::new(),
                    role: role.clone(),
                })?;
            }
        }
        if !opts.quiet {
            for e in &change.changed_engines {
                eprintln!(
                    "enginescope: engine {} changed: engine core {:?}, workers {:?}",
                    e.id, e.engine_core_pids, e.worker_pids
                );
            }
            for id in &change.gone_engines {
                eprintln!("enginescope: engine {id} is gone");
            }
        }
        self.discovery = fresh;
        let mut new = change.new_pids;
        new.retain(|(_, role)| role != crate::vllm::discover::ROLE_RUST_FRONTEND);
        if let Some(root) = opts.vllm_root_pid {
            new.retain(|(pid, _)| crate::procinfo::descends_from(*pid, root));
        }
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm::discover::EngineProcess;

    fn two_engines() -> Discovery {
        let mut d = Discovery::default();
        for (n, port, pid) in [(0, 8000, 100), (1, 9000, 200)] {
            d.engines.push(EngineInfo {
                id: format!("engine{n}"),
                metrics_url: format!("http://127.0.0.1:{port}/metrics"),
                ..Default::default()
            });
            for (k, role) in ["api_server", "engine_core"].iter().enumerate() {
                let pid = pid + k as i32;
                d.processes.push(EngineProcess {
                    pid,
                    ppid: 1,
                    engine: format!("engine{n}"),
                    role: role.to_string(),
                    cmdline: String::new(),
                    threads: 1,
                });
                d.roles.insert(pid, role.to_string());
            }
        }
        d
    }

    #[test]
    fn engine_port_and_engine_pid_keep_their_engines() {
        let mut opts = RecordOptions::new(Vec::new(), "x".into());
        let mut d = two_engines();
        restrict(&mut d, &opts);
        assert_eq!(d, two_engines());
        opts.vllm_port = vec![9000];
        restrict(&mut d, &opts);
        assert_eq!(d.engines.len(), 1);
        assert_eq!(d.engines[0].id, "engine1");
        assert_eq!(
            d.processes.iter().map(|p| p.pid).collect::<Vec<_>>(),
            [200, 201]
        );
        assert_eq!(d.roles.keys().copied().collect::<Vec<_>>(), [200, 201]);
        // Two ports: the engines on either.
        let mut d = two_engines();
        opts.vllm_port = vec![8000, 9000];
        restrict(&mut d, &opts);
        assert_eq!(d, two_engines());
        opts.vllm_port = vec![7000, 9000];
        restrict(&mut d, &opts);
        assert_eq!(d.engines.len(), 1);
        assert_eq!(d.engines[0].id, "engine1");
        opts.vllm_port = vec![9000];
        // Both: the engine that has the pid and serves on the port, or none.
        let mut d = two_engines();
        opts.vllm_root_pid = Some(100);
        restrict(&mut d, &opts);
        assert!(d.engines.is_empty() && d.processes.is_empty() && d.roles.is_empty());
        let mut d = two_engines();
        opts.vllm_port.clear();
        restrict(&mut d, &opts);
        assert_eq!(d.engines.len(), 1);
        assert_eq!(d.engines[0].id, "engine0");
    }

    #[test]
    fn a_metrics_urls_port() {
        assert_eq!(url_port("http://127.0.0.1:8142/metrics"), Some(8142));
        assert_eq!(url_port("http://[::1]:8000/metrics"), Some(8000));
        assert_eq!(url_port("https://host/metrics"), None);
        assert_eq!(url_port(""), None);
        assert_eq!(url_port("http://h:notaport/metrics"), None);
    }
}
