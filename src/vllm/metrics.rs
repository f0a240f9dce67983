//! Scraping an engine's Prometheus `/metrics`.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use enginescope::vllm::{discover::discover_engines, metrics::{Scraper, ScrapeEvent}};
//! let d = discover_engines(None)?;
//! let start = enginescope::sys::monotonic_ns(); // the recording's Meta::start_mono_ns
//! let (scraper, events) = Scraper::spawn(d.engines.clone(), std::time::Duration::from_secs(1), start)?;
//! for ev in events.try_iter() {
//!     match ev {
//!         ScrapeEvent::Series(s) => { /* writer.series(&s) — always before its points */ }
//!         ScrapeEvent::Points(ps) => { /* for p in &ps { writer.metric(p) } */ }
//!         ScrapeEvent::Error(e) => { /* writer.scrape_error(&e) */ }
//!     }
//! }
//! scraper.set_engines(d.engines.clone()); // after a rediscovery changed them
//! scraper.stop(); // returns at once
//! # Ok(()) }
//! ```
//!
//! What is kept: every sample named `vllm:*` except prometheus_client's `*_created`
//! timestamps, at most [`MAX_SERIES_PER_ENGINE`] series per engine (new series past that are
//! dropped and reported once as a [`ScrapeError`]). Series ids are assigned in order of first
//! appearance, from 0, and never change while the scraper runs, so they index
//! `Recording::series` when this scraper is the only writer of series.
//!
//! Every point of one scrape carries the same `t_ns` (when its response's head arrived), which
//! [`crate::metrics`] relies on to group a scrape's points.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::prom_text::{self, Exposition};
use crate::record::{EngineInfo, MetricPoint, MetricSeries, ScrapeError};

/// Series kept per engine; vLLM 0.32 exposes ~330 (idle) to ~400 (with every finish reason
/// and waiting reason seen) `vllm:` series per DP rank.
pub const MAX_SERIES_PER_ENGINE: usize = 2000;

/// Largest `/metrics` body read (vLLM's is ~55 KB per DP rank).
const MAX_BODY_BYTES: u64 = 16 << 20;

/// Samples the scraper keeps.
pub fn is_kept(name: &str) -> bool {
    name.starts_with("vllm:") && !name.ends_with("_created")
}

/// An HTTP agent for scraping: plain HTTP, `timeout` for the whole request.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .user_agent(concat!("enginescope/", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// GET `url`, returning the body of a 200 response and when its head arrived
/// (`CLOCK_MONOTONIC` ns), or an error that says what failed.
///
/// The head's time is the point's: a server renders `/metrics` and then sends head and body
/// together, so on a saturated API server, whose answer can wait seconds in its event loop,
/// the head's arrival is the nearest our side can see to when the counters were read.
pub(crate) fn get_text(agent: &ureq::Agent, url: &str) -> Result<(String, u64), String> {
    if url.starts_with("https://") {
        return Err(format!(
            "{url}: https is not supported (enginescope is built without TLS); \
             scrape the engine's plain-HTTP port or put a local proxy in front"
        ));
    }
    let mut resp = agent.get(url).call().map_err(|e| match e {
        ureq::Error::Timeout(_) => format!("GET {url}: timed out; is the engine overloaded or the URL wrong?"),
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            format!("GET {url}: connection refused; is the engine running and listening there? (--metrics-url to choose)")
        }
        e => format!("GET {url}: {e}"),
    })?;
    let head_ns = crate::sys::monotonic_ns();
    let status = resp.status();
    if status != 200 {
        return Err(format!(
            "GET {url}: HTTP {status}; the server answers but not with metrics (wrong port or path?)"
        ));
    }
    resp.body_mut()
        .with_config()
        .limit(MAX_BODY_BYTES)
        .read_to_string()
        .map(|text| (text, head_ns))
        .map_err(|e| format!("GET {url}: reading the body: {e}"))
}

/// Fetch and parse one `/metrics`, keeping the `vllm:` samples.
pub fn fetch(url: &str, timeout: Duration) -> Result<Exposition, String> {
    let (text, _) = get_text(&agent(timeout), url)?;
    Ok(prom_text::parse(&text, is_kept))
}

