//! The agent's HTTP endpoint: `GET /metrics` (Prometheus text 0.0.4, or OpenMetrics when the
//! scraper asks for it), `GET /debug/pprof/profile?seconds=N` (a CPU profile of the next N
//! seconds; `offcpu` and `gil` likewise, [`super::profiles`]), `GET /-/healthy`, and `GET /` (a pointer to both).
//!
//! A deliberately small server on `std::net`: `Connection: close`, request heads up to 8 KiB,
//! and each connection has `timeout` (5 s) in all to send its head and take its answer, so a
//! slow client (one byte every few seconds) cannot hold a handler for longer. Connections are
//! served by up to [`MAX_CONNECTIONS`] threads at once, so a few stalled clients do not stop a
//! scrape; past that a connection is answered `503` at once and closed. A profile request's
//! wait is not the client's: its answer gets the same `timeout` again to be written. Bind it to
//! loopback or a pod IP: it has no authentication (metrics and profiles only).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;

use super::profiles::Profiles;
use crate::views::pprof::Kind;

/// What the endpoint serves: the metrics, and the profiles when the agent keeps segments.
pub struct Served {
    pub registry: Registry,
    pub profiles: Option<Profiles>,
}

impl From<Registry> for Served {
    /// Metrics only.
    fn from(registry: Registry) -> Self {
        Served {
            registry,
            profiles: None,
        }
    }
}

