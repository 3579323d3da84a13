//! A hints call's body (JSON) read under small limits and put into a small table: must
//! never panic, and what is taken stays within the limits and the table's bounds.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| moongate::hints::parse::fuzz_one(data));