/// Result of checking that a URL serves vLLM metrics (for `discover`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LiveCheck {
    pub url: String,
    pub ok: bool,
    /// `vllm:` series in the answer.
    pub vllm_series: usize,
    /// Distinct `vllm:` sample names.
    pub vllm_names: usize,
    /// Of the families enginescope's summaries use, those absent under every spelling
    /// (`metrics::names::RELIED_ON`), by current name.
    pub missing: Vec<String>,
    /// Of those, the engine's gauges that an engine with several API servers serves only
    /// once it has published its first stats (Prometheus multiprocess mode writes a gauge
    /// when it is first set): absent before the first request, not unreadable
    /// ([`LiveCheck::several_api_servers`]). Left in `missing` too.
    pub not_yet: Vec<String>,
    pub error: String,
}

impl LiveCheck {
    /// An engine with several API servers (`--api-server-count N`) serves its gauges
    /// (running, waiting, KV usage) only after its first stats: those of `missing` go to
    /// `not_yet` as well, so that the check says they are to come rather than absent.
    pub(crate) fn several_api_servers(&mut self) {
        let gauges = [
            crate::metrics::names::RUNNING.name,
            crate::metrics::names::WAITING.name,
            crate::metrics::names::KV_CACHE_USAGE.name,
        ];
        self.not_yet = self
            .missing
            .iter()
            .filter(|m| gauges.contains(&m.as_str()))
            .cloned()
            .collect();
    }
}

/// Check that `url` answers with `vllm:` metrics.
pub fn check(url: &str, timeout: Duration) -> LiveCheck {
    let mut c = LiveCheck {
        url: url.to_string(),
        ..Default::default()
    };
    if url.is_empty() {
        c.error = "no metrics URL (an offline LLM(...) engine serves none)".into();
        return c;
    }
    match fetch(url, timeout) {
        Err(e) => c.error = e,
        Ok(exp) => {
            c.vllm_series = exp.samples.len();
            let names: std::collections::BTreeSet<&str> =
                exp.samples.iter().map(|s| s.name.as_str()).collect();
            c.vllm_names = names.len();
            c.missing = crate::metrics::names::missing(&names);
            c.ok = c.vllm_series > 0;
            if !c.ok {
                c.error = format!(
                    "{url} answers, but with no vllm: metrics (another server on that port?)"
                );
            }
        }
    }
    c
}

/// What the scraper sends.
#[derive(Debug, Clone, PartialEq)]
pub enum ScrapeEvent {
    /// A series seen for the first time; always sent before any point that refers to it.
    Series(MetricSeries),
    /// One scrape of one engine: a point per kept series, all with the same `t_ns`.
    Points(Vec<MetricPoint>),
    /// A failed scrape (or a note such as the series limit); never fatal.
    Error(ScrapeError),
}

/// Series ids: stable per (engine, name, labels), bounded per engine.
#[derive(Default)]
struct SeriesTable {
    ids: HashMap<(String, String, BTreeMap<String, String>), u32>,
    per_engine: HashMap<String, usize>,
    limit_reported: std::collections::HashSet<String>,
    next: u32,
}

impl SeriesTable {
    /// Forget the series of engines no longer scraped (engines come and go for hours). Their
    /// ids are not given out again, so an id still names one series.
    fn retain_engines(&mut self, engines: &[EngineInfo]) {
        let keep: std::collections::HashSet<&str> = engines.iter().map(|e| e.id.as_str()).collect();
        self.ids.retain(|(e, _, _), _| keep.contains(e.as_str()));
        self.per_engine.retain(|e, _| keep.contains(e.as_str()));
        self.limit_reported.retain(|e| keep.contains(e.as_str()));
    }

