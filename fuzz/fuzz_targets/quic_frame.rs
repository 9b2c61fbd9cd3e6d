//! Fuzzes the QUIC backend's frame decoding: `decode_control` (rkyv + bytecheck) on the raw
//! input, and `read_message` (header, checksummed payload chunks, end of stream) over it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_transport::quic::frame::{decode_control, encode_control, read_message, Control, FrameError, Payload};

thread_local! {
    static RT: tokio::runtime::Runtime =
        tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime");
}

/// Whatever decodes must re-encode to a header that decodes to the same value.
fn check_round_trip(control: &Control) {
    let again = decode_control(&encode_control(control)).expect("a re-encoded header decodes");
    assert_eq!(&again, control);
}

/// A decoded payload must have exactly the announced element count and type.
fn check_payload(control: &Control, payload: &Option<Payload>) {
    match (control, payload) {
        (Control::Data { elems, elem, .. }, Some(Payload::F32(v))) => assert!(*elem == 0 && v.len() as u64 == *elems),
        (Control::Data { elems, elem, .. }, Some(Payload::F64(v))) => assert!(*elem == 1 && v.len() as u64 == *elems),
        (Control::Data { .. }, None) => panic!("a Data message decoded without its payload"),
        (_, Some(_)) => panic!("a non-Data message decoded with a payload"),
        (_, None) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(control) = decode_control(data) {
        check_round_trip(&control);
    }
    let mut reader = data;
    let got: Result<_, FrameError> = RT.with(|rt| rt.block_on(read_message(&mut reader)));
    if let Ok((control, payload)) = got {
        check_round_trip(&control);
        check_payload(&control, &payload);
    }
});
