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
        world: "policy-with-hints",
        pub_export_macro: true,
        default_bindings_module: "moongate_policy_sdk::bindings",
    });
}

pub use bindings::moongate::policy::host;
pub use bindings::moongate::policy::types::{
    Admission, Block, BlockHash, BlockRef, BudgetState, CandidateHint, EvictCall, EvictScope,
    HintKind, HintedEvictCall, Interest, LookupCall, Observation, PackedKeys, PutCall, PutDecision,
    PutKind, ReplicateConfig, SoftPinAction, SplitCall, Tier, TieredEvictCall, Victim,
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

    /// Eviction victims knowing what the serving stack said of each candidate through
    /// moongate's hint API (WIT 0.1.4; moongate calls this instead of
    /// [`Policy::evict_tiered`] / [`Policy::evict`] when any candidate of a round has a
    /// hint). `call.hints[i]` is candidate `i`'s; `call.on_disk` is empty without an SSD
    /// tier. Default: hints unread, as [`Policy::evict_tiered`] with an SSD tier and
    /// [`Policy::evict`] (memory copies) without.
    fn evict_hinted(&mut self, call: HintedEvictCall) -> Vec<Victim> {
        if call.on_disk.is_empty() {
            return self
                .evict(call.call)
                .into_iter()
                .map(|index| Victim {
                    index,
                    scope: EvictScope::Memory,
                })
                .collect();
        }
        self.evict_tiered(TieredEvictCall {
            call: call.call,
            on_disk: call.on_disk,
        })
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

    /// The block each key names with hashes of any width and the KV-cache group (WIT
    /// 0.1.3; moongate calls this instead of [`Policy::block_keys`] when a plugin has
    /// it). Default: vLLM MooncakeStoreConnector keys as [`blocks_of_keys`] names them,
    /// every other key as [`Policy::block_keys`] does (so a plugin that overrides only
    /// `block_keys` keeps naming its keys).
    fn block_refs(&mut self, keys: PackedKeys) -> Vec<Option<Block>> {
        let narrow = self.block_keys(keys.clone());
        blocks_with(&keys, narrow)
    }
}

/// Blocks of the keys moongate knows how to name, in one call's order:
/// - vLLM's MooncakeStoreConnector keys,
///   `[CACHE_PREFIX@]MODEL@tp_rank:T@pcpP@dcpD@pp_rank:R@group:G@CHUNK_HASH_HEX`
///   (vLLM's `PoolKey`): the hash is the chunk hash's bytes (a digest: vLLM's block hash
///   of the chunk's last block), the group is `G`;
/// - `PREFIX/blk/HASH` keys (HASH a decimal `u64`, moongate's trace replay): the hash
///   is the number, no group.
///
/// A key's parent is the key before it in the same call when that one names a block of
/// the same prefix (everything but the hash): connectors store a request's chunks in
/// prefix order. Other keys name no block.
pub fn blocks_of_keys(keys: &PackedKeys) -> Vec<Option<Block>> {
    blocks_with(keys, blocks_of_blk_keys(keys))
}

/// vLLM connector keys named by [`split_vllm_key`] (each chained to the connector key
/// before it in the call when both share a prefix), every other key as `narrow` names it.
fn blocks_with(keys: &PackedKeys, narrow: Vec<Option<BlockRef>>) -> Vec<Option<Block>> {
    let mut narrow = narrow.into_iter();
    let mut out: Vec<Option<Block>> = Vec::with_capacity(keys.len());
    let mut prev: Option<(&[u8], Vec<u8>)> = None;
    for key in keys.iter() {
        let other = narrow.next().flatten();
        let Some((prefix, digest, group)) = split_vllm_key(key) else {
            prev = None;
            out.push(other.map(|b| Block {
                hash: BlockHash::Int(b.hash),
                parent: b.parent.map(BlockHash::Int),
                group: None,
            }));
            continue;
        };
        let parent = prev
            .take()
            .filter(|(p, _)| *p == prefix)
            .map(|(_, d)| BlockHash::Digest(d));
        out.push(Some(Block {
            hash: BlockHash::Digest(digest.clone()),
            parent,
            group: Some(group),
        }));
        prev = Some((prefix, digest));
    }
    out
}

/// A vLLM MooncakeStoreConnector key into (its prefix, the chunk hash's bytes, the
/// group), or `None` when it is not one. Read from the right, so a model name or cache
/// prefix may hold `@`.
pub fn split_vllm_key(key: &[u8]) -> Option<(&[u8], Vec<u8>, u32)> {
    let (prefix, hex) = rsplit_at(key)?;
    let digest = unhex(hex)?;
    let (rest, group) = rsplit_at(prefix)?;
    let group = number_after(group, b"group:")?;
    let (rest, pp) = rsplit_at(rest)?;
    number_after(pp, b"pp_rank:")?;
    let (rest, dcp) = rsplit_at(rest)?;
    number_after(dcp, b"dcp")?;
    let (rest, pcp) = rsplit_at(rest)?;
    number_after(pcp, b"pcp")?;
    let (model, tp) = rsplit_at(rest)?;
    number_after(tp, b"tp_rank:")?;
    if model.is_empty() {
        return None;
    }
    Some((prefix, digest, group))
}

/// `A@B` into (A, B) at the last `@`.
fn rsplit_at(s: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = s.iter().rposition(|&c| c == b'@')?;
    Some((&s[..at], &s[at + 1..]))
}

/// The decimal number after `label` in `field` (the whole rest).
fn number_after(field: &[u8], label: &[u8]) -> Option<u32> {
    let digits = field.strip_prefix(label)?;
    if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Lowercase or uppercase hex of 1 to 64 bytes into bytes.
fn unhex(hex: &[u8]) -> Option<Vec<u8>> {
    if hex.is_empty() || !hex.len().is_multiple_of(2) || hex.len() > 128 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks(2)
        .map(|p| Some((nibble(p[0])? << 4) | nibble(p[1])?))
        .collect()
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

/// FNV-1a: a stable 64-bit key hash for a plugin's own sets (std's default hasher seeds
/// itself from WASI randomness, which moongate does not give plugins).
pub fn key_hash(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Where stored blocks sit in their prefix chains, learned from puts: a batch put lists
/// a request's missing blocks in prefix order, so key i is the parent of key i+1
/// (vLLM / SGLang store one key per block of a token prefix). Bounded: each of the
/// parent set and the set of keys seen put keeps two generations of hashes, the older
/// dropped when the newer fills half of `max_tracked`.
pub struct Chains {
    max_tracked: usize,
    parents: std::collections::BTreeSet<u64>,
    older: std::collections::BTreeSet<u64>,
    seen: std::collections::BTreeSet<u64>,
    seen_older: std::collections::BTreeSet<u64>,
}

/// A block's place in its chain, in the order an eviction takes them
/// ([`Chains::place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    /// A leaf (nothing was stored after it) never found again since it was put: in
    /// block-hashed KV caches usually a prompt's partial last block, whose hash changes
    /// once the next turn fills it.
    UnreadLeaf,
    /// A leaf found again.
    ReadLeaf,
    /// A block another was stored after (every request extending it needs it first, so
    /// evicting it wastes its descendants), or one this instance never saw put (keys
    /// put before it loaded, or another fleet member's): kept longest.
    Inner,
}

impl Chains {
    pub fn new(max_tracked: usize) -> Chains {
        Chains {
            max_tracked: max_tracked.max(2),
            parents: Default::default(),
            older: Default::default(),
            seen: Default::default(),
            seen_older: Default::default(),
        }
    }

    /// Remembers the keys of a put, and which have a successor (all but the last).
    pub fn learn(&mut self, keys: &PackedKeys) {
        for i in 0..keys.len() {
            let h = key_hash(keys.get(i));
            self.seen.insert(h);
            if i + 1 < keys.len() {
                self.parents.insert(h);
            }
        }
        if self.parents.len() >= self.max_tracked / 2 {
            self.older = std::mem::take(&mut self.parents);
        }
        if self.seen.len() >= self.max_tracked / 2 {
            self.seen_older = std::mem::take(&mut self.seen);
        }
    }

    /// Where `key`, found `hits` times since it was put, sits.
    pub fn place(&self, key: &[u8], hits: u32) -> Place {
        let h = key_hash(key);
        let parent = self.parents.contains(&h) || self.older.contains(&h);
        let seen = self.seen.contains(&h) || self.seen_older.contains(&h);
        if parent || !seen {
            Place::Inner
        } else if hits > 0 {
            Place::ReadLeaf
        } else {
            Place::UnreadLeaf
        }
    }

    /// Hashes held as parents (a gauge's worth).
    pub fn parents(&self) -> usize {
        self.parents.len() + self.older.len()
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
                fn block_refs(keys: $crate::PackedKeys) -> Vec<Option<$crate::Block>> {
                    with(|p| p.block_refs(keys))
                }
                fn evict_hinted(call: $crate::HintedEvictCall) -> Vec<$crate::Victim> {
                    with(|p| p.evict_hinted(call))
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

    /// A block's hash, parent (as bytes) and group.
    type Named = (Vec<u8>, Option<Vec<u8>>, Option<u32>);

    fn digest_of(b: &Option<Block>) -> Option<Named> {
        let b = b.as_ref()?;
        let bytes = |h: &BlockHash| match h {
            BlockHash::Digest(d) => d.clone(),
            BlockHash::Int(v) => v.to_be_bytes().to_vec(),
        };
        Some((bytes(&b.hash), b.parent.as_ref().map(bytes), b.group))
    }

    #[test]
    fn vllm_connector_keys_are_digest_blocks_with_their_group() {
        let h1 = "0a".repeat(32);
        let h2 = "FF".repeat(32);
        let h3 = "01".repeat(32);
        let k = PackedKeys::from_keys(&[
            format!("Qwen/Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h1}"),
            format!("Qwen/Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h2}"),
            // Another group of the same request: its own chain.
            format!("Qwen/Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@{h3}"),
            // A cache prefix, and a model name with an '@' in it.
            format!("team-a@m@v2@tp_rank:3@pcp1@dcp2@pp_rank:4@group:7@{h1}"),
            // Not connector keys: odd hex, no group, non-decimal rank, empty model.
            format!("m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{}", &h1[1..]),
            format!("m@tp_rank:0@pcp0@dcp0@pp_rank:0@{h1}"),
            format!("m@tp_rank:x@pcp0@dcp0@pp_rank:0@group:0@{h1}"),
            format!("@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h1}"),
            "a/blk/5".to_string(),
            "a/blk/6".to_string(),
        ]);
        let b: Vec<_> = blocks_of_keys(&k).iter().map(digest_of).collect();
        let (d1, d2, d3) = (vec![0x0a; 32], vec![0xff; 32], vec![0x01; 32]);
        assert_eq!(b[0], Some((d1.clone(), None, Some(0))));
        assert_eq!(b[1], Some((d2.clone(), Some(d1.clone()), Some(0))));
        assert_eq!(b[2], Some((d3, None, Some(1))));
        assert_eq!(b[3], Some((d1, None, Some(7))));
        assert_eq!(b[4..8], [None, None, None, None]);
        assert_eq!(
            b[8..],
            [
                Some((5u64.to_be_bytes().to_vec(), None, None)),
                Some((
                    6u64.to_be_bytes().to_vec(),
                    Some(5u64.to_be_bytes().to_vec()),
                    None
                )),
            ]
        );
        let (prefix, _, group) = split_vllm_key(k.get(3)).unwrap();
        assert_eq!(prefix, b"team-a@m@v2@tp_rank:3@pcp1@dcp2@pp_rank:4@group:7");
        assert_eq!(group, 7);
    }
}