    /// Points (and new series) for one engine's scrape.
    fn ingest(&mut self, engine: &str, url: &str, exp: Exposition, t_ns: u64) -> Vec<ScrapeEvent> {
        let mut events = Vec::new();
        let mut points = Vec::with_capacity(exp.samples.len());
        let mut dropped = 0usize;
        for s in exp.samples {
            let key = (engine.to_string(), s.name, s.labels);
            let id = match self.ids.get(&key) {
                Some(id) => *id,
                None => {
                    let n = self.per_engine.entry(engine.to_string()).or_default();
                    if *n >= MAX_SERIES_PER_ENGINE {
                        dropped += 1;
                        continue;
                    }
                    *n += 1;
                    let id = self.next;
                    self.next += 1;
                    events.push(ScrapeEvent::Series(MetricSeries {
                        id,
                        engine: engine.to_string(),
                        name: key.1.clone(),
                        labels: key.2.clone(),
                        kind: s.kind.as_str().to_string(),
                    }));
                    self.ids.insert(key, id);
                    id
                }
            };
            points.push(MetricPoint {
                t_ns,
                series: id,
                value: s.value,
            });
        }
        if dropped > 0 && self.limit_reported.insert(engine.to_string()) {
            events.push(ScrapeEvent::Error(ScrapeError {
                t_ns,
                engine: engine.to_string(),
                url: url.to_string(),
                error: format!(
                    "more than {MAX_SERIES_PER_ENGINE} vllm: series; {dropped} new series dropped \
                     (this note is given once per engine)"
                ),
            }));
        }
        if exp.bad_lines > 0 {
            events.push(ScrapeEvent::Error(ScrapeError {
                t_ns,
                engine: engine.to_string(),
                url: url.to_string(),
                error: format!(
                    "{} unparsable vllm: lines skipped: {}",
                    exp.bad_lines,
                    exp.errors.join("; ")
                ),
            }));
        }
        if !points.is_empty() {
            events.push(ScrapeEvent::Points(points));
        }
        events
    }
}

/// What the scraper's coordinator thread receives: control from the owner, results from
/// the per-engine threads.
enum Msg {
    Stop,
    SetEngines(Vec<EngineInfo>),
    /// One scrape of one engine: the parsed page or why it failed, and when it ended.
    Scraped {
        engine: String,
        url: String,
        result: Result<Exposition, String>,
        t_ns: u64,
    },
}

/// Events the scraper may have sent and the recorder not yet written: the channel is bounded
/// so that a recorder that falls behind holds the scraper back (engines skip ticks) instead of
/// growing without limit. The recorder drains it every tick (20 ms or a sampling period).
pub(crate) const SCRAPE_QUEUE: usize = 4096;

/// Scrapes engines' `/metrics`, each engine on a thread of its own: a slow API server (a busy
/// engine answers late) delays only its own scrapes, never another engine's. A coordinator
/// thread numbers series and sends events in order. Dropping it stops it too (drop the
/// events receiver first).
pub struct Scraper {
    ctl: Sender<Msg>,
    thread: Option<JoinHandle<()>>,
}

/// The per-request timeout: 5 intervals, within 30–120 s. A loaded API server answers
/// `/metrics` late, while its counters keep counting, so a late answer is still a good point
/// (stamped when its head arrived) and only a server that answers nothing for that long is a
/// failed scrape. Measured on 2 CPUs, vLLM at 24 concurrent requests: 8 of 10 scrapes over
/// 2 s; answers up to 3.6 s with the CPUs loaded; a CI run with a 5 s timeout lost 3 of 24.
/// Each engine has its own thread, so a long wait only skips that engine's ticks (counted
/// neither as scrapes nor as failures; the longest gap between scrapes shows it), and stopping
/// never waits for a request.
pub(crate) fn request_timeout(interval: Duration) -> Duration {
    (interval * 5).clamp(Duration::from_secs(30), Duration::from_secs(120))
}

impl Scraper {
    /// Start scraping `engines` (those with a `metrics_url`) every `interval`; times are ns
    /// since `start_mono_ns` (`CLOCK_MONOTONIC`, as `sys::monotonic_ns`). The first scrape
    /// of each engine happens at once.
    pub fn spawn(
        engines: Vec<EngineInfo>,
        interval: Duration,
        start_mono_ns: u64,
    ) -> anyhow::Result<(Scraper, Receiver<ScrapeEvent>)> {
        Self::spawn_with_timeout(engines, interval, request_timeout(interval), start_mono_ns)
    }

