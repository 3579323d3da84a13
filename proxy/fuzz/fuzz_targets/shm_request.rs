//! A shared-memory request frame (op byte, body) decoded under small limits: must never
//! panic, and what decodes is within the limits.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| moongate::kv::api::shm::request::fuzz_one(data));