const MAX_HEAD: usize = 8 << 10;
/// Connections served at once; more are answered `503 Service Unavailable`.
pub const MAX_CONNECTIONS: usize = 16;
/// Read and write timeout of a connection.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(5);
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running endpoint; [`Exporter::stop`] ends it.
pub struct Exporter {
    pub addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    /// Serve `served` on `listener` in a thread; `timeout` for each connection's reads
    /// and writes ([`IO_TIMEOUT`]).
    pub fn spawn(
        listener: TcpListener,
        registry: Arc<Served>,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("es-exporter".into())
            .spawn(move || {
                let active = Arc::new(AtomicUsize::new(0));
                // Connections over the limit go to one thread that answers 503; when even its
                // queue is full they are closed at once.
                let (busy_tx, busy_rx) = std::sync::mpsc::sync_channel::<TcpStream>(64);
                let _ = std::thread::Builder::new()
                    .name("es-exporter-busy".into())
                    .spawn(move || {
                        for c in busy_rx {
                            busy(c);
                        }
                    });
                for conn in listener.incoming() {
                    if s.load(Ordering::SeqCst) {
                        break;
                    }
                    // Accept errors (a connection reset before accept, out of fds) are not fatal.
                    let Ok(c) = conn else { continue };
                    if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                        active.fetch_sub(1, Ordering::SeqCst);
                        let _ = busy_tx.try_send(c);
                        continue;
                    }
                    let (reg, mine) = (registry.clone(), active.clone());
                    let spawned = std::thread::Builder::new()
                        .name("es-exporter-conn".into())
                        .spawn(move || {
                            let _ = handle(c, &reg, timeout);
                            mine.fetch_sub(1, Ordering::SeqCst);
                        });
                    if spawned.is_err() {
                        active.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })?;
        Ok(Exporter {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Stop serving (wakes the accept with a connection of our own).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The request's method, path and Accept header, from a request head.
fn parse_head(head: &str) -> Option<(&str, &str, &str)> {
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?;
    let path = first.next()?;
    let accept = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("accept"))
        .map(|(_, v)| v.trim())
        .unwrap_or("");
    Some((method, path, accept))
}

/// The response to one request: (status line, content type, body).
pub(crate) fn respond(
    method: &str,
    path: &str,
    accept: &str,
    served: &Served,
) -> (&'static str, &'static str, Vec<u8>) {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    if method != "GET" && method != "HEAD" {
        return (
            "405 Method Not Allowed",
            "text/plain",
            b"GET only\n".to_vec(),
        );
    }
    let registry = &served.registry;
    match path {
        "/debug/pprof/profile" | "/debug/pprof/offcpu" | "/debug/pprof/gil" => {
            let kind = match path {
                "/debug/pprof/offcpu" => Kind::OffCpu,
                "/debug/pprof/gil" => Kind::GilWait,
                _ => Kind::Cpu,
            };
            let Some(p) = &served.profiles else {
                return (
                    "404 Not Found",
                    "text/plain",
                    b"no profiles: this agent keeps no segments\n".to_vec(),
                );
            };
            match p.seconds(query).and_then(|s| p.profile(kind, s)) {
                Ok(body) => ("200 OK", "application/octet-stream", body),
                Err((status, msg)) => (status, "text/plain", msg.into_bytes()),
            }
        }
        "/metrics" => {
            let mut body = String::new();
            let (ct, r) = if accept.contains("application/openmetrics-text") {
                (
                    OPENMETRICS,
                    prometheus_client::encoding::text::encode(&mut body, registry),
                )
            } else {
                (
                    TEXT,
                    prometheus_client::encoding::prometheus_text::encode(&mut body, registry),
                )
            };
            match r {
                Ok(()) => ("200 OK", ct, body.into_bytes()),
                Err(_) => (
                    "500 Internal Server Error",
                    "text/plain",
                    b"encoding failed\n".to_vec(),
                ),
            }
        }
        "/-/healthy" | "/healthz" => ("200 OK", "text/plain", b"ok\n".to_vec()),
        "/" => (
            "200 OK",
            "text/plain",
            b"enginescope agent: metrics at /metrics, CPU profiles at /debug/pprof/profile?seconds=N\n"
                .to_vec(),
        ),
        _ => ("404 Not Found", "text/plain", b"not found\n".to_vec()),
    }
}

/// A request head as it arrives: bytes up to the blank line that ends it, at most 8 KiB.
#[derive(Default)]
pub struct HeadReader {
    buf: Vec<u8>,
}

/// The head passed 8 KiB without ending.
#[derive(Debug, PartialEq, Eq)]
pub struct HeadTooLarge;

impl HeadReader {
    /// Add bytes read from the client: `None` while the head goes on, then the whole head (up
    /// to its blank line), or [`HeadTooLarge`].
    pub fn push(&mut self, data: &[u8]) -> Option<Result<Vec<u8>, HeadTooLarge>> {
        // The end may straddle the previous read: look from 3 bytes back.
        let from = self.buf.len().saturating_sub(3);
        self.buf.extend_from_slice(data);
        if let Some(p) = self.buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = from + p + 4;
            if end > MAX_HEAD {
                return Some(Err(HeadTooLarge));
            }
            self.buf.truncate(end);
            return Some(Ok(std::mem::take(&mut self.buf)));
        }
        if self.buf.len() > MAX_HEAD {
            return Some(Err(HeadTooLarge));
        }
        None
    }
}

/// The whole response (status line, headers, body) to one complete request head.
pub fn answer(head: &[u8], served: &Served) -> Vec<u8> {
    let head = String::from_utf8_lossy(head);
    let (status, ct, body) = match parse_head(&head) {
        Some((m, p, a)) => respond(m, p, a, served),
        None => ("400 Bad Request", "text/plain", b"bad request\n".to_vec()),
    };
    let is_head = head.starts_with("HEAD ");
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !is_head {
        out.extend_from_slice(&body);
    }
    out
}

/// Too many connections at once: answer 503 and close, reading (and dropping) what the client
/// sent for up to 100 ms so that closing does not reset the connection before it reads the
/// answer.
fn busy(mut c: TcpStream) {
    let limit = Duration::from_millis(100);
    let _ = c.set_write_timeout(Some(limit));
    let _ = c.write_all(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\nRetry-After: 1\r\n\r\n",
    );
    let _ = c.shutdown(std::net::Shutdown::Write);
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 1024];
    let mut drained = 0;
    while drained < MAX_HEAD {
        let Ok(left) = left(deadline) else { break };
        if c.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

/// Time left before `deadline`, or a timed-out error.
fn left(deadline: Instant) -> std::io::Result<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "connection deadline"))
}

/// Serve one connection, all within `timeout` from now.
fn handle(mut c: TcpStream, served: &Served, timeout: Duration) -> std::io::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut head = HeadReader::default();
    let mut buf = [0u8; 1024];
    let head = loop {
        c.set_read_timeout(Some(left(deadline)?))?;
        let n = c.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        match head.push(&buf[..n]) {
            None => continue,
            Some(Ok(h)) => break h,
            Some(Err(HeadTooLarge)) => {
                c.set_write_timeout(Some(left(deadline)?))?;
                let _ = c.write_all(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
                );
                return Ok(());
            }
        }
    };
    let asked = Instant::now();
    let out = answer(&head, served);
    // A profile waited for its window: the answer gets the whole timeout again. Each write
    // is bounded by what is left of the deadline: a client that reads slowly cannot stretch it.
    let deadline = deadline + asked.elapsed();
    let mut rest = &out[..];
    while !rest.is_empty() {
        c.set_write_timeout(Some(left(deadline)?))?;
        match c.write(rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    c.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    fn get(addr: std::net::SocketAddr, req: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn head_reader_finds_the_end_across_reads_and_bounds_the_head() {
        let mut h = HeadReader::default();
        assert_eq!(h.push(b"GET / HTTP/1.1\r\nA: b\r"), None);
        assert_eq!(h.push(b"\n\r"), None);
        let head = h.push(b"\nBODY").unwrap().unwrap();
        assert_eq!(head, b"GET / HTTP/1.1\r\nA: b\r\n\r\n");
        let mut h = HeadReader::default();
        let mut r = None;
        for _ in 0..9 {
            r = h.push(&[b'a'; 1024]);
            if r.is_some() {
                break;
            }
        }
        assert_eq!(r, Some(Err(HeadTooLarge)));
        // The end found past the limit is still too large.
        let mut h = HeadReader::default();
        let mut big = vec![b'a'; MAX_HEAD + 10];
        big.extend_from_slice(b"\r\n\r\n");
        assert_eq!(h.push(&big), Some(Err(HeadTooLarge)));
        assert!(answer(b"\r\n\r\n", &Registry::default().into()).starts_with(b"HTTP/1.1 400"));
        assert!(
            answer(b"HEAD / HTTP/1.1\r\n\r\n", &Registry::default().into()).ends_with(b"\r\n\r\n")
        );
    }

    /// Issue 15: connections were served one at a time with a per-read timeout, so a client
    /// sending one byte every few seconds held the endpoint indefinitely and every scrape
    /// behind it waited. Now each connection has one deadline for the whole request, and
    /// others are served meanwhile.
    #[test]
    fn slow_client_neither_blocks_others_nor_outlives_its_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let timeout = Duration::from_millis(1500);
        let e = Exporter::spawn(l, Arc::new(Registry::default().into()), timeout).unwrap();
        let mut slow = TcpStream::connect(e.addr).unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
        // Another client is answered while the slow one is mid-head.
        assert!(get(e.addr, "GET /-/healthy HTTP/1.1\r\n\r\n").contains("ok"));
        // Trickling bytes (each read well inside the old per-read timeout) does not extend it:
        // the server closes at the deadline.
        let t0 = std::time::Instant::now();
        let mut closed = false;
        for _ in 0..40 {
            std::thread::sleep(Duration::from_millis(100));
            if slow.write_all(b"X").is_err() {
                closed = true;
                break;
            }
        }
        assert!(closed, "still open after {:?}", t0.elapsed());
        e.stop();
    }

    #[test]
    fn serves_metrics_in_both_formats() {
        let mut reg = Registry::default();
        let c: Counter = Counter::default();
        c.inc_by(3);
        reg.register("es_test_things", "Things", c);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let timeout = Duration::from_millis(300);
        let e = Exporter::spawn(l, Arc::new(reg.into()), timeout).unwrap();
        let r = get(e.addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("Content-Type: text/plain; version=0.0.4"));
        assert!(r.contains("\nes_test_things_total 3\n"), "{r}");
        assert!(!r.contains("# EOF"));
        let r = get(
            e.addr,
            "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n",
        );
        assert!(r.contains("application/openmetrics-text"), "{r}");
        assert!(r.contains("es_test_things_total 3\n# EOF\n"), "{r}");
        assert!(get(e.addr, "GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(e.addr, "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
        let mut s = TcpStream::connect(e.addr).unwrap();
        let _ = s.write_all(big.as_bytes());
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 431"), "{out}");
        // A client that connects and says nothing does not stop the next one for long.
        let _idle = TcpStream::connect(e.addr).unwrap();
        let t0 = std::time::Instant::now();
        assert!(get(e.addr, "GET /-/healthy HTTP/1.1\r\n\r\n").contains("ok"));
        assert!(t0.elapsed() <= timeout + Duration::from_secs(2));
        e.stop();
    }
}