    /// [`Self::spawn`] with a request timeout other than [`request_timeout`]'s.
    pub fn spawn_with_timeout(
        engines: Vec<EngineInfo>,
        interval: Duration,
        timeout: Duration,
        start_mono_ns: u64,
    ) -> anyhow::Result<(Scraper, Receiver<ScrapeEvent>)> {
        anyhow::ensure!(
            interval >= Duration::from_millis(10),
            "scrape interval {interval:?} is too short (at least 10 ms)"
        );
        let (tx, rx) = mpsc::sync_channel(SCRAPE_QUEUE);
        let (ctl, ctl_rx) = mpsc::channel();
        let to_self = ctl.clone();
        let thread = std::thread::Builder::new()
            .name("es-scraper".into())
            .spawn(move || {
                let timing = Timing {
                    interval,
                    timeout,
                    start_mono_ns,
                };
                coordinate(engines, timing, &tx, &ctl_rx, to_self)
            })
            .map_err(|e| anyhow::anyhow!("starting the metrics scraper thread: {e}"))?;
        Ok((
            Scraper {
                ctl,
                thread: Some(thread),
            },
            rx,
        ))
    }

    /// Replace the engines scraped (after a rediscovery); series ids stay.
    pub(crate) fn set_engines(&self, engines: Vec<EngineInfo>) {
        // A stopped thread has nothing to update.
        let _ = self.ctl.send(Msg::SetEngines(engines));
    }

    /// Ask the coordinator to stop; the events channel closes when it has. A reader drains
    /// the channel until then (the coordinator may be waiting for room in it), then calls
    /// [`Self::stop`]. An engine thread in the middle of a request ends when it returns,
    /// sending nothing more.
    pub(crate) fn request_stop(&self) {
        let _ = self.ctl.send(Msg::Stop);
    }

    /// Stop and wait for the coordinator (it never waits on HTTP). The events receiver must
    /// be drained or dropped first: the coordinator may be waiting for room in the channel.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let _ = self.ctl.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                eprintln!("enginescope: the metrics scraper thread panicked (a bug; please report it with the lines above); no more metrics are recorded");
            }
        }
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn since(start_mono_ns: u64) -> u64 {
    crate::sys::monotonic_ns().saturating_sub(start_mono_ns)
}

/// One engine's scraping thread; dropping it tells the thread to end.
struct EngineThread {
    url: String,
    _stop: Sender<()>,
}

/// When and how long the engine threads scrape.
#[derive(Clone, Copy)]
struct Timing {
    interval: Duration,
    /// Per request.
    timeout: Duration,
    /// What `t_ns` counts from (`CLOCK_MONOTONIC` ns).
    start_mono_ns: u64,
}

/// Start a thread scraping `url` every `timing.interval` until `stop`'s sender is dropped.
fn spawn_engine(
    engine: String,
    url: String,
    timing: Timing,
    out: Sender<Msg>,
) -> Option<EngineThread> {
    let Timing {
        interval,
        timeout,
        start_mono_ns,
    } = timing;
    let (stop_tx, stop) = mpsc::channel::<()>();
    let u = url.clone();
    let spawned = std::thread::Builder::new()
        .name("es-scrape".into())
        .spawn(move || {
            let agent = agent(timeout);
            let mut next_tick = Instant::now();
            loop {
                let (result, t_ns) = match get_text(&agent, &u) {
                    Ok((text, head_ns)) => (
                        Ok(prom_text::parse(&text, is_kept)),
                        head_ns.saturating_sub(start_mono_ns),
                    ),
                    Err(e) => (Err(e), since(start_mono_ns)),
                };
                // Told to stop while the request ran: send nothing more.
                if !matches!(stop.try_recv(), Err(mpsc::TryRecvError::Empty)) {
                    return;
                }
                let msg = Msg::Scraped {
                    engine: engine.clone(),
                    url: u.clone(),
                    result,
                    t_ns,
                };
                if out.send(msg).is_err() {
                    return;
                }
                // Fixed rate; ticks missed while a slow scrape ran are skipped, not caught up.
                next_tick += interval;
                let now = Instant::now();
                if next_tick < now {
                    let behind = (now - next_tick).as_nanos() / interval.as_nanos().max(1);
                    next_tick += interval * (behind as u32 + 1);
                }
                match stop.recv_timeout(next_tick.saturating_duration_since(Instant::now())) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
            }
        });
    match spawned {
        Ok(_) => Some(EngineThread {
            url,
            _stop: stop_tx,
        }),
        Err(e) => {
            eprintln!("enginescope: starting a scrape thread for {url}: {e}");
            None
        }
    }
}

