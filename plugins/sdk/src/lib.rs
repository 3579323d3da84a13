//! The guest SDK for moongate policy plugins.
//!
//! Implement [`Policy`] (every hook has a default that keeps Mooncake's own behaviour, so
//! an empty plugin compiles) and call [`export_policy!`] once:
//!
//! ```ignore
//! use moongate_policy_sdk::*;
//! struct Mine;
//! impl Policy for Mine {
//!     fn new(_config: &[u8]) -> Result<(Self, Interest), String> {
//!         Ok((Mine, Interest::PUT))
//!     }
//!     fn on_put(&mut self, call: PutCall) -> PutDecision {
//!         PutDecision::admit_all()
//!     }
//! }
//! export_policy!(Mine);
//! ```
//!
//! Build with `cargo build --release --target wasm32-wasip2`; the output `.wasm` is a
//! component moongate loads. Plugins see metadata only, never KV bytes.

#[doc(hidden)]
#[allow(clippy::too_many_arguments)] // generated lifting code
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "policy-with-tiers",
        pub_export_macro: true,
        default_bindings_module: "moongate_policy_sdk::bindings",
    });
}

pub use bindings::moongate::policy::host;
pub use bindings::moongate::policy::types::{
    Admission, BlockRef, BudgetState, EvictCall, EvictScope, Interest, LookupCall, Observation,
    PackedKeys, PutCall, PutDecision, PutKind, ReplicateConfig, SoftPinAction, SplitCall, Tier,
    TieredEvictCall, Victim,
};

/// A policy. One value lives per plugin instance; moongate calls the hooks named in the
/// [`Interest`] returned by [`Policy::new`] and never the others.
pub trait Policy: Sized + 'static {
    /// Builds the policy from its config (JSON bytes from moongate's config, or empty).
    fn new(config: &[u8]) -> Result<(Self, Interest), String>;

    /// Placement and admission of a put-family call. Default: unchanged, all admitted.
    fn on_put(&mut self, _call: PutCall) -> PutDecision {
        PutDecision::admit_all()
    }

    /// Order or drop replicas per key. Default: keep the master's answer.
    fn on_lookup(&mut self, _call: LookupCall) -> Vec<Vec<u32>> {
        Vec::new()
    }

    /// Split points of a batch under a byte budget. Default: no split.
    fn split(&mut self, _call: SplitCall) -> Vec<u32> {
        Vec::new()
    }

    /// Eviction victims (indexes into the candidates). Default: none.
    fn evict(&mut self, _call: EvictCall) -> Vec<u32> {
        Vec::new()
    }

    /// Eviction victims with an SSD tier (the owner topology): per victim, whether only
    /// its memory copy goes (the SSD copy keeps serving reads) or the whole key.
    /// `call.on_disk[i]` says whether candidate `i` has a copy on an SSD. Default: the
    /// victims [`Policy::evict`] picks, memory copies only.
    fn evict_tiered(&mut self, call: TieredEvictCall) -> Vec<Victim> {
        self.evict(call.call)
            .into_iter()
            .map(|index| Victim {
                index,
                scope: EvictScope::Memory,
            })
            .collect()
    }

    /// Outcome and latency of a call. Default: ignored.
    fn observe(&mut self, _event: Observation) {}

    /// The block each key names, for the KV events moongate publishes to routers (only
    /// with `[events]` on; never on the request path). Default: [`blocks_of_blk_keys`],
    /// the key format of moongate's trace replay. A connector that names keys another
    /// way overrides this; `None` for a key publishes nothing for it.
    fn block_keys(&mut self, keys: PackedKeys) -> Vec<Option<BlockRef>> {
        blocks_of_blk_keys(&keys)
    }
}

/// Blocks of keys named `PREFIX/blk/HASH` (HASH a decimal `u64`), the format of
/// moongate's trace replay: the hash is the number; a key's parent is the key before it in
/// the same call when that one is a block of the same `PREFIX` (a batch put stores a
/// request's blocks in prefix order), else unknown. Other keys name no block.
pub fn blocks_of_blk_keys(keys: &PackedKeys) -> Vec<Option<BlockRef>> {
    let mut out: Vec<Option<BlockRef>> = Vec::with_capacity(keys.len());
    let mut prev: Option<(&[u8], u64)> = None;
    for key in keys.iter() {
        let parsed = split_blk_key(key);
        let block = parsed.map(|(prefix, hash)| BlockRef {
            hash,
            parent: prev.filter(|(p, _)| *p == prefix).map(|(_, h)| h),
        });
        prev = parsed;
        out.push(block);
    }
    out
}

/// `PREFIX/blk/HASH` into (PREFIX, HASH).
fn split_blk_key(key: &[u8]) -> Option<(&[u8], u64)> {
    const MARK: &[u8] = b"/blk/";
    let at = key.windows(MARK.len()).rposition(|w| w == MARK)?;
    let digits = &key[at + MARK.len()..];
    if digits.is_empty() || digits.len() > 20 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let hash = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some((&key[..at], hash))
}

/// Split points that cut a batch into parts of at most `max_bytes` each, in key order
/// (a key larger than `max_bytes` is a part of its own). For [`Policy::split`].
pub fn split_by_bytes(sizes: &[u64], max_bytes: u64) -> Vec<u32> {
    let mut points = Vec::new();
    let mut part = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        if i > 0 && part > 0 && part.saturating_add(size) > max_bytes {
            points.push(i as u32);
            part = 0;
        }
        part = part.saturating_add(size);
    }
    points
}

impl PutDecision {
    /// Keep the config, admit every key.
    pub fn admit_all() -> Self {
        PutDecision {
            config: None,
            admissions: Vec::new(),
        }
    }
    /// Refuse every one of `keys` keys with `code`.
    pub fn deny_all(keys: usize, code: i32) -> Self {
        PutDecision {
            config: None,
            admissions: vec![Admission::Deny(code); keys],
        }
    }
}

