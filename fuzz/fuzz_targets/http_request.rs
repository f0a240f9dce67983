//! The agent's HTTP request handling: bytes as a client sends them, through the head reader
//! (limit, end of head), the request-line and header parser, and the response.
#![no_main]

use std::sync::OnceLock;

use enginescope::agent::exporter;
use libfuzzer_sys::fuzz_target;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

/// Metrics only: a profile request is answered 404 at once (with profiles it would wait its
/// window).
fn served() -> &'static exporter::Served {
    static R: OnceLock<exporter::Served> = OnceLock::new();
    R.get_or_init(|| {
        let mut r = Registry::default();
        let c: Counter = Counter::default();
        c.inc_by(7);
        r.register("es_fuzz_things", "Things", c);
        r.into()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut head = exporter::HeadReader::default();
    let mut out = None;
    // Arrives in pieces, as reads from a socket would.
    for piece in data.chunks(97) {
        if let Some(r) = head.push(piece) {
            out = Some(r);
            break;
        }
    }
    if let Some(Ok(head)) = out {
        let resp = exporter::answer(&head, served());
        assert!(resp.starts_with(b"HTTP/1.1 "));
    }
});
