//! Fuzzes the trainer's parent ↔ worker control framing (`src/engine/wire.rs`): a u32 LE length
//! (≤ FRAME_BYTES_MAX) and a JSON body, decoded as both message enums, frame after frame.
#![no_main]

use libfuzzer_sys::fuzz_target;

// `engine::wire` is private to the `tessera` crate; the fuzzer compiles the same file.
#[path = "../../src/engine/wire.rs"]
#[allow(dead_code)]
mod wire;

use serde::de::DeserializeOwned;
use serde::Serialize;
use wire::{decode_for_fuzz, ToParent, ToWorker, WireError, FRAME_BYTES_MAX};

/// Decodes frames of `T` from `data` until one fails; each decoded message must survive a
/// re-encode (as `send` frames it) and decode again.
fn decode_all<T: DeserializeOwned + Serialize>(mut data: &[u8], expected: &'static str) {
    while let Ok((msg, rest)) = decode_for_fuzz::<T>(data, expected) {
        assert!(rest.len() < data.len(), "a decoded frame consumed no bytes");
        let body = serde_json::to_vec(&msg).expect("a decoded message serialises");
        if body.len() <= FRAME_BYTES_MAX {
            let mut frame = (body.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(&body);
            let again: Result<(T, &[u8]), WireError> = decode_for_fuzz(&frame, expected);
            let (again, tail) = again.expect("a re-encoded message decodes");
            assert!(tail.is_empty());
            assert_eq!(serde_json::to_vec(&again).expect("serialises"), body);
        }
        data = rest;
    }
}

fuzz_target!(|data: &[u8]| {
    decode_all::<ToWorker>(data, "a request");
    decode_all::<ToParent>(data, "a reply");
});