impl PackedKeys {
    pub fn len(&self) -> usize {
        self.ends.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
    /// Key `i` as bytes.
    pub fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.bytes[start..self.ends[i] as usize]
    }
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Packs `keys` the way the host does: for a plugin's own tests.
    pub fn from_keys<K: AsRef<[u8]>>(keys: &[K]) -> Self {
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(keys.len());
        for k in keys {
            bytes.extend_from_slice(k.as_ref());
            ends.push(bytes.len() as u32);
        }
        PackedKeys { bytes, ends }
    }
}

/// A fixed-length time window for budgets that refill: a window starts at the first
/// [`Window::roll`] after the previous one ended.
pub struct Window {
    length_ns: u64,
    start_ns: Option<u64>,
}

impl Window {
    pub fn new(length_ms: u64) -> Self {
        Window {
            length_ns: length_ms.saturating_mul(1_000_000),
            start_ns: None,
        }
    }

    /// Starts a new window if the current one is over (or none began yet); returns
    /// true when it did, so the caller resets what it counts per window.
    pub fn roll(&mut self) -> bool {
        let now = host::now_ns();
        let over = self
            .start_ns
            .is_none_or(|s| now.saturating_sub(s) >= self.length_ns);
        if over {
            self.start_ns = Some(now);
        }
        over
    }
}

/// Mooncake error codes a policy commonly answers with.
pub mod error_code {
    /// vLLM's connector skips stores on this one: the backpressure signal.
    pub const NO_AVAILABLE_HANDLE: i32 = -200;
    pub const INVALID_PARAMS: i32 = -600;
}

/// Logs through moongate's logger.
pub fn log(level: host::Level, message: &str) {
    host::log(level, message)
}

/// Exports `$t: Policy` as the plugin's implementation.
#[macro_export]
macro_rules! export_policy {
    ($t:ty) => {
        mod __moongate_export {
            use super::*;
            use $crate::Policy as _;
            thread_local! {
                static STATE: ::std::cell::RefCell<Option<$t>> = const { ::std::cell::RefCell::new(None) };
            }
            fn with<R>(f: impl FnOnce(&mut $t) -> R) -> R {
                STATE.with(|s| f(s.borrow_mut().as_mut().expect("configure runs first")))
            }
            pub struct Export;
            impl $crate::bindings::Guest for Export {
                fn configure(config: Vec<u8>) -> Result<$crate::Interest, String> {
                    let (p, interest) = <$t as $crate::Policy>::new(&config)?;
                    STATE.with(|s| *s.borrow_mut() = Some(p));
                    Ok(interest)
                }
                fn on_put(call: $crate::PutCall) -> $crate::PutDecision {
                    with(|p| p.on_put(call))
                }
                fn on_lookup(call: $crate::LookupCall) -> Vec<Vec<u32>> {
                    with(|p| p.on_lookup(call))
                }
                fn split(call: $crate::SplitCall) -> Vec<u32> {
                    with(|p| p.split(call))
                }
                fn evict(call: $crate::EvictCall) -> Vec<u32> {
                    with(|p| p.evict(call))
                }
                fn observe(event: $crate::Observation) {
                    with(|p| p.observe(event))
                }
                fn block_keys(keys: $crate::PackedKeys) -> Vec<Option<$crate::BlockRef>> {
                    with(|p| p.block_keys(keys))
                }
                fn evict_tiered(call: $crate::TieredEvictCall) -> Vec<$crate::Victim> {
                    with(|p| p.evict_tiered(call))
                }
            }
            $crate::bindings::export!(Export with_types_in $crate::bindings);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_pack_and_unpack() {
        let k = PackedKeys::from_keys(&["a", "", "bcd"]);
        assert_eq!(k.len(), 3);
        assert_eq!(k.iter().collect::<Vec<_>>(), [&b"a"[..], b"", b"bcd"]);
        assert!(PackedKeys::from_keys::<&str>(&[]).is_empty());
    }

    #[test]
    fn blk_keys_are_blocks_chained_within_a_prefix() {
        let k = PackedKeys::from_keys(&[
            "a/blk/7",
            "a/blk/8",
            "b/blk/9",
            "b/blk/x",
            "plain",
            "a/blk/99999999999999999999999",
            "a/blk/",
            "a/blk/10",
        ]);
        let b = blocks_of_blk_keys(&k);
        let got: Vec<Option<(u64, Option<u64>)>> = b
            .iter()
            .map(|r| r.as_ref().map(|r| (r.hash, r.parent)))
            .collect();
        assert_eq!(
            got,
            [
                Some((7, None)),
                Some((8, Some(7))),
                Some((9, None)),
                None,
                None,
                None,
                None,
                Some((10, None)),
            ]
        );
    }

    #[test]
    fn splits_by_bytes_without_empty_parts_or_overflow() {
        assert_eq!(split_by_bytes(&[4, 4, 4, 4], 8), [2]);
        assert_eq!(split_by_bytes(&[10, 1, 1], 5), [1]);
        assert_eq!(split_by_bytes(&[u64::MAX, u64::MAX], 1), [1]);
        assert_eq!(split_by_bytes(&[], 1), Vec::<u32>::new());
    }

    #[test]
    fn decisions_admit_or_deny_every_key() {
        assert!(PutDecision::admit_all().admissions.is_empty());
        let d = PutDecision::deny_all(2, error_code::NO_AVAILABLE_HANDLE);
        assert!(matches!(
            d.admissions[..],
            [Admission::Deny(-200), Admission::Deny(-200)]
        ));
    }
}
