//! The agent's HTTP endpoint: `GET /metrics` (Prometheus text 0.0.4, or OpenMetrics when the
//! scraper asks for it), `GET /-/healthy`, and `GET /` (a pointer to /metrics).
//!
//! A deliberately small server on `std::net`: one connection at a time, `Connection: close`,
//! request heads up to 8 KiB, 5 s read and write timeouts. Prometheus scrapes every few
//! seconds, so serial handling is plenty, and a client that stalls holds the endpoint for at
//! most the timeout. Bind it to loopback or a pod IP: it has no authentication (metrics only).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;

const MAX_HEAD: usize = 8 << 10;
/// Read and write timeout of a connection.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running endpoint; [`Exporter::stop`] ends it.
pub struct Exporter {
    pub addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    /// Serve `registry` on `listener` in a thread; `timeout` for each connection's reads
    /// and writes ([`IO_TIMEOUT`]).
    pub fn spawn(
        listener: TcpListener,
        registry: Arc<Registry>,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("es-exporter".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.load(Ordering::SeqCst) {
                        break;
                    }
                    // Accept errors (a connection reset before accept, out of fds) are not fatal.
                    if let Ok(c) = conn {
                        let _ = handle(c, &registry, timeout);
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
pub fn respond(
    method: &str,
    path: &str,
    accept: &str,
    registry: &Registry,
) -> (&'static str, &'static str, String) {
    let path = path.split('?').next().unwrap_or(path);
    if method != "GET" && method != "HEAD" {
        return ("405 Method Not Allowed", "text/plain", "GET only\n".into());
    }
    match path {
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
                Ok(()) => ("200 OK", ct, body),
                Err(_) => (
                    "500 Internal Server Error",
                    "text/plain",
                    "encoding failed\n".into(),
                ),
            }
        }
        "/-/healthy" | "/healthz" => ("200 OK", "text/plain", "ok\n".into()),
        "/" => (
            "200 OK",
            "text/plain",
            "enginescope agent: metrics at /metrics\n".into(),
        ),
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    }
}

fn handle(mut c: TcpStream, registry: &Registry, timeout: Duration) -> std::io::Result<()> {
    c.set_read_timeout(Some(timeout))?;
    c.set_write_timeout(Some(timeout))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = c.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
        if head.len() > MAX_HEAD {
            let _ = c.write_all(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            );
            return Ok(());
        }
    }
    let head = String::from_utf8_lossy(&head);
    let (status, ct, body) = match parse_head(&head) {
        Some((m, p, a)) => respond(m, p, a, registry),
        None => ("400 Bad Request", "text/plain", "bad request\n".into()),
    };
    let is_head = head.starts_with("HEAD ");
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !is_head {
        out.extend_from_slice(body.as_bytes());
    }
    c.write_all(&out)?;
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
    fn serves_metrics_in_both_formats() {
        let mut reg = Registry::default();
        let c: Counter = Counter::default();
        c.inc_by(3);
        reg.register("es_test_things", "Things", c);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let timeout = Duration::from_millis(300);
        let e = Exporter::spawn(l, Arc::new(reg), timeout).unwrap();
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
