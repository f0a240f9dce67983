//! The recording reader: a whole file (`parse_recording`), and the same bytes fed to
//! `RecordingReader::feed` in chunks of random sizes (as `top` follows a live recording). Both
//! must agree: a record split across feeds reads the same as one read whole.
#![no_main]

use enginescope::record::format::{parse_recording, RecordingReader};
use enginescope_fuzz::{hash, Rng};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let whole = parse_recording(data);
    let mut rng = Rng::new(hash(data));
    let mut rd = RecordingReader::default();
    let mut i = 0;
    let mut failed = false;
    while i < data.len() {
        // Mostly small chunks (records split everywhere), sometimes large ones.
        let r = rng.next();
        let n = if r % 4 == 0 {
            (r >> 8) as usize % 4096 + 1
        } else {
            (r >> 8) as usize % 16 + 1
        };
        let end = (i + n).min(data.len());
        if rd.feed(&data[i..end]).is_err() {
            failed = true;
            break;
        }
        i = end;
    }
    match &whole {
        Ok(w) => {
            assert!(!failed, "whole read succeeded, chunked feed failed");
            assert!(rd.has_meta());
            let mut r = std::mem::take(&mut rd.recording);
            if !r.profile_intervals.is_empty() {
                // What a whole read does last (aggregated intervals are written when they
                // end, after raw events of later times): events in time order.
                r.samples.sort_by_key(|s| s.t_ns);
            }
            let r = &r;
            assert_eq!(w.frames.len(), r.frames.len());
            assert_eq!(w.stacks, r.stacks);
            assert_eq!(w.samples.len(), r.samples.len());
            assert_eq!(
                w.samples.iter().map(|s| s.t_ns).collect::<Vec<_>>(),
                r.samples.iter().map(|s| s.t_ns).collect::<Vec<_>>()
            );
            assert_eq!(w.metrics.len(), r.metrics.len());
            assert_eq!(w.calls.len(), r.calls.len());
            assert_eq!(w.gc_pauses.len(), r.gc_pauses.len());
        }
        Err(_) => assert!(
            failed || !rd.has_meta(),
            "chunked feed read what a whole read refused"
        ),
    }
});
