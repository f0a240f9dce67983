//! The Prometheus text-format parser the /metrics scraper uses on whatever answers on an
//! engine's metrics port.
#![no_main]

use enginescope::vllm::prom_text;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let all = prom_text::parse(&text, |_| true);
    let some = prom_text::parse(&text, |n| n.starts_with("vllm:"));
    let _ = (all, some);
    for line in text.lines().take(64) {
        let _ = prom_text::parse_value(line);
        if let Some((_, v)) = line.rsplit_once(' ') {
            let _ = prom_text::parse_value(v);
        }
    }
});
