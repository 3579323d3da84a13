//! Frame splitting plus typed and generic body decoding on arbitrary bytes: must never
//! panic, and every successful decode must re-encode to a value that decodes the same.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    moongate::codec::fuzz_one(data);
});
