//! A test guest for the host's fault handling. Its config is one word naming the fault:
//!
//! - `trap` / `loop` / `oom`: on every `on-put`, panic (a trap), spin forever, or
//!   allocate without bound;
//! - `bad-answer`: answer `on-put` with the wrong number of admissions;
//! - `deny`: deny every key with -200 (a well-behaved but harmful policy);
//! - `refuse-config`: `configure` returns an error;
//! - `trap-config`: `configure` traps.
//! - `every-N-trap` (e.g. `every-3-trap`): trap on every Nth call, admit otherwise.
//! - `evict-all`: admit every put; asked for victims, name every candidate (a greedy
//!   evictor, for tests of what one experiment arm can do to another).

use moongate_policy_sdk::*;

struct Fault {
    mode: String,
    calls: u64,
}

impl Policy for Fault {
    fn new(config: &[u8]) -> Result<(Self, Interest), String> {
        let mode = String::from_utf8_lossy(config).trim().to_string();
        match mode.as_str() {
            "refuse-config" => return Err("refused on purpose".into()),
            "trap-config" => panic!("trap in configure on purpose"),
            _ => {}
        }
        let interest = if mode == "evict-all" {
            Interest::PUT | Interest::EVICT
        } else {
            Interest::PUT
        };
        Ok((Fault { mode, calls: 0 }, interest))
    }

    fn evict(&mut self, call: EvictCall) -> Vec<u32> {
        (0..call.sizes.len() as u32).collect()
    }

    fn on_put(&mut self, call: PutCall) -> PutDecision {
        self.calls += 1;
        match self.mode.as_str() {
            "trap" => panic!("trap on purpose"),
            "loop" => {
                let mut x: u64 = 0;
                loop {
                    x = core::hint::black_box(x.wrapping_add(1));
                }
            }
            "oom" => {
                // Reserve (without touching) 4 MiB at a time: the memory cap, not the
                // time to fill pages, is what stops it.
                let mut hog: Vec<Vec<u8>> = Vec::new();
                loop {
                    hog.push(Vec::with_capacity(4 << 20));
                    core::hint::black_box(&hog);
                }
            }
            "bad-answer" => PutDecision {
                config: None,
                admissions: vec![Admission::Admit; call.keys.len() + 1],
            },
            "deny" => PutDecision::deny_all(call.keys.len(), error_code::NO_AVAILABLE_HANDLE),
            m if m.starts_with("every-") => {
                let n: u64 = m
                    .trim_start_matches("every-")
                    .trim_end_matches("-trap")
                    .parse()
                    .unwrap_or(2);
                if self.calls.is_multiple_of(n) {
                    panic!("periodic trap on purpose");
                }
                PutDecision::admit_all()
            }
            _ => PutDecision::admit_all(),
        }
    }
}

export_policy!(Fault);
