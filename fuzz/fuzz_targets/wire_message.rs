//! Fuzzes the driver ↔ worker control protocol (`actors/fleet/src/wire.rs`): rkyv `ToWorker` /
//! `ToParent` messages (actor commands and events included) validated with bytecheck, both as
//! whole frames (a QUIC lane delivers frames whole) and as TCP frames (u32 LE length ≤
//! FRAME_BYTES_MAX, then the frame), frame after frame.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The fuzzer compiles `tessera_fleet::wire`'s source file itself (it has a workspace of its own).
#[path = "../../actors/fleet/src/wire.rs"]
#[allow(dead_code)]
mod wire;

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::rancor::Error as RkyvError;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use wire::{decode, decode_for_fuzz, encode, ToParent, ToWorker, FRAME_BYTES_MAX};

/// A decoded message must re-encode, decode again, and re-encode to the same bytes (compared
/// as bytes, not with `==`: a NaN loss is a valid message and must keep its bits).
fn round_trip<T>(msg: &T, expected: &'static str)
where
    T: rkyv::Archive + std::fmt::Debug + for<'a> rkyv::Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, RkyvError>> + rkyv::Deserialize<T, HighDeserializer<RkyvError>>,
{
    let bytes = encode(msg);
    let again: T = decode(&bytes, expected).expect("a re-encoded message decodes");
    assert_eq!(encode(&again), bytes, "{msg:?} changed on a round trip");
}

/// The input as one whole frame, then as a stream of TCP frames until one fails.
fn decode_all<T>(data: &[u8], expected: &'static str)
where
    T: rkyv::Archive + std::fmt::Debug + for<'a> rkyv::Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, RkyvError>> + rkyv::Deserialize<T, HighDeserializer<RkyvError>>,
{
    if data.len() <= FRAME_BYTES_MAX {
        if let Ok(msg) = decode::<T>(data, expected) {
            round_trip(&msg, expected);
        }
    }
    let mut rest = data;
    while let Ok((msg, tail)) = decode_for_fuzz::<T>(rest, expected) {
        assert!(tail.len() < rest.len(), "a decoded frame consumed no bytes");
        round_trip(&msg, expected);
        rest = tail;
    }
}

fuzz_target!(|data: &[u8]| {
    decode_all::<ToWorker>(data, "a request");
    decode_all::<ToParent>(data, "a reply");
});