fn coordinate(
    engines: Vec<EngineInfo>,
    timing: Timing,
    tx: &SyncSender<ScrapeEvent>,
    ctl: &Receiver<Msg>,
    to_self: Sender<Msg>,
) {
    let mut table = SeriesTable::default();
    let mut threads: HashMap<String, EngineThread> = HashMap::new();
    let set = |threads: &mut HashMap<String, EngineThread>, engines: &[EngineInfo]| {
        // Keep a thread whose engine still has the same URL; end the others.
        threads.retain(|id, t| {
            engines
                .iter()
                .any(|e| &e.id == id && e.metrics_url == t.url)
        });
        for e in engines.iter().filter(|e| !e.metrics_url.is_empty()) {
            if !threads.contains_key(&e.id) {
                if let Some(t) =
                    spawn_engine(e.id.clone(), e.metrics_url.clone(), timing, to_self.clone())
                {
                    threads.insert(e.id.clone(), t);
                }
            }
        }
    };
    set(&mut threads, &engines);
    for msg in ctl.iter() {
        match msg {
            Msg::Stop => return,
            Msg::SetEngines(new) => {
                table.retain_engines(&new);
                set(&mut threads, &new);
            }
            Msg::Scraped {
                engine,
                url,
                result,
                t_ns,
            } => {
                // A result from an engine dropped meanwhile (or re-pointed) is not wanted.
                if threads.get(&engine).is_none_or(|t| t.url != url) {
                    continue;
                }
                let events = match result {
                    Ok(exp) => table.ingest(&engine, &url, exp, t_ns),
                    Err(error) => vec![ScrapeEvent::Error(ScrapeError {
                        t_ns,
                        engine,
                        url,
                        error,
                    })],
                };
                for ev in events {
                    if tx.send(ev).is_err() {
                        return; // nobody listens any more
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    const SAMPLE: &str = include_str!("testdata/metrics-sample.txt");

    /// A one-thread HTTP server answering each GET with the next body from `bodies`
    /// (the last repeats), and counting requests. Stops when `bodies` is exhausted + 100.
    fn serve(bodies: Vec<(u16, String)>) -> (String, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/metrics", l.local_addr().unwrap());
        let h = std::thread::spawn(move || {
            let n = bodies.len();
            for i in 0..n + 100 {
                let Ok((mut s, _)) = l.accept() else { return };
                let mut buf = [0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => got.extend_from_slice(&buf[..k]),
                    }
                }
                if got.starts_with(b"GET /stop") {
                    return;
                }
                let (status, body) = &bodies[i.min(n - 1)];
                let _ = write!(
                    s,
                    "HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (url, h)
    }

    fn engine(id: &str, url: &str) -> EngineInfo {
        EngineInfo {
            id: id.into(),
            metrics_url: url.into(),
            ..Default::default()
        }
    }

    #[test]
    fn fetch_and_check_against_a_local_server() {
        let (url, h) = serve(vec![
            (200, SAMPLE.to_string()),
            (404, "nope".into()),
            (200, "other_metric 1\n".into()),
        ]);
        let c = check(&url, Duration::from_secs(5));
        assert!(c.ok, "{c:?}");
        // 374 vllm: samples less 44 _created ones.
        assert_eq!(c.vllm_series, 330);
        assert!(c.missing.is_empty(), "{:?}", c.missing);
        let c = check(&url, Duration::from_secs(5));
        assert!(!c.ok && c.error.contains("HTTP 404"), "{c:?}");
        let c = check(&url, Duration::from_secs(5));
        assert!(!c.ok && c.error.contains("no vllm: metrics"), "{c:?}");
        let _ = ureq::get(&url.replace("/metrics", "/stop")).call();
        h.join().unwrap();
        // Nothing listens any more.
        let c = check(&url, Duration::from_secs(5));
        assert!(!c.ok && c.error.contains("refused"), "{c:?}");
        assert!(check("https://x/metrics", Duration::from_secs(1))
            .error
            .contains("https"));
    }

    #[test]
    fn series_ids_are_stable_and_bounded() {
        let mut t = SeriesTable::default();
        let exp = |v: f64| prom_text::parse(&format!("vllm:a{{x=\"1\"}} {v}\nvllm:b 2\n"), is_kept);
        let ev = t.ingest("engine0", "u", exp(1.0), 10);
        assert_eq!(ev.len(), 3);
        assert!(
            matches!(&ev[0], ScrapeEvent::Series(s) if s.id == 0 && s.name == "vllm:a" && s.labels["x"] == "1" && s.kind == "untyped")
        );
        assert!(matches!(&ev[1], ScrapeEvent::Series(s) if s.id == 1 && s.name == "vllm:b"));
        let ev = t.ingest("engine0", "u", exp(5.0), 20);
        assert_eq!(
            ev,
            vec![ScrapeEvent::Points(vec![
                MetricPoint {
                    t_ns: 20,
                    series: 0,
                    value: 5.0
                },
                MetricPoint {
                    t_ns: 20,
                    series: 1,
                    value: 2.0
                },
            ])]
        );
        // Another engine: its own ids.
        let ev = t.ingest("engine1", "u", exp(1.0), 30);
        assert!(matches!(&ev[0], ScrapeEvent::Series(s) if s.id == 2 && s.engine == "engine1"));

        // The per-engine bound.
        let many: String = (0..MAX_SERIES_PER_ENGINE + 5)
            .map(|i| format!("vllm:m{{i=\"{i}\"}} 1\n"))
            .collect();
        let ev = t.ingest("engine2", "u", prom_text::parse(&many, is_kept), 40);
        let series = ev
            .iter()
            .filter(|e| matches!(e, ScrapeEvent::Series(_)))
            .count();
        assert_eq!(series, MAX_SERIES_PER_ENGINE);
        assert!(ev.iter().any(
            |e| matches!(e, ScrapeEvent::Error(x) if x.error.contains("5 new series dropped"))
        ));
        let ev = t.ingest("engine2", "u", prom_text::parse(&many, is_kept), 50);
        assert_eq!(ev.len(), 1, "the limit is reported once");

        // Engines gone are forgotten (memory stays bounded as engines come and go); ids are
        // not given out twice.
        let keep = EngineInfo {
            id: "engine1".into(),
            ..Default::default()
        };
        t.retain_engines(std::slice::from_ref(&keep));
        assert_eq!(t.ids.len(), 2);
        assert_eq!(t.per_engine.len(), 1);
        assert!(t.limit_reported.is_empty());
        let ev = t.ingest("engine0", "u", exp(1.0), 60);
        let first_new = 4 + MAX_SERIES_PER_ENGINE as u32;
        assert!(
            matches!(&ev[0], ScrapeEvent::Series(s) if s.id == first_new),
            "{:?}",
            ev[0]
        );
    }

    #[test]
    fn scraper_sends_series_points_and_errors_and_stops_promptly() {
        let mut bodies = vec![(200, SAMPLE.to_string())];
        bodies.push((
            200,
            SAMPLE.replace(
                "vllm:generation_tokens_total{engine=\"0\",model_name=\"tiny-moe\"} 32.0",
                "vllm:generation_tokens_total{engine=\"0\",model_name=\"tiny-moe\"} 132.0",
            ),
        ));
        let (url, h) = serve(bodies);
        // engine1 points at a closed port: errors, never fatal.
        let closed = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}/metrics", l.local_addr().unwrap())
        };
        let start = crate::sys::monotonic_ns();
        let (scraper, rx) = Scraper::spawn(
            vec![
                engine("engine0", &url),
                engine("engine1", &closed),
                engine("engine2", ""),
            ],
            Duration::from_millis(50),
            start,
        )
        .unwrap();
        let mut series = HashMap::new();
        let mut scrapes: Vec<Vec<MetricPoint>> = Vec::new();
        let mut errors = Vec::new();
        // Bounded: a scraper that stops sending fails the test instead of hanging it.
        while let Ok(ev) = rx.recv_timeout(Duration::from_secs(60)) {
            match ev {
                ScrapeEvent::Series(s) => {
                    series.insert(s.id, s);
                }
                ScrapeEvent::Points(p) => {
                    for x in &p {
                        assert!(series.contains_key(&x.series), "point before its series");
                    }
                    scrapes.push(p);
                }
                ScrapeEvent::Error(e) => errors.push(e),
            }
            if scrapes.len() >= 3 && errors.len() >= 3 {
                break;
            }
        }
        assert!(
            scrapes.len() >= 3 && errors.len() >= 3,
            "no event for 60 s: {} scrapes, errors {errors:?}",
            scrapes.len()
        );
        let t0 = Instant::now();
        scraper.stop();
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "stop took {:?}",
            t0.elapsed()
        );
        let _ = ureq::get(&url.replace("/metrics", "/stop")).call();
        h.join().unwrap();

        assert_eq!(series.len(), 330);
        let gen = series
            .values()
            .find(|s| s.name == "vllm:generation_tokens_total")
            .unwrap();
        assert_eq!(
            (gen.engine.as_str(), gen.kind.as_str()),
            ("engine0", "counter")
        );
        let values: Vec<f64> = scrapes
            .iter()
            .map(|p| p.iter().find(|x| x.series == gen.id).unwrap().value)
            .collect();
        assert_eq!(&values[..3], &[32.0, 132.0, 132.0]);
        for p in &scrapes {
            assert!(p.iter().all(|x| x.t_ns == p[0].t_ns), "one time per scrape");
        }
        assert!(scrapes.windows(2).all(|w| w[1][0].t_ns > w[0][0].t_ns));
        assert!(
            errors
                .iter()
                .all(|e| e.engine == "engine1" && e.error.contains("refused")),
            "{errors:?}"
        );
    }

    /// An engine whose API server does not answer does not hold up another's scrapes: each
    /// engine is scraped on its own thread. The stuck server answers only once the test has
    /// seen three scrapes of the other.
    #[test]
    fn a_stuck_engine_does_not_delay_the_others() {
        let (url, h) = serve(vec![(200, SAMPLE.to_string())]);
        let stuck = TcpListener::bind("127.0.0.1:0").unwrap();
        let stuck_url = format!("http://{}/metrics", stuck.local_addr().unwrap());
        let (release, released) = mpsc::channel::<()>();
        let sh = std::thread::spawn(move || {
            let (mut s, _) = stuck.accept().unwrap();
            // Read the request first: closing a socket with unread bytes sends a reset, which
            // can reach the client before it has read the answer (an error, not a scrape).
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => got.extend_from_slice(&buf[..k]),
                }
            }
            let _ = released.recv();
            let body = "vllm:num_requests_waiting 3\n";
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        });
        let (scraper, rx) = Scraper::spawn(
            vec![engine("stuck", &stuck_url), engine("fast", &url)],
            Duration::from_millis(20),
            crate::sys::monotonic_ns(),
        )
        .unwrap();
        let mut fast = 0;
        let mut stuck_points = 0;
        let mut errors = Vec::new();
        // Bounded: an answer that never arrives fails the test instead of hanging it.
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let Ok(ev) = rx.recv_timeout(left) else { break };
            if let ScrapeEvent::Error(e) = &ev {
                errors.push(format!("{}: {}", e.engine, e.error));
            }
            if let ScrapeEvent::Points(p) = &ev {
                if p.len() == 1 {
                    stuck_points += 1;
                    break;
                }
                fast += 1;
                if fast == 3 {
                    release.send(()).unwrap();
                }
            }
        }
        assert!(
            fast >= 3 && stuck_points == 1,
            "{fast} scrapes of the fast engine, {stuck_points} of the stuck one; errors: {errors:?}"
        );
        drop(rx);
        scraper.stop();
        sh.join().unwrap();
        let _ = ureq::get(&url.replace("/metrics", "/stop")).call();
        h.join().unwrap();
    }

    #[test]
    fn stop_interrupts_a_long_interval() {
        let (scraper, rx) = Scraper::spawn(vec![], Duration::from_secs(3600), 0).unwrap();
        let t0 = Instant::now();
        scraper.stop();
        assert!(t0.elapsed() < Duration::from_secs(1));
        assert!(
            rx.recv().is_err(),
            "the channel closes when the scraper stops"
        );
        assert!(Scraper::spawn(vec![], Duration::from_millis(1), 0).is_err());
    }

    #[test]
    fn timeouts() {
        let t = |ms| request_timeout(Duration::from_millis(ms));
        assert_eq!(t(1000), Duration::from_secs(30));
        assert_eq!(t(10_000), Duration::from_secs(50));
        assert_eq!(t(60_000), Duration::from_secs(120));
        assert_eq!(t(20), Duration::from_secs(30));
    }
}
