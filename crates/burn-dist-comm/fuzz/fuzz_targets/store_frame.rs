//! The store's frame decoder on arbitrary bytes: it must never panic, never allocate more than
//! the frame limit, and decode only canonical encodings.
#![no_main]

use burn_dist_comm::store::codec::{decode, encode, read_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = decode(data) {
        assert_eq!(encode(&message), data, "decode accepted a non-canonical encoding");
    }
    // As a stream: length prefix, limit check, body. Reads frames until the input runs out.
    let mut stream = data;
    while read_frame(&mut stream, 1 << 16).is_ok() {}
});
