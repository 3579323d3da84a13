//! kv-face batch records arriving in frames of any size, read as the kv face reads them,
//! then as a batch-get answer and as a key in a path: must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| moongate::kv::api::records::fuzz_one(data));
